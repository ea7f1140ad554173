"""First in, first out."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from policies.base import NO_PROTECTION, EvictionPolicy, Key
from policies.lru import evict_in_order


class FIFOPolicy(EvictionPolicy):
    """Evicts the block stored longest ago; reuse does not matter.

    Prefix semantics: a parent is stored before its children, so it goes first; orphaned
    children follow soon after since they were stored right behind it.
    """

    name = "fifo"

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self._reset()

    def _reset(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def insert(self, key: Key, now_s: float, parent: Key | None = None, offset: int = 0) -> None:
        self._order[key] = None

    def touch(self, key: Key, now_s: float) -> None:
        pass

    def remove(self, key: Key) -> None:
        del self._order[key]

    def evict(self, n: int, protected: Set[Key] = NO_PROTECTION) -> list[Key] | None:
        return evict_in_order(self._order, n, protected)
