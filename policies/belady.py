"""Belady's offline optimum: evict the block whose next use is furthest away."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from policies.base import Key, OfflinePolicy, RequestInfo
from policies.scored import ScoredPolicy


class BeladyPolicy(ScoredPolicy[None], OfflinePolicy):
    """Furthest next use first, next use counted in requests; never-again blocks go first,
    ties oldest-access first. Needs ``load_future`` before the replay: an upper bound only.

    NOTE: an oracle need not wait for ``end_request``: a reused block is re-scored as soon as
    the request's store pass reaches it in prefix order (before the next block is stored), so
    a reused block that is not needed again soon can make room for the request's own tail.

    Prefix semantics: a parent's next use is never later than its child's (any prompt using the
    child uses the parent), so children always go no later than their parents.
    """

    name = "belady"

    def _reset(self) -> None:
        super()._reset()
        self._uses: dict[Key, deque[int]] = {}
        self._requests: Sequence[Sequence[Key]] = ()
        self._index = -1
        self._keys: Sequence[Key] = ()
        self._cursor = 0
        self._stored: set[Key] = set()

    def load_future(self, requests: Sequence[Sequence[Key]]) -> None:
        self._requests = requests
        uses: dict[Key, deque[int]] = {}
        for i, keys in enumerate(requests):
            for key in keys:
                dq = uses.get(key)
                if dq is None:
                    uses[key] = deque((i,))
                elif dq[-1] != i:
                    dq.append(i)
        self._uses = uses

    def begin_request(self, request: RequestInfo, now_s: float) -> None:
        self._index = self._future_index(request, len(self._requests))
        self._keys = self._requests[self._index]
        self._cursor = 0
        self._stored.clear()

    def end_request(
        self, request: RequestInfo, keys: Sequence[Key], reused: Sequence[Key], now_s: float
    ) -> None:
        self._rescore_reused(len(self._keys))

    def _rescore_reused(self, stop: int) -> None:
        heap = self._heap
        for key in self._keys[self._cursor : stop]:
            if key in heap and key not in self._stored:
                heap.push(key, -self._next_use(key))
        self._cursor = max(self._cursor, stop)

    def _next_use(self, key: Key) -> float:
        dq = self._uses.get(key)
        if dq is None:
            return math.inf
        while dq and dq[0] <= self._index:
            dq.popleft()
        return dq[0] if dq else math.inf

    def insert(self, key: Key, now_s: float, parent: Key | None = None, offset: int = 0) -> None:
        self._rescore_reused(offset)
        self._cursor = offset + 1
        self._stored.add(key)
        self._heap.push(key, -self._next_use(key))

    def touch(self, key: Key, now_s: float) -> None:
        self._heap.push(key, -self._next_use(key))
