"""Prefix-odds eviction (kvroute's own): learned reuse odds and reuse time per block class."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence, Set

from policies.base import Key, RequestInfo
from policies.learned import ClassOddsPolicy, OddsTuning

# Per key: [class, last access s, access count, prefix offset].
_State = list[float]


class PrefixOddsPolicy(ClassOddsPolicy):
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
        ghost_factor: float = OddsTuning.ghost_factor,
        refit_every: int = OddsTuning.refit_every,
        prior_weight: float = OddsTuning.prior_weight,
        memory_accesses: int = OddsTuning.memory_accesses,
    ) -> None:
        if min(max_count, depth_buckets, refit_every) < 1 or scale <= 0.0 or ghost_factor < 0.0:
            raise ValueError(
                "max_count, depth_buckets, scale, refit_every must be positive, ghost_factor >= 0"
            )
        self.depth_buckets, self.scale = depth_buckets, scale
        tuning = OddsTuning(ghost_factor, refit_every, prior_weight, memory_accesses)
        super().__init__(capacity_blocks, max_count, tuning)

    def _reset(self) -> None:
        d = self.depth_buckets  # classes: count 1 by depth, counts 2..max_count, the tail
        n = d + self.max_count
        self._tail = n - 1
        self._lists: list[OrderedDict[Key, None]] = [OrderedDict() for _ in range(n)]
        self._state: dict[Key, _State] = {}
        self._reset_odds(n)
        self._offset = [0.0] * n  # scale * tau * logit(p), seconds
        self._tie_order = [n - 1, *range(d - 1, -1, -1), *range(d, n - 1)]

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
        self._state[key] = [cls, now_s, count, offset]
        self._lists[cls][key] = None
        self._accessed(cls)

    def _refit(self) -> None:
        odds = self._odds
        self._offset = [
            self.scale * tau * logit
            for tau, logit in zip(odds.mean_gaps(), odds.logits(), strict=True)
        ]

    def touch(self, key: Key, now_s: float) -> None:
        cls, last, count, offset = self._state[key]
        self._reused(int(cls), now_s - last)
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
        if cls == tail or not self._ends_prompt(request, int(st[3])):
            return
        self._count_as_tail(cls, tail)
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
