"""Lazy numba compilation for the cache map's hot loops.

``@jit`` marks a plain-Python kernel; numba is imported and the kernel compiled (or loaded from
numba's on-disk cache) on its first call, not at import. NOTE: importing numba in a script's
``__main__`` before a vLLM CPU engine spawns its worker crashes that worker, so nothing in
``cachemap`` may import numba at module level.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    compiled: list[Callable[..., Any]] = []

    @functools.wraps(fn)  # the plain kernel stays reachable as ``__wrapped__``
    def call(*args: Any) -> Any:
        if not compiled:
            from numba import njit

            compiled.append(njit(cache=True, nogil=True)(fn))
        return compiled[0](*args)

    return call
