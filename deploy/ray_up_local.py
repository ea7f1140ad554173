"""``ray up`` for real, on this machine: Ray's local node provider over SSH to localhost, then
``kvroute serve --ray-address auto`` on the Redis bus, requests through it, and ``ray down``.
Prints JSON (seconds per step, what the requests got); exits non-zero if a step fails.

    .venv/bin/python deploy/ray_up_local.py [--timeout-s 600]

What it prepares first (idempotent; root or passwordless sudo for the packages):
- Debian's ``openssh-server`` and ``rsync`` (``ray up`` uses both), an SSH key
  ``~/.ssh/kvroute_local`` authorised for this user, and an ``sshd`` on 127.0.0.1:22 if none
  listens there (stopped again at the end);
- ``~/kvroute`` linked to this repository (the path ``deploy/cluster-local.yaml`` names, as
  ``/home/ubuntu/kvroute`` is on AWS);
- the secrets ``deploy/cluster.yaml`` takes from ``~/.kvroute``: ``redis.password`` and
  ``admin.key`` (random, created if missing).

Then, each step timed: ``ray up -y deploy/cluster-local.yaml`` (the node set-up of
``deploy/node-setup.sh``: install, Redis behind its ACL user; ``ray start --head``);
``kvroute serve --ray-address auto`` with ``deploy/serve-sim.yaml`` moved onto that Redis; a
chat completion, the same prompt again (its cached tokens: the KV events went engine -> Redis ->
router), the bus's streams in Redis (read as the ACL user; the default user is refused); then
``kvroute serve`` stopped, ``ray down -y`` (and ``ray stop`` here: ray down's own runs where
this venv's ``ray`` is not on PATH), Redis stopped.
"""

from __future__ import annotations

import argparse
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
from pathlib import Path
from typing import Any

import httpx
import yaml

from engines.vllm_engine import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
HOME = Path.home()
KEY = HOME / ".ssh" / "kvroute_local"
SECRETS = HOME / ".kvroute"
CLUSTER = REPO / "deploy" / "cluster-local.yaml"
GCS_PORT = 6379  # Ray's head (deploy/cluster-local.yaml)
REDIS_PORT = 6390


def sh(
    *cmd: str | Path, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, check=check
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


def ensure_ssh() -> subprocess.Popen[bytes] | None:
    """Key, authorisation, and an sshd on 127.0.0.1:22; returns the sshd this run started."""
    KEY.parent.mkdir(mode=0o700, exist_ok=True)
    if not KEY.exists():
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kvroute-local", "-f", KEY)
    auth = KEY.parent / "authorized_keys"
    pub = KEY.with_suffix(".pub").read_text().strip()
    if pub not in (auth.read_text() if auth.exists() else ""):
        with auth.open("a") as f:
            f.write(pub + "\n")
    auth.chmod(0o600)
    started = None
    if not listening(22):
        Path("/run/sshd").mkdir(exist_ok=True)
        sh("ssh-keygen", "-A")
        started = subprocess.Popen(
            [
                "/usr/sbin/sshd",
                "-D",
                "-o",
                "ListenAddress=127.0.0.1",
                "-o",
                "PermitRootLogin=prohibit-password",
                "-o",
                "PasswordAuthentication=no",
            ]
        )
        deadline = time.monotonic() + 10
        while not listening(22):
            if time.monotonic() > deadline or started.poll() is not None:
                raise RuntimeError("sshd did not start on 127.0.0.1:22")
            time.sleep(0.1)
    sh(
        "ssh",
        "-i",
        KEY,
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "BatchMode=yes",
        f"{os.environ.get('USER', 'root')}@127.0.0.1",
        "true",
        timeout=30,
    )
    return started


def ensure_layout() -> None:
    link = HOME / "kvroute"
    if link.is_symlink() and link.resolve() != REPO:
        link.unlink()
    if not link.exists():
        link.symlink_to(REPO)
    elif link.resolve() != REPO:
        raise RuntimeError(f"{link} exists and is not this repository ({REPO}): move it away")
    SECRETS.mkdir(mode=0o700, exist_ok=True)
    for name in ("redis.password", "admin.key"):
        path = SECRETS / name
        if not path.exists() or not path.read_text().strip():
            path.write_text(secrets.token_hex(32) + "\n")
        path.chmod(0o600)


def serve_config(workdir: Path, port: int) -> Path:
    cfg = yaml.safe_load((REPO / "deploy" / "serve-sim.yaml").read_text())
    cfg["port"] = port
    cfg["app_name"] = "kvroute-local"
    cfg["engines"]["bus"] = {
        "backend": "redis",
        "name": "kvroute-local",
        "redis_url": f"redis://127.0.0.1:{REDIS_PORT}/0",
        "redis_username": "kvroute",
        "redis_password_file": str(SECRETS / "redis.password"),
    }
    cfg["router"]["admin_key_file"] = str(SECRETS / "admin.key")
    path = workdir / "serve-local.yaml"
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


def redis_streams() -> dict[str, Any]:
    password = (SECRETS / "redis.password").read_text().split()[0]
    cli = ["redis-cli", "-p", str(REDIS_PORT), "--no-auth-warning"]
    keys = sh(*cli, "--user", "kvroute", "--pass", password, "--scan", "--pattern", "kvroute*")
    anonymous = sh(*cli, "ping", check=False)
    return {
        "streams": sorted(keys.stdout.split()),
        "default_user_refused": "NOAUTH" in anonymous.stdout + anonymous.stderr
        or "WRONGPASS" in anonymous.stdout + anonymous.stderr,
    }


def ensure_ports_free() -> None:
    """The cluster's head binds Ray's GCS on ``GCS_PORT`` and its Redis on ``REDIS_PORT`` of this
    machine: a server already there would take the cluster's calls (a Redis without its ACL
    user, another Ray), so say so before ``ray up``."""
    for port, what in ((GCS_PORT, "Ray's GCS (another Ray?)"), (REDIS_PORT, "Redis")):
        if listening(port):
            raise RuntimeError(f"port {port}, the cluster's {what}, is in use here: stop it first")


def stop_ray(ray: Path) -> None:
    sh(ray, "stop", "--force", timeout=120, check=False)
    if listening(GCS_PORT):
        raise RuntimeError(f"the cluster's GCS still listens on {GCS_PORT} after ray stop")


def stop_redis() -> None:
    pid = SECRETS / "redis.pid"
    if pid.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid.read_text().strip()), signal.SIGTERM)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeout-s", type=float, default=600, help="per step")
    args = ap.parse_args()
    out: dict[str, Any] = {"ok": False}
    ray = BIN / "ray"
    sshd = None
    serve: subprocess.Popen[str] | None = None
    up = False
    t0 = time.monotonic()
    try:
        ensure_ports_free()  # first: before installing or starting anything
        ensure_packages()
        sshd = ensure_ssh()
        ensure_layout()
        out["prepare_s"] = round(time.monotonic() - t0, 1)
        t = time.monotonic()
        res = sh(ray, "up", "-y", "--no-config-cache", CLUSTER, timeout=args.timeout_s, check=False)
        up = True
        if res.returncode != 0:
            raise RuntimeError(
                f"ray up failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
            )
        out["ray_up_s"] = round(time.monotonic() - t, 1)
        with tempfile.TemporaryDirectory() as tmp:
            port = free_port()
            config = serve_config(Path(tmp), port)
            t = time.monotonic()
            serve = subprocess.Popen(
                [str(BIN / "kvroute"), "serve", "--ray-address", "auto", "--config", str(config)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=REPO,
            )
            assert serve.stdout is not None
            lines: list[str] = []
            deadline = time.monotonic() + args.timeout_s
            for line in serve.stdout:
                lines.append(line)
                if line.startswith("kvroute serving"):
                    break
                if time.monotonic() > deadline:
                    break
            if not lines or not lines[-1].startswith("kvroute serving"):
                raise RuntimeError("kvroute serve did not start:\n" + "".join(lines[-40:]))
            out["serve_ready_s"] = round(time.monotonic() - t, 1)
            out["requests"] = requests_through(f"http://127.0.0.1:{port}")
            out["redis"] = redis_streams()
            serve.send_signal(signal.SIGTERM)
            serve.wait(timeout=120)
            serve = None
        t = time.monotonic()
        res = sh(ray, "down", "-y", CLUSTER, timeout=args.timeout_s, check=False)
        up = False
        if res.returncode != 0:
            raise RuntimeError(f"ray down failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
        out["ray_down_s"] = round(time.monotonic() - t, 1)
        # NOTE: ray down's own `ray stop` runs in an SSH login shell, where this venv's `ray`
        # is not on PATH: it stops nothing. The head is this machine: stop it here.
        out["left_running_after_ray_down"] = listening(GCS_PORT)
        stop_ray(ray)
        req, red = out["requests"], out["redis"]
        out["ok"] = (
            req["completion_tokens"] == 8
            and req["cached_tokens_again"] > 0
            and any("kvroute-local" in k for k in red["streams"])
            and red["default_user_refused"]
        )
    except Exception as e:  # report what failed, as JSON, and exit non-zero
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if serve is not None:
            serve.kill()
        if up:
            sh(ray, "down", "-y", CLUSTER, timeout=args.timeout_s, check=False)
            stop_ray(ray)
        stop_redis()
        if sshd is not None:
            sshd.terminate()
        out["total_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out, indent=2))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
