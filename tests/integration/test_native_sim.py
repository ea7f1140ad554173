"""The compiled hot modules (deploy/native.py) simulate exactly as their pure-Python sources."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deploy import native

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation.jsonl"

# the routers with their own hot paths: kv_ttft's candidate pricing and calibration, and
# round_robin (engines, events and load tracking alone)
ARGS = [
    "simulate",
    "--trace",
    str(TRACE),
    "--max-requests",
    "1500",
    "--rate-scale",
    "4",
    "--instances",
    "8",
    "--router",
    "kv_ttft,round_robin",
    "--engine",
    "cpu_capacity_blocks=64",
    "--json",
    "--no-progress",
    "--jobs",
    "1",
]

# prints where each of deploy/native.py's MODULES was loaded from, then simulates
PROBE = (
    "import importlib, sys; from deploy import native; from deploy.cli import main; "
    "[print('loaded:', importlib.import_module(m).__file__, file=sys.stderr) "
    "for m in native.MODULES]; sys.exit(main(sys.argv[1:]))"
)


def loaded(stderr: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in stderr.splitlines() if line.startswith("loaded: ")]


def simulate(root: Path) -> tuple[dict[str, Any], str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *ARGS],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout), done.stderr


def without_wall_time(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: without_wall_time(v) for k, v in x.items() if "wall" not in k}
    if isinstance(x, list):
        return [without_wall_time(v) for v in x]
    return x


def test_compiled_modules_simulate_exactly_as_pure_python(tmp_path: Path) -> None:
    if native.missing():
        pytest.skip("the hot modules are not compiled here (`make native`)")
    pure = tmp_path / "pure"
    shutil.copytree(
        native.ROOT,
        pure,
        ignore=shutil.ignore_patterns(
            f"*{native.SUFFIX}", ".venv*", ".git", "build", "__pycache__", "*.egg-info", "tests"
        ),
    )
    compiled, where = simulate(native.ROOT)
    files = loaded(where)
    assert len(files) == len(native.MODULES), where[-500:]
    assert all(f.endswith(native.SUFFIX) for f in files), files
    plain, where = simulate(pure)
    files = loaded(where)
    assert len(files) == len(native.MODULES) and all(f.endswith(".py") for f in files), files
    assert without_wall_time(compiled) == without_wall_time(plain)
    assert compiled["routers"]["kv_ttft"]["requests"] == 1500


def test_compiled_modules_import_as_an_installed_kvroute_does(tmp_path: Path) -> None:
    """The ``kvroute`` command and Ray workers find the packages through the install, with
    neither the repository root on sys.path nor it as the working directory."""
    if native.missing():
        pytest.skip("the hot modules are not compiled here (`make native`)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = (
        "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.', sys.argv[1])]; "
        "import router.core, engines.sim.virtual, simulation.cluster; "
        "print(router.core.__file__); print(engines.sim.virtual.__file__); "
        "print(simulation.cluster.__file__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(native.ROOT)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for line in done.stdout.split():
        assert line.startswith(str(native.ROOT)) and line.endswith(native.SUFFIX), line
