"""Test tiers by folder: tests/unit -> unit, tests/integration -> integration, tests/engine ->
engine (also marked explicitly in those modules), tests/hostile -> hostile. `make test-*` selects
by folder or marker."""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.ray_token import use_session_token
from tests import home_guard

_TIERS = {"unit", "integration", "engine", "hostile"}
_HOME_BEFORE = pytest.StashKey[dict[str, home_guard.Manifest]]()

# vLLM reports usage statistics into ~/.config/vllm unless told not to (engines and Ray workers
# inherit this from the test process).
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
# vLLM's CPU platform runs a one-worker engine's model in a second process of its own (the
# engine core's "mp" executor, for OpenMP thread binding) unless this is 0; then the engine core
# process runs it ("uni"): one Python start-up (~6 s) and one worker shutdown (~2 s) less per
# engine, the same engine core, scheduler, connectors and model runner. The tiny test model
# gains nothing from binding. AsyncLLM keeps its engine core in a process of its own either way.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# matplotlib (loadgen's reports) makes ~/.config/matplotlib unless given a directory of its own
_MPL_DIR = tempfile.mkdtemp(prefix="kvroute-tests-mpl-")
os.environ.setdefault("MPLCONFIGDIR", _MPL_DIR)
atexit.register(shutil.rmtree, _MPL_DIR, True)


# the tests' Ray clusters authenticate with a token of the session's own, not one in HOME
use_session_token("kvroute-tests-ray-")


def pytest_configure(config: pytest.Config) -> None:
    """Never test old code: compiled modules built from other sources than those on disk
    (deploy/native.py: their own, or a module they import) are rebuilt first (or removed, where
    compiling fails: the suite then tests pure Python). A tree with nothing compiled is left as
    it is, and so is a build that an edit elsewhere (outside what they import) does not touch."""
    from deploy import native

    if native.stale():
        why = native.describe(native.changes() or ["files of another build"])
        ok = native.build()
        print(f"kvroute native: {why}: {'rebuilt' if ok else 'removed'}", file=sys.stderr)
    if not hasattr(config, "workerinput"):  # the xdist controller (or a run without xdist) guards
        config.stash[_HOME_BEFORE] = home_guard.snapshot()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write ``--module-seconds-out``; fail the run when a test left something in HOME or
    changed /etc/ssh (tests/home_guard.py)."""
    _write_module_seconds(session.config)
    before = session.config.stash.get(_HOME_BEFORE, None)
    if before is None:
        return
    changed = home_guard.differences(before, home_guard.snapshot())
    if changed:
        print(
            "\nkvroute home guard: the tests changed the machine outside their temporary "
            "directories:\n  " + "\n  ".join(changed[:50]),
            file=sys.stderr,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# Seconds each test module took in a whole run (setup, call and teardown of its tests, summed):
# the order below hands the longest out first. Written by ``--module-seconds-out``; a module not
# in it counts as 0 s (it goes last), so refresh the file when a module grows long.
_MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--module-seconds-out",
        metavar="PATH",
        help="write each test module's seconds in this run as JSON (tests/module_seconds.json "
        "is the copy the test order reads), merged into PATH's modules",
    )


@functools.cache
def _module_seconds() -> dict[str, float]:
    try:
        data: dict[str, float] = json.loads(_MODULE_SECONDS.read_text())
    except FileNotFoundError:
        return {}
    return data


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tier markers from the folder; then the order ``--dist loadgroup`` (below) hands units out
    in: modules marked ``ray`` (the one that brings up a cluster of its own first), then every
    other module, longest first (``tests/module_seconds.json``), so that short ones fill the end
    and the two workers finish together."""
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in _TIERS:
            item.add_marker(getattr(pytest.mark, tier))
    seconds = _module_seconds()
    items.sort(
        key=lambda it: (
            not _in_ray_unit(it.config.rootpath, it.nodeid),
            _shares_ray(it),
            -seconds.get(it.nodeid.split("::", 1)[0], 0.0),
        )
    )


_RUN_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each module's seconds in this run, for ``--module-seconds-out`` (on the xdist controller
    too: workers' reports reach it)."""
    module = report.nodeid.split("::", 1)[0]
    _RUN_SECONDS[module] = _RUN_SECONDS.get(module, 0.0) + report.duration


def _write_module_seconds(config: pytest.Config) -> None:
    out = config.getoption("--module-seconds-out")
    if not out or hasattr(config, "workerinput") or not _RUN_SECONDS:
        return
    path = Path(out)
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update({m: round(s, 1) for m, s in _RUN_SECONDS.items()})
    path.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")


@functools.cache
def _is_ray_module(root: Path, file: str) -> bool:
    return "pytest.mark.ray" in (root / file).read_text(encoding="utf-8")


def _in_ray_unit(root: Path, nodeid: str) -> bool:
    """Whether the scheduler below puts ``nodeid`` in the Ray unit: its module is marked ``ray``.
    The controller that schedules has node ids only, no markers, so the module's source says."""
    return _is_ray_module(root, nodeid.split("::", 1)[0])


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent under -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``, in units of our own: a module (its fixtures start engines and servers
    once), except that every module marked ``ray`` is one unit, run on one worker one after the
    other. Two Ray clusters on one machine do not stay apart: ``ray.init()`` joins the one
    ``ray up`` started, and overlapping Ray modules crashed an xdist worker. (xdist 3.8's own
    ``xdist_group`` suffix does not reach pytest 9's node ids.) Units go out in collection order."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class ModuleUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if _in_ray_unit(root, nodeid) else nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False
    return ModuleUnits(config, log)


def _shares_ray(item: pytest.Item) -> bool:
    """Whether ``item``'s module runs on the Ray unit's shared local Ray: marked ``ray``, not
    ``ray(shared=False)`` (a module that brings up a cluster of its own, as ``ray up`` does)."""
    mark = item.get_closest_marker("ray")
    return mark is not None and mark.kwargs.get("shared", True)


@pytest.fixture(scope="module", autouse=True)
def _one_ray_for_the_ray_unit(request: pytest.FixtureRequest) -> Iterator[None]:
    """The Ray modules share one local Ray, started by the first that runs (in the mode
    ``kvroute serve`` runs Serve in) and stopped when the unit ends (``pytest_runtest_teardown``
    below): a cluster start and stop (~9 s) per module less. A module marked
    ``ray(shared=False)`` runs with no Ray started here; the unit runs it first. Each module
    still starts and shuts down its own Serve and removes its actors."""
    item = request.node
    if item.get_closest_marker("ray") is not None:
        import ray

        if _shares_ray(item):
            if not ray.is_initialized():
                from deploy.config import apply_ray_serve_env

                apply_ray_serve_env()
                ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        elif ray.is_initialized():
            ray.shutdown()
    yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the module fixtures of the Ray unit's last test are torn down, stop the Ray they
    shared, so that no Ray runs beside the tests that follow on this worker."""
    try:
        return (yield)
    finally:
        ray = sys.modules.get("ray")
        if (
            ray is not None
            and ray.is_initialized()
            and (nextitem is None or not _shares_ray(nextitem))
        ):
            ray.shutdown()


@pytest.fixture(autouse=True)
def _ray_only_where_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that runs with Ray started outside the Ray unit (its module not marked ``ray``, as
    the scheduler reads it) would run beside another Ray module under xdist: fail it here
    instead of flaking there."""
    yield
    ray = sys.modules.get("ray")
    node = request.node
    if (
        ray is not None
        and ray.is_initialized()
        and not _in_ray_unit(node.config.rootpath, node.nodeid)
    ):
        pytest.fail("this test runs with Ray started: mark its module pytestmark = pytest.mark.ray")
