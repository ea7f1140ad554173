"""A min-heap of resident keys with lazily invalidated entries, shared by the scored policies."""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Set

from policies.base import NO_PROTECTION, Key

_DEAD = (0.0, 0.0, -1)


class KeyedMinHeap:
    """``key -> (priority, tie)``; the lowest pair leaves first, then the oldest push.

    NOTE: an update pushes a new entry and leaves the old one behind; an entry is live only while
    its sequence number is the key's current one. The heap is rebuilt when dead entries
    outnumber live ones, so pushes and pops stay O(log n) amortised.
    """

    __slots__ = ("_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, float, int, Key]] = []
        self._live: dict[Key, tuple[float, float, int]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __iter__(self) -> Iterator[Key]:
        return iter(self._live)

    def priority(self, key: Key) -> float:
        return self._live[key][0]

    def push(self, key: Key, priority: float, tie: float = 0.0) -> None:
        """Insert ``key`` or move it to ``priority`` (and to the back of its ties)."""
        self._seq += 1
        self._live[key] = (priority, tie, self._seq)
        heapq.heappush(self._heap, (priority, tie, self._seq, key))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def discard(self, key: Key) -> None:
        self._live.pop(key, None)

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()

    def first(self, protected: Set[Key] = NO_PROTECTION) -> tuple[Key, float, float] | None:
        """The next unprotected victim as ``(key, priority, tie)``, left in place."""
        heap, live = self._heap, self._live
        skipped: list[tuple[float, float, int, Key]] = []
        found: tuple[Key, float, float] | None = None
        while heap:
            prio, tie, seq, key = heap[0]
            if live.get(key, _DEAD)[2] != seq:
                heapq.heappop(heap)
            elif key in protected:
                skipped.append(heapq.heappop(heap))
            else:
                found = (key, prio, tie)
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def pop_n(self, n: int, protected: Set[Key] = NO_PROTECTION) -> list[tuple[Key, float]] | None:
        """Remove the ``n`` lowest unprotected keys; None (and no change) if there are fewer."""
        heap, live = self._heap, self._live
        taken: list[tuple[float, float, int, Key]] = []
        skipped: list[tuple[float, float, int, Key]] = []
        while len(taken) < n and heap:
            entry = heapq.heappop(heap)
            if live.get(entry[3], _DEAD)[2] != entry[2]:
                continue
            (skipped if entry[3] in protected else taken).append(entry)
        for entry in skipped:
            heapq.heappush(heap, entry)
        if len(taken) < n:
            for entry in taken:
                heapq.heappush(heap, entry)
            return None
        for entry in taken:
            del live[entry[3]]
        return [(entry[3], entry[0]) for entry in taken]

    def _compact(self) -> None:
        self._heap = [(p, t, s, k) for k, (p, t, s) in self._live.items()]
        heapq.heapify(self._heap)
