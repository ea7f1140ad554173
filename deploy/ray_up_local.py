"""``ray up`` for real, on this machine: Ray's local node provider over SSH to localhost, then
``kvroute serve --ray-address auto`` on the Redis bus, requests through it, and ``ray down``.
Prints JSON (seconds per step, what the requests got); exits non-zero if a step fails.

    .venv/bin/python deploy/ray_up_local.py [--timeout-s 600] [--no-install]

Everything runs inside a temporary HOME, removed at the end (also on failure, SIGTERM or
SIGINT), so nothing of this machine's HOME or SSH set-up is used or changed:
- the ``ray up`` client, the driver and (through ``sshd``'s ``SetEnv``) every command on the
  "node" see that HOME: its ``~/kvroute`` links this repository (the path
  ``deploy/cluster-local.yaml`` names, as ``/home/ubuntu/kvroute`` is on AWS), its ``~/.kvroute``
  holds the secrets ``deploy/cluster.yaml`` takes from there (``redis.password``, ``admin.key``:
  random) and what the head adds (Ray's ``ray.token``, Redis's CA);
- SSH: a key in that HOME, authorised only by an ``sshd`` that ``ssh`` runs per connection as
  its ProxyCommand (inetd mode: no listening port) with that HOME's config, host key and
  ``authorized_keys``; ``/run/sshd`` (its privilege separation directory) is made only if
  missing and removed again. Debian's ``openssh-server`` and ``rsync`` must be installed
  (``make test`` does: root or passwordless sudo).

Then, each step timed: ``ray up -y`` (the node set-up of ``deploy/node-setup.sh``: install
unless ``--no-install``, Ray's token, Redis over TLS behind its ACL user; ``ray start --head``
with token auth); a Ray client without the token, refused; ``kvroute serve --ray-address
auto`` (with the token) with ``deploy/serve-sim.yaml`` moved onto that Redis; a chat
completion, the same prompt again (its cached tokens: the KV events went engine -> Redis ->
router), the bus's log in Redis (read as the ACL user over TLS; the default user, plain TCP and
admin commands refused); then ``kvroute serve`` stopped, ``ray down -y`` (and ``ray stop``
here: ray down's own runs where this venv's ``ray`` is not on PATH), Redis stopped.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from engines.ports import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CLUSTER = REPO / "deploy" / "cluster-local.yaml"
GCS_PORT = 6379  # Ray's head (deploy/cluster-local.yaml)
REDIS_PORT = 6390
PRIVSEP = Path("/run/sshd")


class Home:
    """The run's temporary HOME and the paths in it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.key = root / ".ssh" / "kvroute_local"
        self.secrets = root / ".kvroute"
        self.sshd = root / ".kvroute-sshd"
        self.redis_pid = root / ".kvroute-redis" / "redis.pid"
        self.token = self.secrets / "ray.token"

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment with HOME the temporary one (and no Ray address)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        env.pop("RAY_ADDRESS", None)
        return {**env, "HOME": str(self.root), **extra}

    def ray_auth(self) -> dict[str, str]:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token)}


def sh(
    *cmd: str | Path,
    timeout: float = 600,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, check=check, env=env
    )


def listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def ensure_packages() -> None:
    missing = [
        pkg
        for pkg, exe in (("openssh-server", "sshd"), ("rsync", "rsync"))
        if shutil.which(exe) is None and not Path(f"/usr/sbin/{exe}").exists()
    ]
    if not missing:
        return
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    sh(*sudo, "apt-get", "update", "-qq")
    sh(*sudo, "apt-get", "install", "-y", "-qq", *missing)


def prepare_home(home: Home, cluster: Path, install: bool) -> bool:
    """Key, sshd config and host key, secrets and the ``~/kvroute`` link in ``home``, and the
    cluster file the run uses (``deploy/cluster-local.yaml``, its set-up without the install
    step when ``install`` is off); returns whether it made ``/run/sshd``."""
    for d in (home.key.parent, home.secrets, home.sshd):
        d.mkdir(mode=0o700, parents=True)
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kvroute-local", "-f", home.key)
    host_key = home.sshd / "host_key"
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", host_key)
    auth = home.sshd / "authorized_keys"
    auth.write_text(home.key.with_suffix(".pub").read_text())
    auth.chmod(0o600)
    (home.sshd / "sshd_config").write_text(
        "\n".join(
            [
                f"HostKey {host_key}",
                f"AuthorizedKeysFile {auth}",
                "StrictModes no",  # the temporary directory sits under world-writable /tmp
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "PrintMotd no",
                "PrintLastLog no",
                "PidFile none",
                f"SetEnv HOME={home.root}",
                "",
            ]
        )
    )
    (home.root / ".bashrc").write_text("")  # Ray's commands source it
    (home.root / "kvroute").symlink_to(REPO)
    for name in ("redis.password", "admin.key"):
        path = home.secrets / name
        path.write_text(secrets.token_hex(32) + "\n")
        path.chmod(0o600)
    cfg = yaml.safe_load(CLUSTER.read_text())
    # NOTE: ssh expands a `~` of its own (-i, and the ProxyCommand's shell does not run for
    # it) from the passwd entry, not $HOME: the copy names the temporary HOME's paths
    cfg["auth"]["ssh_private_key"] = str(home.key)
    cfg["auth"]["ssh_proxy_command"] = cfg["auth"]["ssh_proxy_command"].replace(
        "~/", f"{home.root}/"
    )
    if not install:
        cfg["setup_commands"] = []
    cluster.write_text(yaml.safe_dump(cfg))
    made = not PRIVSEP.exists()
    if made:
        PRIVSEP.mkdir(mode=0o755)
    user = os.environ.get("USER", "root")
    sh(
        "ssh",
        *("-i", home.key, "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes"),
        *("-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"),
        *("-o", f"ProxyCommand={cfg['auth']['ssh_proxy_command']}"),
        f"{user}@127.0.0.1",
        "true",
        timeout=30,
        env=home.env(),
    )
    return made


def serve_config(home: Home, port: int) -> Path:
    cfg = yaml.safe_load((REPO / "deploy" / "serve-sim.yaml").read_text())
    cfg["port"] = port
    cfg["app_name"] = "kvroute-local"
    cfg["engines"]["bus"] = {
        "backend": "redis",
        "name": "kvroute-local",
        "redis_url": f"rediss://127.0.0.1:{REDIS_PORT}/0",
        "redis_ca_file": str(home.secrets / "redis-ca.crt"),
        "redis_username": "kvroute",
        "redis_password_file": str(home.secrets / "redis.password"),
    }
    cfg["router"]["admin_key_file"] = str(home.secrets / "admin.key")
    path = home.root / "serve-local.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def requests_through(base: str) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You route requests to their cache. " * 40},
            {"role": "user", "content": "hello through ray up"},
        ],
        "max_tokens": 8,
    }
    t0 = time.monotonic()
    first = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    first_ms = (time.monotonic() - t0) * 1e3
    first.raise_for_status()
    time.sleep(1.0)  # KV events: engine -> Redis stream -> router's map
    again = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    again.raise_for_status()
    return {
        "first_ms": round(first_ms, 1),
        "completion_tokens": first.json()["usage"]["completion_tokens"],
        "prompt_tokens": again.json()["usage"]["prompt_tokens"],
        "cached_tokens_again": again.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        "router": again.headers.get("x-kvroute-router"),
    }


def redis_streams(home: Home) -> dict[str, Any]:
    """The bus's log as the ACL user sees it, over TLS (the password in ``REDISCLI_AUTH``, never
    on a command line), and what that Redis refuses."""
    password = (home.secrets / "redis.password").read_text().split()[0]
    tls = ["--tls", "--cacert", str(home.secrets / "redis-ca.crt")]
    cli = ["redis-cli", "-h", "127.0.0.1", "-p", str(REDIS_PORT)]
    user = [*cli, *tls, "--user", "kvroute"]
    as_user = home.env(REDISCLI_AUTH=password)

    def said(r: subprocess.CompletedProcess[str]) -> str:
        return (r.stdout + r.stderr).strip()

    counter = sh(*user, "GET", "kvroute-local-kv-events:next", env=as_user, check=False)
    config = sh(*user, "CONFIG", "GET", "*", env=as_user, check=False)
    keys = sh(*user, "KEYS", "*", env=as_user, check=False)
    anonymous = sh(*cli, *tls, "ping", env=home.env(), check=False, timeout=30)
    plain = sh(*cli, "--user", "kvroute", "ping", env=as_user, check=False, timeout=30)
    return {
        "kv_events_published": int(counter.stdout.strip() or 0) if counter.returncode == 0 else -1,
        "default_user_refused": "NOAUTH" in said(anonymous) or "WRONGPASS" in said(anonymous),
        "acl_refuses_config_and_keys": "NOPERM" in said(config) and "NOPERM" in said(keys),
        "plain_tcp_refused": "PONG" not in said(plain),
    }


def ray_without_token(home: Home) -> dict[str, Any]:
    """A Ray client that connects to the head without the token, and one with a wrong one, at
    once. A refused client retries its first read from the GCS (``RAY_NUM_REDIS_GET_RETRIES``
    times, 2 s apart: ~20 s by default) before it gives up; these try twice."""
    code = f"import ray; ray.init(address='127.0.0.1:{GCS_PORT}'); print('CONNECTED')"
    retries = {"RAY_NUM_REDIS_GET_RETRIES": "2"}
    probes = {
        name: subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for name, env in (
            ("no_token", home.env(HOME=str(home.root / "nobody"), **retries)),
            ("wrong_token", home.env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64, **retries)),
        )
    }
    out = {}
    for name, probe in probes.items():
        try:
            text, _ = probe.communicate(timeout=120)
            out[name] = {
                "refused": probe.returncode != 0 and "CONNECTED" not in text,
                "says_auth": "auth" in text.lower() or "token" in text.lower(),
            }
        except subprocess.TimeoutExpired:
            probe.kill()
            probe.communicate()
            out[name] = {"refused": True, "says_auth": False, "timed_out": True}
    return out


def ensure_ports_free() -> None:
    """The cluster's head binds Ray's GCS on ``GCS_PORT`` and its Redis on ``REDIS_PORT`` of this
    machine: a server already there would take the cluster's calls (a Redis without its ACL
    user, another Ray), so say so before ``ray up``."""
    for port, what in ((GCS_PORT, "Ray's GCS (another Ray?)"), (REDIS_PORT, "Redis")):
        if listening(port):
            raise RuntimeError(f"port {port}, the cluster's {what}, is in use here: stop it first")


def stop_ray(ray: Path, home: Home) -> None:
    sh(ray, "stop", "--force", timeout=120, check=False, env=home.env())
    if listening(GCS_PORT):
        raise RuntimeError(f"the cluster's GCS still listens on {GCS_PORT} after ray stop")


def stop_redis(home: Home) -> None:
    if home.redis_pid.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(home.redis_pid.read_text().strip()), signal.SIGTERM)


class LocalRun:
    """One run's steps, each timed into ``out``; ``cleanup`` stops what the run started (once)."""

    def __init__(self, timeout_s: float, install: bool) -> None:
        self.timeout_s = timeout_s
        self.install = install
        self.out: dict[str, Any] = {"ok": False}
        self.ray = BIN / "ray"
        self.home = Home(Path(tempfile.mkdtemp(prefix="kvroute-ray-up-")))
        self.cluster = self.home.root / "cluster-local.yaml"
        self.serve: subprocess.Popen[str] | None = None
        self.up = self.privsep = self.cleaned = False

    def timed(self, key: str, step: Callable[[], Any]) -> Any:
        t = time.monotonic()
        result = step()
        self.out[key] = round(time.monotonic() - t, 1)
        return result

    def run(self) -> None:
        ensure_ports_free()  # first: before installing or starting anything
        ensure_packages()
        self.privsep = self.timed(
            "prepare_s", lambda: prepare_home(self.home, self.cluster, install=self.install)
        )
        self.timed("ray_up_s", lambda: self.ray_cluster("up", "-y", "--no-config-cache"))
        self.out["ray_auth"] = self.timed("ray_auth_s", lambda: ray_without_token(self.home))
        port = free_port()
        config = serve_config(self.home, port)
        self.timed("serve_ready_s", lambda: self.start_serve(config))
        self.timed("checks_s", lambda: self.check(f"http://127.0.0.1:{port}"))
        self.timed("serve_stop_s", self.stop_serve)
        self.timed("ray_down_s", lambda: self.ray_cluster("down", "-y"))
        # NOTE: ray down's own `ray stop` runs in an SSH login shell, where this venv's `ray`
        # is not on PATH: it stops nothing. The head is this machine: stop it here.
        self.out["left_running_after_ray_down"] = listening(GCS_PORT)
        self.timed("ray_stop_s", lambda: stop_ray(self.ray, self.home))
        req, red, auth = self.out["requests"], self.out["redis"], self.out["ray_auth"]
        self.out["ok"] = (
            req["completion_tokens"] == 8
            and req["cached_tokens_again"] > 0
            and red["kv_events_published"] > 0
            and red["default_user_refused"]
            and red["acl_refuses_config_and_keys"]
            and red["plain_tcp_refused"]
            and all(a["refused"] for a in auth.values())
        )

    def ray_cluster(self, *verb: str) -> None:
        """``ray up``/``ray down`` (``verb`` and its flags) on this run's cluster file; raises
        with the command's output when it fails."""
        res = sh(
            self.ray, *verb, self.cluster, timeout=self.timeout_s, check=False, env=self.home.env()
        )
        self.up = verb[0] == "up"  # a failed up may have started part of the cluster
        if res.returncode != 0:
            raise RuntimeError(
                f"ray {verb[0]} failed ({res.returncode}):\n{res.stdout[-3000:]}\n"
                f"{res.stderr[-3000:]}"
            )

    def start_serve(self, config: Path) -> None:
        self.serve = serve = subprocess.Popen(
            [str(BIN / "kvroute"), "serve", "--ray-address", "auto", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env=self.home.env(**self.home.ray_auth()),
        )
        assert serve.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + self.timeout_s
        for line in serve.stdout:
            lines.append(line)
            if line.startswith("kvroute serving") or time.monotonic() > deadline:
                break
        if not lines or not lines[-1].startswith("kvroute serving"):
            raise RuntimeError("kvroute serve did not start:\n" + "".join(lines[-40:]))

    def check(self, base: str) -> None:
        self.out["requests"] = requests_through(base)
        self.out["redis"] = redis_streams(self.home)

    def stop_serve(self) -> None:
        assert self.serve is not None
        self.serve.send_signal(signal.SIGTERM)
        self.serve.wait(timeout=120)
        self.serve = None

    def cleanup(self) -> None:
        """Stop what this run started, remove its HOME and /run/sshd if it made it (once)."""
        if self.cleaned:
            return
        self.cleaned = True
        if self.serve is not None and self.serve.poll() is None:
            self.serve.kill()
        if self.up:
            env = self.home.env()
            sh(self.ray, "down", "-y", self.cluster, timeout=self.timeout_s, check=False, env=env)
            sh(self.ray, "stop", "--force", timeout=120, check=False, env=env)
        stop_redis(self.home)
        if self.privsep:
            shutil.rmtree(PRIVSEP, ignore_errors=True)
        shutil.rmtree(self.home.root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeout-s", type=float, default=600, help="per step")
    ap.add_argument(
        "--no-install",
        action="store_true",
        help="skip node-setup.sh install (its pip install and native build into this "
        "repository's venv): the head is this checkout, already installed",
    )
    args = ap.parse_args()
    run = LocalRun(args.timeout_s, install=not args.no_install)

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally below

    atexit.register(run.cleanup)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t0 = time.monotonic()
    try:
        run.run()
    except Exception as e:  # report what failed, as JSON, and exit non-zero
        run.out["error"] = f"{type(e).__name__}: {e}"
    finally:
        run.timed("cleanup_s", run.cleanup)
        run.out["home_removed"] = not run.home.root.exists()
        run.out["total_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(run.out, indent=2))
    return 0 if run.out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
