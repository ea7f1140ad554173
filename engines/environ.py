"""Environment variables set for a block: an engine started inside it (its engine-core
process) inherits them; what was there before is restored afterwards. vLLM reads some of its
connectors' settings from the environment only (NIXL's side channel, Mooncake Store's file)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

__all__ = ["scoped_environ"]


@contextmanager
def scoped_environ(env: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """Set ``env`` in ``os.environ`` for the block, then restore what was there."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield dict(env)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
