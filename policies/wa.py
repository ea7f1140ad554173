"""Workload-aware eviction (Wang et al., "KVCache Cache in the Wild", ATC'25)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Set
from dataclasses import dataclass, field

from policies.base import EvictionPolicy, Key, RequestInfo
from policies.ghost import GhostList
from policies.keyed_heap import KeyedMinHeap


@dataclass(slots=True, eq=False)
class _Category:
    """Blocks last accessed by one request category, and that category's reuse model."""

    blocks: KeyedMinHeap = field(default_factory=KeyedMinHeap)  # (last access, -offset)
    reuse_times_s: deque[float] = field(default_factory=deque)
    accesses: float = 0.0
    reuses: float = 0.0
    rate_per_s: float = 0.0  # fitted exponential rate; 0 = not fitted yet
    reuse_fraction: float = 0.0


class WAPolicy(EvictionPolicy):
    """Per request category, an exponential fit of recent reuse times (MLE ``rate = 1/mean``
    over the last ``window`` samples, refitted every ``refit_every`` accesses) and the share of
    accesses that were reuses. A block's priority is its category's probability of a reuse in
    ``[t, t + life]``: ``share * (exp(-rate t) - exp(-rate (t + life)))``, ``t`` the time since
    its last access and ``life`` the expected lifespan (a running mean of the idle time of
    evicted blocks). Lowest goes first.

    NOTE: within one category priority falls with ``t``, so only the least recently used block
    of each category can be the victim: eviction compares one head per category, O(categories).
    Blocks move to the category of the request that last accessed them; turns past ``max_turn``
    share a category; a category with fewer than ``min_samples`` reuses borrows the pooled fit.
    Reuse times are observed on hits and, through a ghost list of ``ghost_factor * capacity``
    evicted keys, on misses too, so the fit is not biased towards what the cache kept.
    ``evict`` uses the latest time seen.

    Prefix semantics: ties, within a category and across them, go to the deeper block (larger
    prefix offset), so the blocks of one prompt leave tail first and a parent outlives its
    children.
    """

    name = "wa"

    def __init__(
        self,
        capacity_blocks: int,
        window: int = 2000,
        refit_every: int = 1000,
        min_samples: int = 30,
        max_turn: int = 4,
        ghost_factor: float = 4.0,
    ) -> None:
        if window <= 0 or refit_every <= 0 or max_turn <= 0:
            raise ValueError("window, refit_every and max_turn must be positive")
        self.window, self.refit_every, self.min_samples = window, refit_every, min_samples
        self.max_turn, self.ghost_factor = max_turn, ghost_factor
        super().__init__(capacity_blocks)

    def _reset(self) -> None:
        self._cats: dict[str, _Category] = {}
        self._pooled = _Category()
        self._meta: dict[Key, tuple[_Category, float, int]] = {}  # category, last access, offset
        self._ghost: GhostList[tuple[_Category, float]] = GhostList(
            int(self.ghost_factor * self.capacity_blocks)
        )
        self._current = self._category("all")
        self._now = 0.0
        self._life_s = 0.0
        self._since_fit = 0
        self._heads: dict[_Category, tuple[float, float, Key, float]] = {}
        self._heads_now = -math.inf
        self._dirty: set[_Category] = set()

    def _category(self, name: str) -> _Category:
        cat = self._cats.get(name)
        if cat is None:
            cat = self._cats[name] = _Category()
        return cat

    def __len__(self) -> int:
        return len(self._meta)

    def __contains__(self, key: object) -> bool:
        return key in self._meta

    def begin_request(self, request: RequestInfo, now_s: float) -> None:
        name = request.category
        if request.turn > self.max_turn:  # NOTE: deep turns share one category: few samples each
            name = f"{name.rsplit('_', 1)[0]}_{self.max_turn}+"
        self._current = self._category(name)
        self._now = max(self._now, now_s)

    def resume_request(self, request: RequestInfo, now_s: float) -> None:
        self.begin_request(request, now_s)  # NOTE: begin only picks the category: counts nothing

    def insert(self, key: Key, now_s: float, parent: Key | None = None, offset: int = 0) -> None:
        self._now = max(self._now, now_s)
        cat = self._current
        self._meta[key] = (cat, now_s, offset)
        cat.blocks.push(key, now_s, -offset)
        head = self._heads.get(cat)
        if head is None or head[3] >= now_s:  # the new block can only be the head of a fresh list
            self._dirty.add(cat)
        ghost = self._ghost.pop(key, None)
        if ghost is None:
            self._count(cat, None, 0.0)
        else:  # a reuse the cache missed still tells the reuse-time distribution
            self._count(cat, ghost[0], now_s - ghost[1])

    def touch(self, key: Key, now_s: float) -> None:
        self._now = max(self._now, now_s)
        old, last_s, offset = self._meta[key]
        cat = self._current
        self._count(cat, old, now_s - last_s)
        if cat is not old:
            old.blocks.discard(key)
        self._meta[key] = (cat, now_s, offset)
        cat.blocks.push(key, now_s, -offset)
        head = self._heads.get(old)
        if head is not None and head[2] == key:
            self._dirty.add(old)
        if cat not in self._heads:
            self._dirty.add(cat)

    def remove(self, key: Key) -> None:
        cat, _, _ = self._meta.pop(key)
        cat.blocks.discard(key)
        self._dirty.add(cat)

    def _count(self, accessor: _Category, reused: _Category | None, reuse_s: float) -> None:
        """An access by ``accessor``'s request; a reuse of a block last accessed by ``reused``."""
        accessor.accesses += 1.0
        self._pooled.accesses += 1.0
        if reused is not None:
            for c in (reused, self._pooled):
                c.reuses += 1.0
                c.reuse_times_s.append(reuse_s)
                if len(c.reuse_times_s) > self.window:
                    c.reuse_times_s.popleft()
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self._refit()

    def _refit(self) -> None:
        self._since_fit = 0
        self._heads_now = -math.inf  # every cached head score is stale
        for c in (self._pooled, *self._cats.values()):
            if c.reuse_times_s:
                c.rate_per_s = len(c.reuse_times_s) / max(sum(c.reuse_times_s), 1e-9)
            c.reuse_fraction = min(1.0, c.reuses / c.accesses) if c.accesses else 0.0
            if c.accesses > 10 * self.window:
                # NOTE: halving keeps the share tracking the recent workload.
                c.accesses, c.reuses = c.accesses / 2, c.reuses / 2

    def _score(self, cat: _Category, last_s: float) -> float:
        fit = cat if len(cat.reuse_times_s) >= self.min_samples else self._pooled
        rate = fit.rate_per_s
        if rate <= 0.0:
            return last_s * 1e-12  # nothing learned yet: plain LRU order
        t = max(0.0, self._now - last_s)
        life = self._life_s if self._life_s > 0 else 1.0 / rate
        return fit.reuse_fraction * (math.exp(-rate * t) - math.exp(-rate * (t + life)))

    def _head(self, cat: _Category, protected: Set[Key]) -> tuple[float, float, Key, float] | None:
        head = cat.blocks.first(protected)
        if head is None:
            return None
        key, last_s, neg_offset = head
        return self._score(cat, last_s), neg_offset, key, last_s

    def _victims(self, n: int, protected: Set[Key]) -> list[Key]:
        # NOTE: head scores depend on the time and on the category's oldest block only, so they
        # are cached until the clock moves or the category changes (O(categories) per request,
        # O(1) per further eviction); a protected set bypasses the cache.
        heads = self._heads
        if protected or self._heads_now != self._now:
            heads.clear()
            self._dirty.update(self._cats.values())
            self._heads_now = self._now
        victims: list[Key] = []
        for _ in range(n):
            for cat in self._dirty:
                head = self._head(cat, protected)
                if head is None:
                    heads.pop(cat, None)
                else:
                    heads[cat] = head
            self._dirty.clear()
            if not heads:
                raise RuntimeError("wa: fewer unprotected keys than evictable_count said")
            cat = min(heads, key=lambda c: heads[c][:2])
            key = heads[cat][2]
            cat.blocks.discard(key)
            victims.append(key)
            _, last_s, _ = self._meta.pop(key)
            self._life_s += (self._now - last_s - self._life_s) / 64.0
            self._ghost.add(key, (cat, last_s))
            self._dirty.add(cat)
        if protected:
            heads.clear()
            self._heads_now = -math.inf
        return victims
