"""Prefix-odds eviction (kvroute's own): learned reuse odds and reuse time per block class."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence, Set

from policies.base import EvictionPolicy, Key, RequestInfo
from policies.class_odds import ClassOdds
from policies.ghost import GhostList

# Per key: [class, last access s, access count, prefix offset].
_State = list[float]


class PrefixOddsPolicy(EvictionPolicy):
    """Keeps the blocks with the best odds of being reused, each class on its own time scale.

    A block's class is its access count (capped at ``max_count``), or ``tail`` for the last
    block of a prompt (usually partial, so a continuation cannot share it); blocks seen once
    are further split by prefix depth into ``depth_buckets`` classes (offset 0-3, 4-15, 16-63,
    ... blocks: deep new blocks are reused less on the Mooncake trace). Per class the
    policy learns, online, the share ``p`` of accesses that were followed by a reuse and the
    mean reuse interval ``tau`` (reuses of blocks it already evicted included, through a ghost
    list of ``ghost_factor * capacity`` keys, so its own choices do not bias either). With
    exponential reuse times the log-odds that an idle block is still going to be reused are
    ``logit(p) - idle / tau``; in seconds that is the score ``last + scale * tau * logit(p)``,
    and the lowest score goes first. ``max_count = 2`` and ``depth_buckets = 3`` were chosen
    on the first half of the shared Mooncake trace; ``scale`` stays 1 (1.5 scored marginally
    higher there but lost to LRU on Bailian-shaped workloads at large capacities).

    NOTE: ``tau`` per class is what keeps this from over-protecting a class that mixes hot
    shared prefixes (reused within seconds) with conversation history (minutes): the class's
    short mean interval makes its idle members fall fast.

    NOTE: every block of a class shares the offset ``scale * tau * logit(p)``, so each class
    is one recency list and eviction compares their heads only: O(classes) per victim, and a
    refit (every ``refit_every`` accesses) re-ranks everything at once for free; the current
    time is common to all scores, so ``evict`` needs none.

    Prefix semantics: a finished request re-ranks its blocks tail first (its head is the most
    recent in each class), so within a class a prompt leaves tail first; on a tie across classes
    the tail, then the less accessed and deeper block goes. A parent is accessed whenever a
    child is, so (unless it was evicted and forgotten) its count is never below the child's;
    where shared prefixes are reused more, their classes learn the better odds and outlive
    their leaves. Orphaned children are not chased (rare: they sit in low classes and age
    out). Through vLLM (no offsets, no prompt length) every new block is depth 0 and the last
    block a request finishes with is its tail.
    """

    name = "prefix-odds"

    def __init__(
        self,
        capacity_blocks: int,
        max_count: int = 2,
        depth_buckets: int = 3,
        scale: float = 1.0,
        ghost_factor: float = 8.0,
        refit_every: int = 2000,
        prior_weight: float = 20.0,
        memory_accesses: int = 200_000,
    ) -> None:
        if min(max_count, depth_buckets, refit_every) < 1 or scale <= 0.0 or ghost_factor < 0.0:
            raise ValueError(
                "max_count, depth_buckets, scale, refit_every must be positive, ghost_factor >= 0"
            )
        self.max_count, self.depth_buckets = max_count, depth_buckets
        self.scale, self.ghost_factor = scale, ghost_factor
        self.refit_every, self.prior_weight = refit_every, prior_weight
        self.memory_accesses = memory_accesses
        super().__init__(capacity_blocks)

    def _reset(self) -> None:
        d = self.depth_buckets  # classes: count 1 by depth, counts 2..max_count, the tail
        n = d + self.max_count
        self._tail = n - 1
        self._lists: list[OrderedDict[Key, None]] = [OrderedDict() for _ in range(n)]
        self._state: dict[Key, _State] = {}
        # class, last access s, access count
        self._ghost: GhostList[tuple[int, float, int]] = GhostList(
            int(self.ghost_factor * self.capacity_blocks)
        )
        self._odds = ClassOdds(n, self.prior_weight, self.memory_accesses)
        self._offset = [0.0] * n  # scale * tau * logit(p), seconds
        self._tie_order = [n - 1, *range(d - 1, -1, -1), *range(d, n - 1)]
        self._since_fit = 0

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, key: object) -> bool:
        return key in self._state

    def _class(self, count: int, offset: int) -> int:
        if count > 1:
            return self.depth_buckets + min(count, self.max_count) - 2
        depth = 0
        while offset >= 4 and depth < self.depth_buckets - 1:
            offset //= 4
            depth += 1
        return depth

    def _access(self, key: Key, count: int, now_s: float, offset: int) -> None:
        cls = self._class(count, offset)
        self._odds.accesses[cls] += 1.0
        self._state[key] = [cls, now_s, count, offset]
        self._lists[cls][key] = None
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self._refit()

    def _refit(self) -> None:
        self._since_fit = 0
        odds = self._odds
        self._offset = [
            self.scale * tau * logit
            for tau, logit in zip(odds.mean_gaps(), odds.logits(), strict=True)
        ]
        odds.age()

    def insert(self, key: Key, now_s: float, parent: Key | None = None, offset: int = 0) -> None:
        count = 1
        ghost = self._ghost.pop(key, None)
        if ghost is not None:
            self._odds.reused(ghost[0], now_s - ghost[1])
            count = ghost[2] + 1
        self._access(key, count, now_s, offset)

    def touch(self, key: Key, now_s: float) -> None:
        cls, last, count, offset = self._state[key]
        self._odds.reused(int(cls), now_s - last)
        del self._lists[int(cls)][key]
        self._access(key, int(count) + 1, now_s, int(offset))

    def end_request(
        self, request: RequestInfo, keys: Sequence[Key], reused: Sequence[Key], now_s: float
    ) -> None:
        super().end_request(request, keys, reused, now_s)  # touches the reused, tail first
        if not keys:
            return
        state, lists = self._state, self._lists
        for key in reversed(keys):  # the head ends up the most recent of its class
            lists[int(state[key][0])].move_to_end(key)
        st = state[keys[-1]]
        cls, tail = int(st[0]), self._tail
        if cls == tail or (request.num_blocks and st[3] != request.num_blocks - 1):
            return
        acc = self._odds.accesses
        acc[cls] = max(0.0, acc[cls] - 1.0)
        acc[tail] += 1.0
        del lists[cls][keys[-1]]
        lists[tail][keys[-1]] = None
        st[0] = tail

    def remove(self, key: Key) -> None:
        cls = int(self._state.pop(key)[0])
        del self._lists[cls][key]

    def _victim(self, protected: Set[Key]) -> Key | None:
        best: Key | None = None
        best_score = math.inf
        state, lists = self._state, self._lists
        for cls in self._tie_order:  # on a tie: the tail, then the less accessed (deeper) block
            for key in lists[cls]:
                if key in protected:
                    continue
                score = state[key][1] + self._offset[cls]
                if score < best_score:
                    best, best_score = key, score
                break
        return best

    def _victims(self, n: int, protected: Set[Key]) -> list[Key]:
        victims: list[Key] = []
        for _ in range(n):
            key = self._victim(protected)
            assert key is not None
            cls, last, count, _ = self._state.pop(key)
            del self._lists[int(cls)][key]
            victims.append(key)
            self._ghost.add(key, (int(cls), last, int(count)))
        return victims
