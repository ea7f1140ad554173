"""Adaptive Replacement Cache (Megiddo and Modha, FAST'03)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from policies.base import EvictionPolicy, Key

_END = object()


class ARCPolicy(EvictionPolicy):
    """Two resident LRU lists (seen once: T1, seen again: T2) and two ghost lists of recently
    evicted keys (B1, B2). A store whose key is in a ghost list adapts the target size ``p``
    of T1 and goes straight into T2; eviction takes T1's LRU while T1 exceeds ``p``, else T2's.

    Prefix semantics: none beyond LRU's; a shared prefix reaches T2 and is protected from
    streams of one-off tails in T1.
    """

    name = "arc"

    def _reset(self) -> None:
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._p = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def insert(self, key: Key, now_s: float, parent: Key | None = None, offset: int = 0) -> None:
        b1, b2 = len(self._b1), len(self._b2)
        if key in self._b1:
            self._p = min(float(self.capacity_blocks), self._p + max(1.0, b2 / b1))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(1.0, b1 / b2))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def touch(self, key: Key, now_s: float) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]

    def _victims(self, n: int, protected: Set[Key]) -> list[Key]:
        # NOTE: choose lazily from the LRU ends, then mutate: the lists are never copied.
        from_t1 = (k for k in self._t1 if k not in protected)
        from_t2 = (k for k in self._t2 if k not in protected)
        chosen1: list[Key] = []
        chosen2: list[Key] = []
        size_t1 = len(self._t1)
        while len(chosen1) + len(chosen2) < n:
            key = next(from_t1, _END) if size_t1 > self._p else _END
            if key is _END:
                key = next(from_t2, _END)
                if key is _END:  # T2 exhausted: the rest must come from T1
                    key = next(from_t1)
                    chosen1.append(key)
                    size_t1 -= 1
                    continue
                chosen2.append(key)
            else:
                chosen1.append(key)
                size_t1 -= 1
        for key in chosen1:
            del self._t1[key]
            self._b1[key] = None
        for key in chosen2:
            del self._t2[key]
            self._b2[key] = None
        self._trim_ghosts()
        return chosen1 + chosen2

    def _trim_ghosts(self) -> None:
        c = self.capacity_blocks
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        ghosts = len(self._b1) + len(self._b2)
        while ghosts and len(self._t1) + len(self._t2) + ghosts > 2 * c:
            (self._b2 or self._b1).popitem(last=False)
            ghosts -= 1
