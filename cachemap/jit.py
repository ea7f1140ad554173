"""Lazy numba compilation for the cache map's hot loops.

``@jit`` marks a plain-Python kernel; numba is imported and the kernel compiled (or loaded from
numba's on-disk cache) on its first call, not at import. ``make native`` fills that cache
(``cachemap.map.warm_kernels``), so that no process compiles them at first use. A kernel may call
other ``@jit`` kernels (found by name in its globals): they are compiled with it, and it calls
their compiled form. NOTE: numba's cache of a kernel is checked against its own file only: after
editing a kernel another file's kernel calls, clear that file's cache (``__pycache__/*.nbi``).
NOTE: importing numba in a script's ``__main__`` before a vLLM CPU engine spawns its worker crashes
that worker, so nothing in ``cachemap`` may import numba at module level.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any


class _Kernel:
    """A kernel and, once compiled, its numba dispatcher."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.compiled: Callable[..., Any] | None = None

    def compile(self) -> Callable[..., Any]:
        if self.compiled is None:
            from numba import njit

            fn, glb = self.fn, self.fn.__globals__
            # the kernels it calls, by the names it calls them by, in their compiled form
            calls = {
                name: glb[name].kernel.compile()
                for name in fn.__code__.co_names
                if isinstance(getattr(glb.get(name), "kernel", None), _Kernel)
            }
            if calls:
                fn = functools.update_wrapper(
                    types.FunctionType(
                        fn.__code__, {**glb, **calls}, fn.__name__, fn.__defaults__, fn.__closure__
                    ),
                    fn,
                )
            self.compiled = njit(cache=True, nogil=True)(fn)
        return self.compiled


# every kernel, in the order its module defined it
KERNELS: list[_Kernel] = []


def jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    kernel = _Kernel(fn)
    KERNELS.append(kernel)

    @functools.wraps(fn)  # the plain kernel stays reachable as ``__wrapped__``
    def call(*args: Any) -> Any:
        compiled = kernel.compiled
        if compiled is None:
            compiled = kernel.compile()
            # NOTE: from now on the kernel's own module calls the dispatcher directly, one
            # Python call fewer per use (the cluster simulator makes ~10 per request); other
            # modules and later-compiled kernels that hold this wrapper still work through it
            if fn.__globals__.get(fn.__name__) is call:
                fn.__globals__[fn.__name__] = compiled
        return compiled(*args)

    call.kernel = kernel  # type: ignore[attr-defined]
    return call
