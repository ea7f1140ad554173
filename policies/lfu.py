"""Least frequently used."""

from __future__ import annotations

from policies.base import Key
from policies.scored import ScoredPolicy


class LFUPolicy(ScoredPolicy[int]):
    """Evicts the block with the fewest accesses since it was stored; ties least recent first.

    Prefix semantics: every prompt that uses a child also used its parent, so a parent's count
    is at least its children's while both are resident: parents outlive children.
    """

    name = "lfu"

    def insert(self, key: Key, now_s: float, parent: Key | None = None, offset: int = 0) -> None:
        self._state[key] = 1
        self._heap.push(key, 1)

    def touch(self, key: Key, now_s: float) -> None:
        c = self._state[key] + 1
        self._state[key] = c
        self._heap.push(key, c)
