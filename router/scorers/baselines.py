"""Baselines: ``round_robin``, ``least_loaded`` and ``session`` (consistent hashing)."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

import xxhash

from cachemap import Match
from router.placement import InstanceView, Placement, PlacementRequest, Scorer, healthy


def _cached(match: Mapping[str, Match], instance_id: str) -> int:
    m = match.get(instance_id)
    return m.total_blocks if m else 0


class RoundRobinScorer(Scorer):
    """Each request to the next instance in id order, whatever it holds."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def place(
        self,
        request: PlacementRequest,
        instances: Sequence[InstanceView],
        match: Mapping[str, Match],
    ) -> Placement:
        alive = sorted(healthy(instances), key=lambda i: i.instance_id)
        inst = alive[self._next % len(alive)]
        self._next += 1
        return Placement(inst.instance_id, cached_blocks=_cached(match, inst.instance_id))


class LeastLoadedScorer(Scorer):
    """Fewest requests in flight (waiting + running); ties to less pending prefill work."""

    name = "least_loaded"

    def place(
        self,
        request: PlacementRequest,
        instances: Sequence[InstanceView],
        match: Mapping[str, Match],
    ) -> Placement:
        inst = min(
            healthy(instances),
            key=lambda i: (i.waiting + i.running, i.pending_prefill_tokens, i.instance_id),
        )
        return Placement(inst.instance_id, cached_blocks=_cached(match, inst.instance_id))


class SessionScorer(Scorer):
    """Consistent hashing of the session key (session header or OpenAI ``user``) on a ring of
    ``vnodes`` points per instance, so adding or losing an instance moves ~1/n of sessions.
    Requests without a session key fall back to least loaded."""

    name = "session"

    def __init__(self, vnodes: int = 64) -> None:
        self.vnodes = vnodes
        self._ring_for: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []
        self._fallback = LeastLoadedScorer()

    def _ring(self, ids: tuple[str, ...]) -> None:
        if ids == self._ring_for:
            return
        pts = sorted(
            (xxhash.xxh3_64_intdigest(f"{i}#{v}".encode()), i)
            for i in ids
            for v in range(self.vnodes)
        )
        self._points = [p for p, _ in pts]
        self._owners = [o for _, o in pts]
        self._ring_for = ids

    def place(
        self,
        request: PlacementRequest,
        instances: Sequence[InstanceView],
        match: Mapping[str, Match],
    ) -> Placement:
        if request.session_key is None:  # the fallback keeps to the healthy ones itself
            return self._fallback.place(request, instances, match)
        alive = healthy(instances)
        self._ring(tuple(sorted(i.instance_id for i in alive)))
        h = xxhash.xxh3_64_intdigest(request.session_key.encode())
        k = bisect.bisect(self._points, h) % len(self._points)
        owner = self._owners[k]
        return Placement(owner, cached_blocks=_cached(match, owner))
