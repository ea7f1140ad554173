"""``sglang_cache_aware``: a re-implementation of SGLang router's cache-aware policy.

From the SGLang router's documented algorithm (sgl-project/sglang, ``sgl-router``, policy
``cache_aware``; docs/router/router.md and the policy's module comment):

1. The system is *imbalanced* when ``max_load - min_load > balance_abs_threshold`` (64) **and**
   ``max_load > balance_rel_threshold * min_load`` (1.5), load being the requests the router
   has in flight per worker. Then the request goes to the least loaded worker (shortest queue).
2. Otherwise, the request's prefix is matched against an *approximate* tree per worker built
   from the requests the router itself sent there (not from engine events). If the best match
   covers more than ``cache_threshold`` (0.3) of the request, it goes to that worker; else to
   the worker whose tree is smallest (most free cache, by the router's guess).
3. The request is then inserted into the chosen worker's tree; trees are trimmed LRU-wise to
   ``max_tree_size``.

Difference from the original: the tree is over our token-block hashes instead of characters, so
matches are counted in whole blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from cachemap import CacheMap, Match, Tier
from router.placement import InstanceView, Placement, PlacementRequest, Scorer, healthy


class SglangCacheAwareScorer(Scorer):
    name = "sglang_cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 1 << 20,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self._tree = CacheMap()  # approximate: what we routed where
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._in_flight: dict[str, int] = {}

    def place(
        self,
        request: PlacementRequest,
        instances: Sequence[InstanceView],
        match: Mapping[str, Match],
    ) -> Placement:
        alive = healthy(instances)
        loads = {i.instance_id: self._in_flight.get(i.instance_id, 0) for i in alive}
        hi, lo = max(loads.values()), min(loads.values())
        approx = self._tree.match(request.block_hashes)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            chosen = min(loads, key=lambda i: (loads[i], i))
        else:
            best = max(
                loads, key=lambda i: (approx[i].total_blocks if i in approx else 0, -loads[i])
            )
            n = len(request.block_hashes)
            rate = (approx[best].total_blocks / n) if n and best in approx else 0.0
            if rate > self.cache_threshold:
                chosen = best
            else:
                chosen = min(loads, key=lambda i: (self._tree.count(i, Tier.GPU), loads[i], i))
        self._insert(chosen, request.block_hashes)
        self._in_flight[chosen] = self._in_flight.get(chosen, 0) + 1
        m = match.get(chosen)
        return Placement(chosen, cached_blocks=m.total_blocks if m else 0)

    def on_finished(self, request: PlacementRequest, instance_id: str) -> None:
        if self._in_flight.get(instance_id, 0) > 0:
            self._in_flight[instance_id] -= 1

    def _insert(self, instance: str, hashes: Sequence[int]) -> None:
        if not hashes:
            return
        self._tree.store(instance, Tier.GPU, hashes)
        lru = self._lru.setdefault(instance, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        excess = len(lru) - self.max_tree_size
        if excess > 0:
            old = [lru.popitem(last=False)[0] for _ in range(excess)]
            self._tree.remove(instance, Tier.GPU, old)
