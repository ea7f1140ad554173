"""The live progress line: rate, in-flight, errors and p50 TTFT from the runner's counters."""

from __future__ import annotations

import asyncio

import pytest

from loadgen.progress import _info, show_progress
from loadgen.runner import LiveStats


def test_info_line() -> None:
    stats = LiveStats(planned=10, sent=6, done=4, errors=1, inflight=2, cap_delayed=3)
    stats.recent_ttft_s.extend([0.010, 0.020, 0.030])
    line = _info(stats, 123.4)
    for part in ("123.4 req/s", "in-flight     2", "errors    1", "p50 TTFT 20.0 ms", "capped 3"):
        assert part in line
    assert "p50 TTFT -" in _info(LiveStats(), 0.0)


def test_progress_runs_until_stopped(capsys: pytest.CaptureFixture[str]) -> None:
    stats = LiveStats(planned=5)

    async def go() -> None:
        stop = asyncio.Event()
        shown = asyncio.create_task(show_progress(stats, stop, interval_s=0.01))
        for _ in range(5):
            stats.sent += 1
            stats.done += 1
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.wait_for(shown, 5)

    asyncio.run(go())
    err = capsys.readouterr().err
    assert "loadgen" in err and "5/5" in err
