"""Prefix-reuse eviction (kvroute's own): learned reuse odds per block class, idle decay."""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Key, RequestInfo
from policies.learned import ClassOddsPolicy, OddsTuning
from policies.scored import ScoredPolicy


class PrefixReusePolicy(ClassOddsPolicy, ScoredPolicy[tuple[int, int, float, int]]):
    """Keeps the blocks most likely to be reused soon, with the likelihood learned online.

    Each access puts the block in a class: how many times it has been accessed (capped at
    ``max_count``) and whether it ended its prompt (a prefix-tree leaf for that request: the
    last, usually partial, block of a prompt is almost never shared). For every class the
    policy counts accesses and the reuses that followed them, including reuses of blocks it had
    already evicted (a ghost list of ``ghost_factor * capacity`` keys remembers their class), so
    its own choices do not bias the estimate. A block's priority is the LPC form
    ``logit(p_class) - (now - last access) / reuse_scale_s`` with ``reuse_scale_s`` the running
    mean reuse interval: a block of a class twice as likely to be reused survives longer idle.

    NOTE: ``now`` is common to all blocks, so the heap key ``last + scale * logit(p)`` (an
    effective last-access time, in seconds) is fixed between accesses and stays comparable
    while the learned scale drifts.

    Prefix semantics: ties go to the deeper block; prompt tails are classified at
    ``end_request`` and fall to the bottom, so an unshared tail is usually the next victim
    (in effect not admitted) while the shared interior of the prefix tree is protected by its
    counts; a parent's count is never below its children's.
    """

    name = "prefix-reuse"

    def __init__(
        self,
        capacity_blocks: int,
        max_count: int = 8,
        ghost_factor: float = OddsTuning.ghost_factor,
        refit_every: int = OddsTuning.refit_every,
        prior_weight: float = OddsTuning.prior_weight,
        memory_accesses: int = OddsTuning.memory_accesses,
    ) -> None:
        tuning = OddsTuning(ghost_factor, refit_every, prior_weight, memory_accesses)
        super().__init__(capacity_blocks, max_count, tuning)

    def _reset(self) -> None:
        super()._reset()  # each block's state: (count, class, last access, offset)
        n_classes = 2 * (self.max_count + 1)
        self._reset_odds(n_classes)
        self._logit = [0.0] * n_classes
        self._scale_s = 0.0  # running mean reuse interval; 0 until the first reuse
        self._n_intervals = 0

    def _access(self, key: Key, count: int, now_s: float, offset: int) -> None:
        cls = min(count, self.max_count)
        self._state[key] = (count, cls, now_s, offset)
        self._heap.push(key, self._key(cls, now_s), -offset)
        self._accessed(cls)

    def _key(self, cls: int, last_s: float) -> float:
        return last_s + self._scale_s * self._logit[cls]

    def _reused(self, cls: int, gap_s: float) -> None:
        super()._reused(cls, gap_s)
        self._n_intervals += 1
        self._scale_s += (gap_s - self._scale_s) / min(self._n_intervals, 1000)

    def _refit(self) -> None:
        self._logit = self._odds.logits()

    def end_request(
        self, request: RequestInfo, keys: Sequence[Key], reused: Sequence[Key], now_s: float
    ) -> None:
        super().end_request(request, keys, reused, now_s)
        if not keys:
            return
        key = keys[-1]
        count, cls, last_s, offset = self._state[key]
        if cls > self.max_count or not self._ends_prompt(request, offset):
            return
        tail = cls + self.max_count + 1
        self._count_as_tail(cls, tail)
        self._state[key] = (count, tail, last_s, offset)
        self._heap.push(key, self._key(tail, last_s), -offset)

    def touch(self, key: Key, now_s: float) -> None:
        count, cls, last_s, offset = self._state[key]
        self._reused(cls, now_s - last_s)
        self._access(key, count + 1, now_s, offset)

    def _on_evicted(self, popped: list[tuple[Key, float]]) -> None:
        for key, _ in popped:
            count, cls, last_s, _ = self._state[key]
            self._ghost.add(key, (cls, last_s, count))
