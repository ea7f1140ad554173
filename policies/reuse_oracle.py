"""Reuse oracle: knows *whether* each block is used again, not *when*; LRU otherwise."""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.base import Key, OfflinePolicy, RequestInfo
from policies.scored import ScoredPolicy

# Priority classes; within a class the tie (a logical access clock) orders oldest first.
_DEAD, _LIVE = 0.0, 1.0


class ReuseOraclePolicy(ScoredPolicy[None], OfflinePolicy):
    """Dead blocks (no use after the current request) first, then live ones, each class in LRU
    order. Needs ``load_future`` before the replay: an upper bound only.

    This bounds policies that predict *whether* a block will be reused but not *when* (say a
    per-request "does this conversation continue" classifier in front of LRU): the answer to
    "whether" is exact, and the order among live blocks is plain recency.

    NOTE: it is no bound for policies that also predict *when*: on the shared Mooncake trace at
    1,000 blocks, where most live blocks age out before their reuse anyway, prefix-odds (which
    learns reuse times) beats it.

    ``label_error`` models an imperfect classifier: each request is, with that probability,
    "flipped", and every block it stores or re-ranks gets the inverted live/dead label. The
    draws come from ``random.Random(seed)``, one per request index in ``load_future``, and are
    shared across error rates: for one seed the flipped requests at ``e`` are a subset of
    those at any ``e' > e``, so a sweep over ``label_error`` changes as little as it can.

    Recency is LRU's exactly: a logical clock ticks at every store and re-rank, and a finished
    request re-ranks all its resident blocks tail first, so the head of its prompt ends most
    recent; a block's label is set whenever it is stored or re-ranked. A block can only turn
    dead at a request that uses it, and that request re-ranks it, so exact labels never go
    stale. A block reused by the current request keeps its previous label and recency until
    ``end_request`` (no early demotion during the store pass, unlike Belady).

    Prefix semantics: with exact labels, a parent is dead only if no later prompt uses it, and
    any prompt using a child also uses the parent, so a dead parent's children are dead too
    (a live child always has a live parent); within a class a parent is re-ranked after its
    child at every use, so a child never outlives its parent. With ``label_error > 0`` a block
    keeps the possibly inverted label of the last request that touched it, so a parent can be
    labelled dead under a live child and go first, orphaning the child until it ages out.
    """

    name = "reuse-oracle"

    def __init__(self, capacity_blocks: int, label_error: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= label_error <= 1.0:
            raise ValueError(f"label_error must be in [0, 1], got {label_error}")
        self.label_error, self.seed = label_error, seed
        super().__init__(capacity_blocks)

    def _reset(self) -> None:
        super()._reset()
        self._last_use: dict[Key, int] = {}
        self._flipped: list[bool] = []
        self._index = -1
        self._flip = False
        self._clock = 0

    def load_future(self, requests: Sequence[Sequence[Key]]) -> None:
        last_use: dict[Key, int] = {}
        for i, keys in enumerate(requests):
            for key in keys:
                last_use[key] = i
        self._last_use = last_use
        rng = random.Random(self.seed)
        self._flipped = [rng.random() < self.label_error for _ in requests]

    def begin_request(self, request: RequestInfo, now_s: float) -> None:
        self._index = self._future_index(request, len(self._flipped))
        self._flip = self._flipped[self._index]

    def _rank(self, key: Key) -> None:
        """Make ``key`` the most recent block of its class, labelled for the current request."""
        live = self._last_use.get(key, -1) > self._index
        self._clock += 1
        self._heap.push(key, _LIVE if live != self._flip else _DEAD, self._clock)

    def insert(self, key: Key, now_s: float, parent: Key | None = None, offset: int = 0) -> None:
        self._rank(key)

    def touch(self, key: Key, now_s: float) -> None:
        self._rank(key)

    def end_request(
        self, request: RequestInfo, keys: Sequence[Key], reused: Sequence[Key], now_s: float
    ) -> None:
        heap = self._heap
        for key in reversed(keys):
            if key in heap:
                self._rank(key)
