"""``kv_ttft``: kvroute's scorer. Mooncake-style TTFT estimate per instance, lowest wins.

    ttft(i) = queue(i) + prefill(uncached tokens at this context length) + load(CPU-hit tokens)

- queue(i): the prefill work already waiting on ``i`` (engine-reported queued prefill tokens,
  beyond each queued prompt's cached prefix, plus this router's assignments newer than that
  report, plus the step in flight that a report leaves out, priced from this router's own
  backlog there: ``LoadTracker._with_backlog``) over ``i``'s prefill rate, from its own profile;
- prefill: the request's tokens beyond the instance's leading cached run (GPU or CPU), in
  ``max_num_batched_tokens`` chunks at their context length, plus the per-request overhead;
- load: the CPU-resident part of that run, moved to the GPU at the profile's bandwidth.

An engine that caps each prefill per step (``long_prefill_token_threshold``) does not make a
request wait for the whole queue: its capped chunks share steps with the queued work from the
start, so the queue and prefill terms become one walk over those shared steps
(``LatencyProfile.ttft_s`` with ``queued``). Priced as plain FCFS, such an engine's queue
would look far longer to a cached request than it is, and push it off its cache.

The profile is measured on a quiet engine; a loaded deployment is slower, and not uniformly:
every sequence an instance is decoding stretches the steps a new prefill shares with it (on a
vLLM CPU engine that also means per-token streaming work in the same few cores). So the
estimate is calibrated online from the first tokens the router sees: a least-squares fit over
the last ``window`` requests of

    observed TTFT ~ a * profile estimate + b * running sequences + d * waiting requests + c

refit every ``refit_every`` first tokens once ``min_samples`` arrived (until then a=1, b=c=0,
the plain profile). ``a`` rescales the profile (contention, another machine), ``b`` is the
decode interference per running sequence, ``d`` what each request already waiting on the
instance costs beyond the prefill work the profile prices for it (on a small CPU box: its
tokenisation, streaming and Python work in the same cores), ``c`` the fixed path (ingress,
Serve transit) that matters only to SLO admission. Coefficients are clipped to sane ranges
so a burst of outliers cannot invert the ranking.

Four rules look past the request at hand, each measured on the routing suite
(``benchmarks/routing_suite.py``) and the whole Mooncake trace; the figures, and the variants
measured and not kept, are in ``docs/simulation.md`` ("kv_ttft's rules, measured"):

- ``externality`` (4 by default): a request's own prefill delays the requests that queue
  behind it, so each instance's estimate is charged the engine time the request would take
  there (its uncached tokens on an idle engine) times what that time costs the others:

      toll = externality * queued_share * (waiting requests per healthy instance)

  ``queued_share`` is the share of the last ~64 placements (a moving average) whose own best
  instance already had requests waiting: while the router can still find queue-free engines,
  work added anywhere delays nobody and the toll stays near 0; once requests cannot avoid
  queues, the work a cache hit saves is capacity for everyone, and going cold to save a little
  wait costs the cluster more than it saves the request. It adapts to the load online, with
  no per-workload setting.
- ``interference`` (0.02 by default): where more prefill already waits on an instance than
  one step computes (``max_num_batched_tokens``), every step there is a full prefill chunk
  shared with its decoding sequences, and a request's prefill added to that queue lengthens
  as many of their steps again: each of its running sequences is charged the request's own
  engine time (as the toll prices it) times ``interference``. Behind a queue that fits one
  step it costs them one step, and nothing is charged.
- ``affinity_s`` (off by default): among the instances whose estimate is within it of the
  best, the one with the longest cached prefix wins. Going cold elsewhere to save a few ms
  copies the prefix into a second cache (evicting something there) and leaves the next request
  sharing it no better off; it helped the suite's synthetic workloads and hurt the Mooncake
  trace, so it stays off until it adapts online.
- ``spread_cold``: near-ties (within ``tie_s``: a cold prefix between idle engines, most often)
  go to the least decode load, then the longest cached prefix, then the emptiest cache by the
  map, then the lowest estimate, so that cold prefixes spread over the whole cluster's cache
  instead of filling (and evicting on) the first engines in view order.

Without ``spread_cold``, decode load breaks near-ties toward fewer running sequences. With
``kv_veto`` set (off by default), an instance whose GPU KV usage is at or above it, or that
could not fit the request's blocks, is passed over (unless every instance is). It was on by
default, to spare running decodes from preemption, until the cluster simulator showed it doing
the opposite under load (the instances it passed over are the busy ones holding the prefixes).
vLLM queues a request that does not fit rather than preempting for it, and the estimate prices
the queue.

With a cluster KV pool (the core's ``kv_pool`` link; the map's ``POOL_INSTANCE``), every
placement carries ``pool_load``, the hint to the engine: load what its lookup finds in the pool
past its own tiers, unless the link is slower than the engine at producing those blocks (a
10 GbE link against an H100's prefill): then it recomputes them. ``price_pool`` (off by
default) also places by the pool's residency: each instance's estimate takes the quicker of
loading the pool's run past its own (the bytes over the link, and on a busy engine one step
more, since the load is asynchronous) and recomputing it, so a lightly loaded engine can take
a request whose prefix another engine holds. It stays off: measured on the suite, it equals
placing by the engines' own tiers on every workload but the conversation trace at L2, where it
costs a quarter more mean excess (``docs/pool.md``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from itertools import compress
from operator import is_not
from typing import Any

import numpy as np

from cachemap import POOL_INSTANCE, CacheMap, Match, Tier
from engines.pool.link import PoolLink
from router.placement import (
    InstanceView,
    Placement,
    PlacementRequest,
    Scorer,
    healthy,
    kv_fits,
    profile_ttft,
    queued_past_a_step,
)
from router.scorers.calibration import TtftCalibration


class KvTtftScorer(Scorer):
    name = "kv_ttft"

    def __init__(
        self,
        kv_veto: float | None = None,
        tie_s: float = 0.002,
        calibrate: bool = True,
        calibration_window: int = 512,
        spread_cold: bool = True,
        affinity_s: float = 0.0,
        externality: float = 4.0,
        interference: float = 0.02,
        price_pool: bool = False,
    ) -> None:
        if kv_veto is not None and not 0 < kv_veto <= 1:
            raise ValueError(f"kv_veto must be in (0, 1], got {kv_veto}")
        self.kv_veto = kv_veto
        self.tie_s = tie_s
        self.calibration = TtftCalibration(calibration_window) if calibrate else None
        self._index = _CandidateIndex()
        self.spread_cold = spread_cold
        if affinity_s < 0:
            raise ValueError(f"affinity_s must be >= 0, got {affinity_s}")
        self.affinity_s = affinity_s
        if externality < 0:
            raise ValueError(f"externality must be >= 0, got {externality}")
        self.externality = externality
        if interference < 0:
            raise ValueError(f"interference must be >= 0, got {interference}")
        self.interference = interference
        self._cache_map: CacheMap | None = None
        self.price_pool = price_pool
        self._link: PoolLink | None = None  # the engines' link to the KV pool (None: no pool)
        # the share of recent placements whose own best instance already had requests waiting
        self.queued_share = 0.0

    def attach(self, cache_map: CacheMap) -> None:
        self._cache_map = cache_map

    def attach_pool(self, link: PoolLink | None) -> None:
        self._link = link

    def _filler(self) -> _Fill | None:
        """How full an instance's GPU cache is, by the map (None: no map, or not spreading)."""
        cm = self._cache_map
        if cm is None or not self.spread_cold:
            return None
        return _Fill(cm)

    def profile_estimate(
        self,
        request: PlacementRequest,
        inst: InstanceView,
        m: Match | None,
        pool_blocks: int = 0,
        idle: bool = False,
    ) -> tuple[float, int]:
        """(the profile's TTFT in seconds, leading cached blocks) of ``request`` on ``inst``;
        ``pool_blocks``: the prompt's leading run in the KV pool, priced when a link is
        attached (a load or a recompute, the quicker: ``profile_ttft``)."""
        return profile_ttft(request, inst, m, idle=idle, pool_blocks=pool_blocks, link=self._link)

    def pool_blocks(self, match: Mapping[str, Match]) -> int:
        """The request's leading blocks in the KV pool, by ``match`` (0: none, or no pool)."""
        if self._link is None:
            return 0
        pm = match.get(POOL_INSTANCE)
        return pm.total_blocks if pm is not None else 0

    def estimate(
        self,
        request: PlacementRequest,
        inst: InstanceView,
        m: Match | None,
        pool_blocks: int = 0,
    ) -> tuple[float, int, float]:
        """(estimated TTFT in seconds, calibrated; leading cached blocks; the profile's part)."""
        base, cached = self.profile_estimate(request, inst, m, pool_blocks)
        cal = self.calibration
        return (cal.correct(base, inst.running, inst.waiting) if cal else base), cached, base

    def _vetoed(self, request: PlacementRequest, inst: InstanceView) -> bool:
        if self.kv_veto is None:
            return False
        return inst.gpu_kv_usage >= self.kv_veto or not kv_fits(request, inst)

    def place(
        self,
        request: PlacementRequest,
        instances: Sequence[InstanceView],
        match: Mapping[str, Match],
    ) -> Placement:
        # the toll's weight before the queue (0: off, or no recent request met a queue)
        share = self.externality * self.queued_share
        pool, filler, queue = self._pool(instances, match, request, share > 0)
        cal = self.calibration
        # the cost a request's own prefill puts on the requests it delays: its engine time
        # (calibrated like the estimate) times the cluster's waiting requests per instance,
        # as far as requests lately could not avoid a queue
        toll = share * queue * (cal.a if cal else 1.0)
        # the cost of its prefill to each sequence decoding beside it, where a queue already
        # fills every step: their steps lengthen by its engine time (their TPOT)
        stall = self.interference * (cal.a if cal else 1.0)
        in_pool = self.pool_blocks(match)
        scored = self._scored(request, pool, toll, stall, in_pool if self.price_pool else 0)
        s, cached, base, inst = self._choose(scored, filler)
        if toll > 0 or stall > 0:  # the estimate itself, for admission
            s = cal.correct(base, inst.running, inst.waiting) if cal else base
        detail: dict[str, Any] = {
            "profile_ttft_s": base,
            "running": inst.running,
            "waiting": inst.waiting,
        }
        if self._link is not None:
            detail["pool_load"] = self._pool_load(request, inst, match, in_pool)
        return Placement(inst.instance_id, estimated_ttft_s=s, cached_blocks=cached, detail=detail)

    def _pool_load(
        self,
        request: PlacementRequest,
        inst: InstanceView,
        match: Mapping[str, Match],
        in_pool: int,
    ) -> bool:
        """The hint to ``inst``: load from the pool what it finds there beyond its own tiers,
        unless the link is slower than the engine at producing those blocks (the rest of the
        prompt's, where the map shows none: the engine may find blocks the map has not shown
        yet). Engine time, not this request's latency: a block recomputed to save a step's
        wait costs the cluster its compute, which a loaded cluster has least of."""
        m = match.get(inst.instance_id)
        own = m.total_blocks if m is not None else 0
        reach = max(in_pool, (request.prompt_tokens - 1) // inst.block_size)
        return reach > own and self.profile_estimate(request, inst, m, reach, idle=True)[1] > own

    def _pool(
        self,
        instances: Sequence[InstanceView],
        match: Mapping[str, Match],
        request: PlacementRequest,
        tolled: bool,
    ) -> tuple[list[tuple[InstanceView, Match | None]], _Fill | None, float]:
        """The candidates with their matches, the fill function when the index chose them, and
        the waiting requests per healthy instance (0.0 unless ``tolled``: only the toll reads
        it; the index keeps it anyway)."""
        if self.kv_veto is None and len(instances) >= _INDEXED_FROM:
            filler = self._filler()
            pool = self._index.candidates(instances, match, filler)
            if not pool:
                healthy(instances)  # raises: none is
            return pool, filler, self._index.mean_waiting()
        vetted = healthy(instances)
        queue = sum(i.waiting for i in vetted) / len(vetted) if tolled else 0.0
        if self.kv_veto is not None:
            vetted = [i for i in vetted if not self._vetoed(request, i)] or vetted
        get = match.get
        return [(i, get(i.instance_id)) for i in vetted], None, queue

    def _scored(
        self,
        request: PlacementRequest,
        pool: list[tuple[InstanceView, Match | None]],
        toll: float,
        stall: float = 0.0,
        in_pool: int = 0,
    ) -> list[tuple[float, int, float, InstanceView]]:
        """(estimate with its toll, cached blocks, profile estimate, instance) per candidate;
        updates ``queued_share`` with whether the best own estimate met a queue."""
        cal = self.calibration
        a, b, d, c = (cal.a, cal.b, cal.d, cal.c) if cal else (1.0, 0.0, 0.0, 0.0)
        # NOTE: what ``estimate`` does, but instances in the same state for the profile (often:
        # no cached prefix, the same queue) are priced once: the profile's walk is the cost.
        # The key holds the match itself (None or its two run lengths).
        priced: dict[tuple[object, ...], tuple[float, int]] = {}
        work: dict[tuple[object, ...], float] = {}
        scored: list[tuple[float, int, float, InstanceView]] = []
        own, own_waiting = math.inf, 0
        for inst, m in pool:
            waiting = inst.waiting
            key = (id(inst.latency), inst.block_size, m, inst.pending_prefill_tokens, waiting)
            got = priced.get(key)
            if got is None:
                got = priced[key] = self.profile_estimate(request, inst, m, in_pool)
            base, cached = got
            # NOTE: ``cal.correct`` inline (the same operations in the same order)
            est = a * base + b * inst.running + d * waiting + c if cal else base
            if est < own:
                own, own_waiting = est, waiting
            elif est == own and waiting < own_waiting:  # any best without a queue
                own_waiting = waiting
            # the running sequences' steps the request's prefill lengthens (their TPOT)
            charge = toll
            if stall > 0 and queued_past_a_step(inst):
                charge += stall * inst.running
            if charge > 0:
                if inst.pending_prefill_tokens == 0:  # nothing queued: the walk just priced it
                    w = base
                else:
                    wkey = (id(inst.latency), inst.block_size, m)
                    idle = work.get(wkey)
                    if idle is None:
                        idle = work[wkey] = self.profile_estimate(
                            request, inst, m, in_pool, idle=True
                        )[0]
                    w = idle
                est += charge * w
            scored.append((est, cached, base, inst))
        self.queued_share += ((own_waiting > 0) - self.queued_share) / _SHARE_WINDOW
        return scored

    def _choose(
        self, scored: list[tuple[float, int, float, InstanceView]], filler: _Fill | None
    ) -> tuple[float, int, float, InstanceView]:
        """The winner among the candidates scored: the best estimate, with affinity and
        near-tie rules."""
        best = min(x[0] for x in scored)
        near = [x for x in scored if x[0] <= best + self.tie_s]
        if self.affinity_s > 0:
            # within ``affinity_s`` of the best, the longest cached prefix wins (then the
            # estimate): a request stays with its cache when going elsewhere saves little
            close = [x for x in scored if x[0] <= best + self.affinity_s]
            top = max(x[1] for x in close)
            if top > 0:
                near = [min((x for x in close if x[1] == top), key=_estimate)]
        if filler is not None:
            # each uncached candidate stands for its group's members in its state: the least
            # filled of those is the one that can win, in view order
            index = self._index
            near = sorted(
                ((e, k, p, index.least_filled(v, filler)) for e, k, p, v in near),
                key=lambda x: index.position(x[3]),
            )
        if len(near) == 1:
            return near[0]
        # near-ties (a cold prefix between idle engines, most often): the least decode load,
        # then the longest cached prefix, then the emptiest cache, so that cold prefixes
        # spread over the cluster's whole cache instead of filling (and evicting on) the
        # first engines in view order, while a short prompt stays with its cache
        fill = filler or self._filler()
        if fill is not None:
            return min(near, key=lambda x: (x[3].running + x[3].waiting, -x[1], fill(x[3]), x[0]))
        return min(near, key=lambda x: (x[3].running + x[3].waiting, x[0]))

    def on_first_token(self, placement: Placement, ttft_s: float) -> None:
        cal, d = self.calibration, placement.detail
        if cal is not None and "profile_ttft_s" in d:
            cal.observe(float(d["profile_ttft_s"]), int(d["running"]), int(d["waiting"]), ttft_s)


# placements over which ``KvTtftScorer.queued_share`` averages (an exponential moving average)
_SHARE_WINDOW = 64

# from this many instances on (and without ``kv_veto``), ``place`` prices only the instances
# ``_CandidateIndex`` says can win
_INDEXED_FROM = 32


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


def _estimate(x: tuple[float, int, float, InstanceView]) -> float:
    return x[0]


def _first(x: tuple[int, Match | None]) -> int:
    return x[0]
