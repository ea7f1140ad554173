"""The garbage collector of a process that serves requests (the ingress and engine replicas).

A request's objects die young, by reference count, when it ends; what a young-generation
collection walks is what is alive at that moment: the requests in flight, each holding lists of
a prompt's token ids and block hashes (a list's traversal visits every element). So the walk
costs about the same however many allocations triggered it, and CPython's default trigger of
700 allocations runs it every few requests: in ``benchmarks/ingress_bench.py``'s kvroute app
the ingress replica spent 0.34 ms of CPU per request in collections (0.28 young ones a
request, and a full one every ~190 requests), each engine replica ~0.04 ms. A trigger of
``YOUNG_THRESHOLD`` allocations runs them ~30 times less often; garbage in reference cycles
(rare on these paths) waits that much longer to be freed.

A vLLM engine core process ends in cyclic collections of its whole heap: vLLM undoes its
start-up ``gc.freeze()`` at shutdown (re-freezing only on ROCm), and the interpreter's exit walks
and tears down the torch and vLLM object graph. On this machine that kept the tiny test model's
engine core busy on a core until ``AsyncLLM.shutdown`` killed it at its 5 s default, on every
engine stop. ``freeze_at_exit`` (loaded into every vLLM process as a general plugin,
``pyproject.toml``) freezes an engine core's heap once Python starts exiting, so the process ends
as soon as its own teardown is done (2.4 s from SIGTERM, exit code 0). What sits in reference
cycles is left to the process's end; triton's bindings report those objects as leaked on
stderr as the process exits.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing

YOUNG_THRESHOLD = 20_000


def tune_for_serving(young: int = YOUNG_THRESHOLD) -> None:
    """Collect the youngest generation every ``young`` allocations (net of frees); the older
    generations keep their ratios (each collected once per 10 of the one below, by default)."""
    if young < 1:
        raise ValueError(f"young must be >= 1, got {young}")
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young, older, oldest)


ENGINE_CORE_PROCESS = "EngineCore"  # vLLM's name for it (``EngineCore_DP<rank>`` under DP)
_frozen_at_exit = False


def freeze_at_exit() -> None:
    """In a vLLM engine core process, at interpreter exit, move every object still alive into the
    permanent generation, which no collection walks: the exit frees by reference count and skips
    the cyclic scans of the whole heap. Other processes (the ones serving HTTP, which vLLM loads
    its plugins into as well) exit as before. Idempotent: vLLM may load its plugins more than
    once in a process."""
    global _frozen_at_exit
    if not _frozen_at_exit:
        _frozen_at_exit = True
        atexit.register(_freeze_an_engine_core)


def _freeze_an_engine_core() -> None:
    if multiprocessing.current_process().name.startswith(ENGINE_CORE_PROCESS):
        gc.freeze()
