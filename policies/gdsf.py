"""Greedy-Dual-Size-Frequency."""

from __future__ import annotations

from policies.base import Key
from policies.scored import ScoredPolicy


class GDSFPolicy(ScoredPolicy[tuple[int, float]]):
    """Priority ``H = L + frequency * cost / size``; ``L`` inflates to each victim's ``H``.

    Blocks all have size 1; the cost of a miss is the prefill work to recompute the block,
    which grows with its depth (attention over the prefix before it): ``cost = 1 + offset /
    cost_depth_blocks``. Inflation ages out blocks that were popular long ago.

    Prefix semantics: a parent is at least as frequent as its children and no deeper-costly
    than them, so the deeper cost favours children slightly; an orphaned child is evicted by
    ageing only. Use ``cost_depth_blocks=0`` for plain GDSF with unit costs.
    """

    name = "gdsf"

    def __init__(self, capacity_blocks: int, cost_depth_blocks: float = 0.0) -> None:
        self.cost_depth_blocks = cost_depth_blocks
        super().__init__(capacity_blocks)

    def _reset(self) -> None:
        super()._reset()
        self._inflation = 0.0  # each block's state: (frequency, cost)

    def insert(self, key: Key, now_s: float, parent: Key | None = None, offset: int = 0) -> None:
        cost = 1.0 + (offset / self.cost_depth_blocks if self.cost_depth_blocks > 0 else 0.0)
        self._state[key] = (1, cost)
        self._heap.push(key, self._inflation + cost)

    def touch(self, key: Key, now_s: float) -> None:
        freq, cost = self._state[key]
        self._state[key] = (freq + 1, cost)
        self._heap.push(key, self._inflation + (freq + 1) * cost)

    def _on_evicted(self, popped: list[tuple[Key, float]]) -> None:
        self._inflation = max(self._inflation, popped[-1][1])
