"""Base for policies that keep one priority per block in a ``KeyedMinHeap``."""

from __future__ import annotations

from collections.abc import Set
from typing import Generic, TypeVar

from policies.base import NO_PROTECTION, EvictionPolicy, Key
from policies.keyed_heap import KeyedMinHeap

S = TypeVar("S")


class ScoredPolicy(EvictionPolicy, Generic[S]):
    """Lowest priority is evicted first; ties go oldest-update first. Subclasses set priorities,
    and may keep one record per block in ``_state`` (a count, a cost): it leaves with the
    block, on ``remove`` and on eviction once ``_on_evicted`` has seen it."""

    def _reset(self) -> None:
        self._heap = KeyedMinHeap()
        self._state: dict[Key, S] = {}

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, key: object) -> bool:
        return key in self._heap

    def remove(self, key: Key) -> None:
        self._heap.discard(key)
        self._state.pop(key, None)

    def evict(self, n: int, protected: Set[Key] = NO_PROTECTION) -> list[Key] | None:
        if n <= 0:
            return []
        popped = self._heap.pop_n(n, protected)
        if popped is None:
            return None
        self._on_evicted(popped)
        state = self._state
        if state:
            for key, _ in popped:
                state.pop(key, None)
        return [key for key, _ in popped]

    def _on_evicted(self, popped: list[tuple[Key, float]]) -> None:
        """Hook: the evicted keys and their priorities, lowest first."""
