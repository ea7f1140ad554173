"""``ray up`` for real: ``deploy/ray_up_local.py`` brings a Ray cluster up on this machine with
Ray's local node provider (SSH to localhost; ``make test`` installs openssh-server and rsync),
runs ``kvroute serve --ray-address auto`` on the Redis bus (TLS, its ACL user) with Ray's token
auth, sends requests through it and takes everything down (``ray down``: ``ray stop`` on this
machine, so no other Ray may run here meanwhile; pytest runs the modules one after another).
It runs inside its own temporary HOME: this machine's HOME and /etc/ssh are left as they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray(shared=False)]

REPO = Path(__file__).resolve().parents[2]
# What a `ray up` over SSH would leave in a HOME: keys, authorisations, secrets, the repo link,
# Ray's token and bootstrap files, shell history
WATCHED = (
    ".ssh",
    ".kvroute",
    ".kvroute-redis",
    "kvroute",
    ".ray",
    "ray_bootstrap_config.yaml",
    "ray_bootstrap_key.pem",
    ".bash_history",
    ".bashrc",
    ".profile",
)


def tree(root: Path) -> list[tuple[str, int, int, float]]:
    """Every path under ``root`` (itself included; links not followed) with its mode, size and
    mtime; empty if it does not exist."""
    out = []
    if not root.exists() and not root.is_symlink():
        return out
    for path in (
        [root, *sorted(root.rglob("*"))] if root.is_dir() and not root.is_symlink() else [root]
    ):
        st = path.lstat()
        out.append((str(path), st.st_mode, st.st_size, st.st_mtime))
    return out


def machine_state() -> dict[str, object]:
    home = Path.home()
    return {
        "home_entries": sorted(p.name for p in home.iterdir()),
        **{name: tree(home / name) for name in WATCHED},
        "/etc/ssh": tree(Path("/etc/ssh")),
        "/run/sshd": tree(Path("/run/sshd")),
    }


def test_ray_up_serve_request_ray_down() -> None:
    before = machine_state()
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "deploy" / "ray_up_local.py"),
            "--timeout-s",
            "400",
            # the head is this checkout, which `make test` installed: no pip or native build
            # into its venv from the test
            "--no-install",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")},
    )
    assert machine_state() == before  # nothing of this machine's HOME or SSH set-up changed
    assert r.stdout.strip(), r.stderr[-3000:]
    out = json.loads(r.stdout)
    print("\nray up (local provider):", json.dumps(out))
    assert out["home_removed"], out
    assert r.returncode == 0 and out["ok"], out
    assert out["requests"]["cached_tokens_again"] > 0  # KV events crossed Redis
    redis = out["redis"]
    assert redis["kv_events_published"] > 0
    assert redis["default_user_refused"] and redis["plain_tcp_refused"]
    assert redis["acl_refuses_config_and_keys"]  # the node's ACL rule, deploy/redis-bus.acl
    # Ray's token auth: a client without the token, or with a wrong one, is refused, and told
    # why (not merely out of retries)
    for probe in ("no_token", "wrong_token"):
        assert out["ray_auth"][probe]["refused"], out["ray_auth"]
        assert out["ray_auth"][probe]["says_auth"], out["ray_auth"]
