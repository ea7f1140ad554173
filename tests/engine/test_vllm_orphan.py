"""A process hosting a ``VllmEngine`` that is killed with SIGKILL (as the OOM killer kills) takes
vLLM's engine core with it, and every other process it started (issue 59): within seconds, with
the engine core forked (a bare process, ``kvroute serve``) and spawned (a Ray actor)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("vllm")

from engines.tiny_model import build_tiny_model
from tests.support import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow]

HOST = """
import asyncio, os, sys
from engines.vllm_engine import VllmEngine

async def main() -> None:
    engine = VllmEngine(sys.argv[1], "orphan", block_size=32, max_model_len=256)
    await engine.start()
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    await asyncio.sleep(3600)

if __name__ == "__main__":
    asyncio.run(main())
"""
START_S = 240.0
GONE_S = 10.0  # the watchdog's poll (1 s) and its grace after SIGTERM (5 s), with room


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_killing_the_host_ends_the_engine_core_and_its_helpers(tmp_path: Path) -> None:
    model = str(build_tiny_model())
    script = tmp_path / "host.py"
    script.write_text(HOST)
    # both start methods at once (two cores: about the time of one): vLLM forks its engine core
    # by default and spawns it inside a Ray actor (it forces spawn there)
    hosts: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    tree: list[psutil.Process] = []
    try:
        for method in ("fork", "spawn"):
            ready = tmp_path / f"{method}.ready"
            env = dict(os.environ, VLLM_WORKER_MULTIPROC_METHOD=method)
            with open(tmp_path / f"{method}.log", "wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, str(script), model, str(ready)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            hosts[method] = proc, ready
        for method, (proc, ready) in hosts.items():
            up = wait_for(lambda p=proc, r=ready: r.exists() or p.poll() is not None, START_S, 0.2)
            log = (tmp_path / f"{method}.log").read_text(errors="replace")[-3000:]
            assert up and ready.exists(), f"{method} host did not start:\n{log}"
        for method, (proc, _) in hosts.items():
            children = psutil.Process(proc.pid).children(recursive=True)
            names = [" ".join(c.cmdline()) for c in children]
            assert any("EngineCore" in n for n in names), f"{method}: no engine core in {names}"
            tree += children
        t0 = time.monotonic()
        for proc, _ in hosts.values():
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        wait_for(lambda: all(_gone(p) for p in tree), GONE_S, 0.1)
        alive = [f"{p.pid} {' '.join(p.cmdline()).strip()}" for p in tree if not _gone(p)]
        took = time.monotonic() - t0
        assert not alive, f"alive {took:.1f} s after their host's SIGKILL: {alive}"
        print(f"{len(tree)} processes gone {took:.1f} s after their hosts' SIGKILL")
    finally:
        for proc, _ in hosts.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for p in tree:
            if not _gone(p):
                p.kill()
