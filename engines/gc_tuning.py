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
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000


def tune_for_serving(young: int = YOUNG_THRESHOLD) -> None:
    """Collect the youngest generation every ``young`` allocations (net of frees); the older
    generations keep their ratios (each collected once per 10 of the one below, by default)."""
    if young < 1:
        raise ValueError(f"young must be >= 1, got {young}")
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young, older, oldest)
