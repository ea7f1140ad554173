"""Prefix-reuse eviction (kvroute's own): learned reuse odds per block class, idle decay."""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Key, RequestInfo
from policies.class_odds import ClassOdds
from policies.ghost import GhostList
from policies.scored import ScoredPolicy


class PrefixReusePolicy(ScoredPolicy[tuple[int, int, float, int]]):
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
        ghost_factor: float = 8.0,
        refit_every: int = 2000,
        prior_weight: float = 20.0,
        memory_accesses: int = 200_000,
    ) -> None:
        self.max_count, self.ghost_factor = max_count, ghost_factor
        self.refit_every, self.prior_weight = refit_every, prior_weight
        self.memory_accesses = memory_accesses
        super().__init__(capacity_blocks)

    def _reset(self) -> None:
        super()._reset()
        n_classes = 2 * (self.max_count + 1)
        self._odds = ClassOdds(n_classes, self.prior_weight, self.memory_accesses)
        self._logit = [0.0] * n_classes
        # each block's state: (count, class, last access, offset)
        self._ghost: GhostList[tuple[int, int, float]] = GhostList(  # count, class, last
            int(self.ghost_factor * self.capacity_blocks)
        )
        self._scale_s = 0.0  # running mean reuse interval; 0 until the first reuse
        self._n_intervals = 0
        self._since_fit = 0

    def _access(self, key: Key, count: int, now_s: float, offset: int) -> None:
        cls = min(count, self.max_count)
        self._odds.accesses[cls] += 1.0
        self._state[key] = (count, cls, now_s, offset)
        self._heap.push(key, self._key(cls, now_s), -offset)
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self._refit()

    def _key(self, cls: int, last_s: float) -> float:
        return last_s + self._scale_s * self._logit[cls]

    def _reused(self, cls: int, interval_s: float) -> None:
        self._odds.reused(cls, interval_s)
        self._n_intervals += 1
        self._scale_s += (interval_s - self._scale_s) / min(self._n_intervals, 1000)

    def _refit(self) -> None:
        self._since_fit = 0
        self._logit = self._odds.logits()
        self._odds.age()

    def end_request(
        self, request: RequestInfo, keys: Sequence[Key], reused: Sequence[Key], now_s: float
    ) -> None:
        super().end_request(request, keys, reused, now_s)
        if not keys:
            return
        key = keys[-1]
        count, cls, last_s, offset = self._state[key]
        if cls > self.max_count or (request.num_blocks and offset != request.num_blocks - 1):
            return
        tail = cls + self.max_count + 1
        acc = self._odds.accesses
        acc[cls] = max(0.0, acc[cls] - 1.0)
        acc[tail] += 1.0
        self._state[key] = (count, tail, last_s, offset)
        self._heap.push(key, self._key(tail, last_s), -offset)

    def insert(self, key: Key, now_s: float, parent: Key | None = None, offset: int = 0) -> None:
        ghost = self._ghost.pop(key, None)
        count = 1
        if ghost is not None:
            count = ghost[0] + 1
            self._reused(ghost[1], now_s - ghost[2])
        self._access(key, count, now_s, offset)

    def touch(self, key: Key, now_s: float) -> None:
        count, cls, last_s, offset = self._state[key]
        self._reused(cls, now_s - last_s)
        self._access(key, count + 1, now_s, offset)

    def _on_evicted(self, popped: list[tuple[Key, float]]) -> None:
        for key, _ in popped:
            count, cls, last_s, _ = self._state[key]
            self._ghost.add(key, (count, cls, last_s))
