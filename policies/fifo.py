"""First in, first out."""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Key, RequestInfo
from policies.lru import LRUPolicy


class FIFOPolicy(LRUPolicy):
    """Evicts the block stored longest ago; reuse does not matter (LRU's bookkeeping without
    any re-ranking).

    Prefix semantics: a parent is stored before its children, so it goes first; orphaned
    children follow soon after since they were stored right behind it.
    """

    name = "fifo"

    def touch(self, key: Key, now_s: float) -> None:
        pass

    def end_request(
        self, request: RequestInfo, keys: Sequence[Key], reused: Sequence[Key], now_s: float
    ) -> None:
        pass
