"""Live progress (rich): requests done of planned, live send rate, in-flight, errors, p50 TTFT."""

from __future__ import annotations

import asyncio
import contextlib
from time import perf_counter
from typing import Any

import numpy as np

from loadgen.runner import LiveStats


async def show_progress(stats: LiveStats, stop: asyncio.Event, interval_s: float = 0.25) -> None:
    """Refresh a rich progress bar from ``stats`` until ``stop`` is set (stderr only)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[bold]loadgen"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=Console(stderr=True),
        transient=False,
    )
    task = progress.add_task("run", total=stats.planned, info="")
    last_t, last_sent = perf_counter(), 0
    rate = 0.0
    with progress:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            now = perf_counter()
            if now > last_t:
                inst = (stats.sent - last_sent) / (now - last_t)
                rate = inst if rate == 0 else 0.7 * rate + 0.3 * inst
            last_t, last_sent = now, stats.sent
            progress.update(task, completed=stats.done, info=_info(stats, rate))
            if stop.is_set():
                break


def _info(stats: LiveStats, rate: float) -> str:
    ttft: Any = "-"
    if stats.recent_ttft_s:
        ttft = f"{float(np.median(np.fromiter(stats.recent_ttft_s, float))) * 1e3:.1f} ms"
    capped = f"  capped {stats.cap_delayed}" if stats.cap_delayed else ""
    return (
        f"{rate:8.1f} req/s  in-flight {stats.inflight:5d}  errors {stats.errors:4d}"
        f"  p50 TTFT {ttft}{capped}"
    )
