"""A vLLM engine core, and its model workers, end when the process that started them dies.

vLLM 0.32's ``AsyncLLM`` runs its engine core in a child process (``multiprocessing``, fork by
default, spawn inside a Ray actor or once CUDA is up), named ``EngineCore`` (``EngineCore_DP<n>``
under data parallelism); its ``mp`` executor's model workers are children of the engine core
(``VllmWorker-<rank>``). Nothing in the engine core watches its parent: the workers read a death
pipe from it once their model is loaded, but a front end killed with SIGKILL (the OOM killer, a
replica's hard kill) left the engine core, with its worker and the front end's
``multiprocessing`` resource tracker, running under init for good: holding the GPU's memory, so
the replacement replica could not start. Ray cleans an actor's children only on the actor's own
exit, or with options off by default (``RAY_kill_child_processes_on_worker_exit*``), and a bare
process or ``kvroute serve`` has nothing of the kind.

``install`` is a vLLM general plugin (``pyproject.toml``), which vLLM loads into every process
it starts: in a spawned engine core or worker it arms the watchdog there; in any other process
(the front end) it registers a ``multiprocessing`` after-fork hook, which arms it in each engine
core or worker that process forks, before vLLM's code runs in it (vLLM does not load plugins
again in a forked child). The watchdog is one daemon thread blocked on the parent's sentinel
(``multiprocessing.parent_process()``: a pipe that reads end-of-file once the parent is gone),
waking every ``POLL_S`` to compare ``os.getppid()`` with the parent (the sentinel waits for every
process that inherited the parent's end of the pipe, e.g. a second engine core forked later by
the same front end). When the parent is gone it sends the process SIGTERM, vLLM's own shutdown
(the engine core aborts its requests and stops its workers), and SIGKILL ``GRACE_S`` later if the
process still runs. Nothing runs on the engine's hot path.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import threading
import time
from multiprocessing.connection import wait

log = logging.getLogger(__name__)

# the names vLLM gives the processes it starts (vllm/v1/engine/utils.py, CoreEngineProcManager;
# vllm/v1/executor/multiproc_executor.py, WorkerProc.make_worker_process)
WATCHED_PREFIXES = ("EngineCore", "VllmWorker")
POLL_S = 1.0
GRACE_S = 5.0

_armed = False
_hook_registered = False


class _Anchor:
    """What ``multiprocessing.util.register_after_fork`` keys its hook on (held for good)."""


_ANCHOR = _Anchor()


def install() -> None:
    """The ``vllm.general_plugins`` entry point. Idempotent: vLLM may load plugins repeatedly."""
    global _hook_registered
    if watched(multiprocessing.current_process().name):
        arm()
    if not _hook_registered:
        _hook_registered = True
        multiprocessing.util.register_after_fork(_ANCHOR, _after_fork)


def watched(process_name: str) -> bool:
    return process_name.startswith(WATCHED_PREFIXES)


def _after_fork(_: object) -> None:
    # runs in a forked multiprocessing child once it knows its name and parent, before its
    # target; the parent's watchdog thread did not survive the fork
    global _armed
    _armed = False
    if watched(multiprocessing.current_process().name):
        arm()


def arm(poll_s: float = POLL_S, grace_s: float = GRACE_S) -> bool:
    """Start this process's watchdog on its ``multiprocessing`` parent (False: none to watch,
    or already armed)."""
    global _armed
    parent = multiprocessing.parent_process()
    if _armed or parent is None or parent.pid is None:
        return False
    # a forkserver's child is the server's, not the starting process's: its sentinel alone says
    ppid = None if multiprocessing.get_start_method(allow_none=True) == "forkserver" else parent.pid
    threading.Thread(
        target=_watch,
        args=(parent.sentinel, ppid, poll_s, grace_s),
        name="kvroute-parent-watchdog",
        daemon=True,
    ).start()
    _armed = True
    return True


def _watch(sentinel: int, ppid: int | None, poll_s: float, grace_s: float) -> None:
    while not wait([sentinel], timeout=poll_s) and (ppid is None or os.getppid() == ppid):
        pass
    name = multiprocessing.current_process().name
    log.warning("%s (pid %d): its parent is gone; shutting down", name, os.getpid())
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    log.warning(
        "%s (pid %d): still running %.0f s after SIGTERM; killing it", name, os.getpid(), grace_s
    )
    os.kill(os.getpid(), signal.SIGKILL)
