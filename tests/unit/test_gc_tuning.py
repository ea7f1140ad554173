"""The serving replicas' garbage-collector setting."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points

import pytest

from engines import gc_tuning


@pytest.fixture
def restore_gc() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_the_young_generation_is_collected_less_often_and_the_older_ratios_kept(
    restore_gc: None,
) -> None:
    gc.set_threshold(700, 7, 9)
    gc_tuning.tune_for_serving()
    assert gc.get_threshold() == (gc_tuning.YOUNG_THRESHOLD, 7, 9)
    gc_tuning.tune_for_serving(5000)
    assert gc.get_threshold() == (5000, 7, 9)


def test_a_threshold_below_one_is_refused(restore_gc: None) -> None:
    before = gc.get_threshold()
    with pytest.raises(ValueError, match="young must be >= 1"):
        gc_tuning.tune_for_serving(0)
    assert gc.get_threshold() == before


@pytest.mark.parametrize(("process", "frozen"), [("EngineCore", True), ("MainProcess", False)])
def test_a_vllm_engine_core_freezes_its_heap_once_python_exits(process: str, frozen: bool) -> None:
    """The plugin vLLM loads into its processes (the installed entry point), run twice as vLLM
    may: one exit hook; by the time the hooks registered before it run, an engine core's heap
    sits in the permanent generation, and any other process's does not."""
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("kvroute_gc") == "engines.gc_tuning:freeze_at_exit"
    code = (
        "import atexit, gc, multiprocessing\n"
        "from importlib.metadata import entry_points\n"
        f"multiprocessing.current_process().name = {process!r}\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count()))\n"
        "(plugin,) = entry_points(group='vllm.general_plugins', name='kvroute_gc')\n"
        "register = plugin.load()\n"
        "hooks = atexit._ncallbacks()\n"
        "register(); register()\n"
        "print('hooks', atexit._ncallbacks() - hooks)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert out[:3] == ["hooks", "1", "frozen"]
    assert (int(out[3]) > 1000) is frozen
