"""``ray up`` for real: ``deploy/ray_up_local.py`` brings a Ray cluster up on this machine with
Ray's local node provider (SSH to localhost; ``make test`` installs openssh-server and rsync),
runs ``kvroute serve --ray-address auto`` on the Redis bus behind its ACL user, sends requests
through it and takes everything down (``ray down``: ``ray stop`` on this machine, so no other
Ray may run here meanwhile; pytest runs the modules one after another)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_ray_up_serve_request_ray_down() -> None:
    r = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "ray_up_local.py"), "--timeout-s", "400"],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=REPO,
    )
    assert r.stdout.strip(), r.stderr[-3000:]
    out = json.loads(r.stdout)
    print("\nray up (local provider):", json.dumps(out))
    assert r.returncode == 0 and out["ok"], out
    assert out["requests"]["cached_tokens_again"] > 0  # KV events crossed Redis
    assert out["redis"]["default_user_refused"]
