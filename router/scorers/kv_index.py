"""``kv_ttft``'s candidate index: the instances that can win a placement, found without
pricing them all (``_CandidateIndex``), and how full each instance's GPU cache is by the map
(``_Fill``). ``router.scorers.kv_ttft`` uses both from ``_INDEXED_FROM`` instances on."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from itertools import compress
from operator import is_not
from typing import Any

import numpy as np

from cachemap import CacheMap, Match, Tier
from router.placement import InstanceView

__all__ = ["_CandidateIndex", "_Fill"]


class _Fill:
    """How full an instance's GPU cache is, by the map: the share of its blocks holding some
    prefix (the blocks a new prompt there would evict first once it is full); its resident
    block count when its capacity is unknown. One per placement: it reads the map's counts
    directly (it is asked about every idle instance of a large cluster), and ``shares`` weighs
    a whole cluster in numpy."""

    def __init__(self, cache_map: CacheMap) -> None:
        self.get = cache_map.counts(Tier.GPU).get
        self.stride = cache_map.stride
        self.bit_of, self.by_bit = cache_map.counts_by_bit(Tier.GPU)

    def __call__(self, inst: InstanceView) -> float:
        resident = self.get(inst.instance_id, 0) * self.stride
        cap = inst.kv_capacity_blocks
        return resident / cap if cap else float(resident)

    def shares(self, bits: Any, caps: Any) -> Any:
        """The fill of the instances with map bits ``bits`` (-1: none yet) and capacities
        ``caps``: ``__call__``'s figures (an int64 over an int64 is the same float in numpy as
        in Python below 2**53), without a call each: a large group at once."""
        resident = np.where(bits >= 0, self.by_bit[np.maximum(bits, 0)], 0) * self.stride
        return np.where(caps > 0, resident / np.maximum(caps, 1), resident.astype(np.float64))


# ``_CandidateIndex.least_filled`` weighs this many instances or more in numpy, not one by one
_VECTOR_FROM = 32


class _CandidateIndex:
    """The instances that can win a ``KvTtftScorer`` placement, without visiting them all.

    Two healthy instances without a cached prefix and with the same profile key (latency model,
    block size, queued prefill tokens, waiting requests) have the same profile estimate, and
    the calibrated estimate and the ``interference`` charge only grow with running sequences
    (their coefficients are >= 0, and float products and sums are monotonic). So among them,
    the first (in view order) of those with the fewest running sequences has the lowest
    estimate and the lowest tie-break key (running + waiting, estimate, position): none of the
    others can be chosen, and none sets the best estimate that decides which are near-ties.
    The same holds for instances with a cached prefix of the same length (GPU and all tiers)
    and profile key. The candidates are that one per key, in view order: the choice among
    them is the choice among all, tie-breaks included.

    The groups are kept across placements: views arrive as the same objects while unchanged
    (``LoadTracker.views``), so only the positions whose view is a new object are regrouped.
    Beside them, per position in numpy: its group's number, running sequences and capacity,
    and its bit in the cache map, so that the least filled of a large group is found without
    a call per member."""

    def __init__(self) -> None:
        self._views: list[InstanceView] = []
        self._pos: dict[str, int] = {}
        self._keys: list[tuple[int, int, int, int] | None] = []  # None: unhealthy
        # profile key -> [(running, position)], sorted
        self._groups: dict[tuple[int, int, int, int], list[tuple[int, int]]] = {}
        # profile key -> its number in ``_group_at`` (numbers of emptied groups are reused)
        self._number: dict[tuple[int, int, int, int], int] = {}
        self._spare: list[int] = []
        # over the healthy positions: how many, and their waiting requests
        self._healthy = 0
        self._waiting = 0
        self._group_at: Any = np.empty(0, np.int64)  # -1: unhealthy
        self._running_at: Any = np.empty(0, np.int64)
        self._cap_at: Any = np.empty(0, np.int64)
        self._bits: Any = None  # the map bit per position, for ``_bits_for``
        self._bits_for: object = None
        # the last ``candidates``: the positions with a cached prefix, and the uncached
        # candidates' groups
        self._cached: dict[int, Match] = {}
        self._firsts: dict[int, tuple[int, int, int, int]] = {}

    def _join(self, key: tuple[int, int, int, int], i: int, v: InstanceView) -> None:
        members = self._groups.get(key)
        if members is None:
            members = self._groups[key] = []
            self._number[key] = self._spare.pop() if self._spare else len(self._number)
        bisect.insort(members, (v.running, i))
        self._healthy += 1
        self._waiting += key[3]
        self._group_at[i] = self._number[key]
        self._running_at[i] = v.running
        self._cap_at[i] = v.kv_capacity_blocks

    def _leave(self, key: tuple[int, int, int, int], i: int, running: int) -> None:
        members = self._groups[key]
        del members[bisect.bisect_left(members, (running, i))]
        self._healthy -= 1
        self._waiting -= key[3]
        if not members:
            del self._groups[key]
            self._spare.append(self._number.pop(key))
        self._group_at[i] = -1

    @staticmethod
    def _key(v: InstanceView) -> tuple[int, int, int, int] | None:
        if not v.healthy:
            return None
        return (id(v.latency), v.block_size, v.pending_prefill_tokens, v.waiting)

    def _rebuild(self, views: Sequence[InstanceView]) -> None:
        self._views = list(views)
        self._pos = {v.instance_id: i for i, v in enumerate(views)}
        self._keys = [self._key(v) for v in views]
        self._groups, self._number, self._spare = {}, {}, []
        self._healthy = self._waiting = 0
        n = len(views)
        self._group_at = np.full(n, -1, np.int64)
        self._running_at = np.zeros(n, np.int64)
        self._cap_at = np.zeros(n, np.int64)
        self._bits_for = None
        for i, (v, key) in enumerate(zip(views, self._keys, strict=True)):
            if key is not None:
                self._join(key, i, v)

    def _update(self, views: Sequence[InstanceView]) -> None:
        old = self._views
        if len(views) != len(old):
            self._rebuild(views)
            return
        changed = list(compress(range(len(views)), map(is_not, views, old)))
        if len(changed) * 4 > len(views):
            self._rebuild(views)
            return
        keys = self._keys
        for i in changed:
            was, v = old[i], views[i]
            if v.instance_id != was.instance_id:  # another roster: start over
                self._rebuild(views)
                return
            key = keys[i]
            if key is not None:
                self._leave(key, i, was.running)
            keys[i] = key = self._key(v)
            if key is not None:
                self._join(key, i, v)
            old[i] = v

    def _bits_in(self, fill: _Fill) -> Any:
        """The map bit of every position (-1: none yet), redone when the map's roster moved."""
        if self._bits_for is not fill.bit_of:
            get = fill.bit_of.get
            self._bits = np.array([get(v.instance_id, -1) for v in self._views], np.int64)
            self._bits_for = fill.bit_of
        return self._bits

    def candidates(
        self,
        views: Sequence[InstanceView],
        match: Mapping[str, Match],
        fill: _Fill | None = None,
    ) -> list[tuple[InstanceView, Match | None]]:
        """The healthy instances of ``views`` that can win, with their cached prefix, in view
        order (empty: none is healthy), one per group. ``fill``: the scorer breaks near-ties by
        it after the running sequences (``KvTtftScorer.spread_cold``), so within a group the
        winner is the first of the fewest running sequences with the least fill. For a group
        without a cached prefix that is the group's first of its fewest running sequences
        here: all of those have the same estimate, so only where that estimate is a near-tie
        does ``least_filled`` (asked with the same ``fill``) need to weigh them all."""
        self._update(views)
        pos, keys = self._pos, self._keys
        # instances with a cached prefix: per profile key, the prefix included, the least
        # (running sequences, fill, position)
        best: dict[tuple[int, ...], tuple[int, float, int]] = {}
        cached: dict[int, Match] = {}
        for iid, m in match.items():
            i = pos.get(iid)
            if i is None:
                continue
            key = keys[i]
            if key is None:
                continue
            cached[i] = m
            k = (*key, m.gpu_blocks, m.total_blocks)
            v = views[i]
            r = (v.running, fill(v) if fill is not None else 0.0, i)
            got = best.get(k)
            if got is None or r < got:
                best[k] = r
        self._cached = cached
        out: list[tuple[int, Match | None]] = [(i, cached[i]) for _, _, i in best.values()]
        # the others: per group (sorted by running sequences, then position) the first not
        # cached
        firsts = self._firsts
        firsts.clear()
        for key, members in self._groups.items():
            for _, i in members:
                if i not in cached:
                    out.append((i, None))
                    firsts[i] = key
                    break
        out.sort(key=_first)
        return [(views[i], m) for i, m in out]

    def least_filled(self, view: InstanceView, fill: _Fill) -> InstanceView:
        """Of ``view``'s group, if ``candidates`` just gave ``view`` for it without a cached
        prefix, the least filled (then first) member outside the cached ones with as few
        running sequences as ``view``: the one that wins the tie-break among them. Any other
        ``view`` as it is."""
        i = self._pos.get(view.instance_id)
        key = self._firsts.get(i) if i is not None else None
        if key is None:
            return view
        low, cached, views = view.running, self._cached, self._views
        members = self._groups[key]
        lo = bisect.bisect_left(members, (low, -1))
        hi = bisect.bisect_left(members, (low + 1, -1))
        if hi - lo < _VECTOR_FROM:
            fills = [(fill(views[j]), j) for _, j in members[lo:hi] if j not in cached]
            return views[min(fills)[1]]
        mask = (self._group_at == self._number[key]) & (self._running_at == low)
        if cached:
            mask[np.fromiter(cached, np.int64, len(cached))] = False
        at = np.flatnonzero(mask)
        shares = fill.shares(self._bits_in(fill)[at], self._cap_at[at])
        return views[int(at[int(np.argmin(shares))])]

    def mean_waiting(self) -> float:
        """The waiting requests per healthy instance of the last ``candidates`` (0: none)."""
        return self._waiting / self._healthy if self._healthy else 0.0

    def position(self, view: InstanceView) -> int:
        return self._pos[view.instance_id]


def _first(x: tuple[int, Match | None]) -> int:
    return x[0]
