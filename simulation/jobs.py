"""Simulations in forked worker processes: the ``--jobs`` of ``kvroute simulate``, ``plan`` and
the benchmark suites. Workers are forked, not spawned: they inherit the workload, the profiles
and the calls themselves, and only results are pickled back."""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from typing import Any, TypeVar

# ``--jobs``'s default wherever simulations run in forked workers
DEFAULT_JOBS = min(2, os.cpu_count() or 1)


def check_jobs(jobs: int) -> None:
    """A process count for ``fork_pool``: raises naming ``--jobs`` below 1."""
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")


def fork_pool(jobs: int) -> ProcessPoolExecutor | None:
    """``jobs`` worker processes forked from this one (they inherit its memory: a workload
    and profiles are shared, not pickled), or None for ``jobs`` == 1 (run here)."""
    check_jobs(jobs)
    if jobs == 1:
        return None
    sys.stdout.flush()  # a buffer a worker inherited would be written twice
    sys.stderr.flush()
    return ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))


T = TypeVar("T")

# the calls ``run_each``'s forked workers make (inherited at the fork, never pickled)
_INHERITED: list[Callable[[], Any]] = []


def _call_inherited(k: int) -> Any:
    return _INHERITED[k]()


def run_each(
    calls: Sequence[Callable[[], T]],
    jobs: int,
    poll: Callable[[], None] | None = None,
    poll_s: float = 0.1,
) -> list[T]:
    """Every call's result, in order: made here one after another when ``jobs`` is 1, else
    ``jobs`` at a time in forked workers (``fork_pool``); the calls (closures too) are
    inherited, only their results are pickled. ``poll`` runs every ``poll_s`` while workers
    run (a progress bar's refresh). The first call to raise ends the batch (calls not started
    are cancelled) and its exception is raised here as the call would have raised it."""
    check_jobs(jobs)
    pool = fork_pool(max(1, min(jobs, len(calls))))
    if pool is None:
        return [call() for call in calls]
    if _INHERITED:
        raise RuntimeError("run_each: already running a batch in this process")
    _INHERITED[:] = calls
    try:
        with pool:
            futures = [pool.submit(_call_inherited, k) for k in range(len(calls))]
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=poll_s, return_when=FIRST_EXCEPTION)
                if poll is not None:
                    poll()
                failed = [f for f in futures if f in done and f.exception() is not None]
                if failed:
                    pool.shutdown(cancel_futures=True)
                    failed[0].result()
            return [f.result() for f in futures]
    finally:
        _INHERITED.clear()
