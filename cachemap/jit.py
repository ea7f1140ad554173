"""Lazy numba compilation for the cache map's hot loops.

``@jit`` marks a plain-Python kernel; numba is imported and the kernel compiled (or loaded from
numba's on-disk cache) on its first call, not at import. NOTE: importing numba in a script's
``__main__`` before a vLLM CPU engine spawns its worker crashes that worker, so nothing in
``cachemap`` may import numba at module level.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    compiled: list[Callable[..., Any]] = []

    def call(*args: Any) -> Any:
        if not compiled:
            from numba import njit

            compiled.append(njit(cache=True, nogil=True)(fn))
        return compiled[0](*args)

    call.__name__ = call.__qualname__ = fn.__name__
    call.__doc__ = fn.__doc__
    call.py_func = fn  # type: ignore[attr-defined]
    return call
