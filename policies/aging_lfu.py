"""LFU with ageing: score = accesses - age."""

from __future__ import annotations

from policies.base import Key
from policies.scored import ScoredPolicy


class AgingLFUPolicy(ScoredPolicy[int]):
    """Score ``accesses - age``, age counted in cache turnovers since the last access.

    NOTE: ``accesses - (clock - last_clock)`` orders blocks exactly like ``accesses + last_clock``
    because ``clock`` is common to all, so the global clock is an inflation counter and a
    score changes only when its block is accessed. The clock advances by ``1 / age_blocks`` per
    block access (default: one unit per ``capacity_blocks`` accesses, a full turnover).

    Prefix semantics: parents have at least their children's counts and are accessed just
    before them, so they outlive them; orphans age out.
    """

    name = "aging-lfu"

    def __init__(self, capacity_blocks: int, age_blocks: int | None = None) -> None:
        self.age_blocks = age_blocks or capacity_blocks
        super().__init__(capacity_blocks)

    def _reset(self) -> None:
        super()._reset()
        self._clock = 0.0

    def insert(self, key: Key, now_s: float, parent: Key | None = None, offset: int = 0) -> None:
        self._clock += 1.0 / self.age_blocks
        self._state[key] = 1
        self._heap.push(key, 1 + self._clock)

    def touch(self, key: Key, now_s: float) -> None:
        self._clock += 1.0 / self.age_blocks
        c = self._state[key] + 1
        self._state[key] = c
        self._heap.push(key, c + self._clock)
