"""Least recently used."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence, Set

from policies.base import NO_PROTECTION, EvictionPolicy, Key, RequestInfo


def evict_in_order(od: OrderedDict[Key, None], n: int, protected: Set[Key]) -> list[Key] | None:
    """Take the first ``n`` unprotected keys of ``od`` (front = next victim); atomic."""
    if n <= 0:
        return []
    if not protected:
        if n > len(od):
            return None
        pop = od.popitem
        return [pop(last=False)[0] for _ in range(n)]
    victims: list[Key] = []
    for key in od:
        if key not in protected:
            victims.append(key)
            if len(victims) == n:
                break
    else:
        return None
    for key in victims:
        del od[key]
    return victims


class LRUPolicy(EvictionPolicy):
    """Evicts the block touched longest ago.

    As in vLLM's ``LRUCachePolicy``, a finished request re-ranks all its blocks (stored or
    reused) tail first, so the head of its prompt is the most recent; lookups do not count.

    Prefix semantics: leaf-first within a request (its tail becomes its oldest block), nothing
    across requests: an orphaned child (its parent evicted) simply ages out.
    """

    name = "lru"

    def _reset(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def insert(self, key: Key, now_s: float, parent: Key | None = None, offset: int = 0) -> None:
        self._order[key] = None

    def touch(self, key: Key, now_s: float) -> None:
        self._order.move_to_end(key)

    def end_request(
        self, request: RequestInfo, keys: Sequence[Key], reused: Sequence[Key], now_s: float
    ) -> None:
        move = self._order.move_to_end
        for key in reversed(keys):
            move(key)

    def remove(self, key: Key) -> None:
        del self._order[key]

    def evict(self, n: int, protected: Set[Key] = NO_PROTECTION) -> list[Key] | None:
        if n == 1 and not protected and self._order:  # the simulator's hot path
            return [self._order.popitem(last=False)[0]]
        return evict_in_order(self._order, n, protected)
