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
- ``replica_spread`` (off by default): router replicas (``as_replica``: this one's index of
  how many) that place a burst at once from one view all pick the best and herd. With it, the
  candidates within the request's own engine time of the best that hold as much of its prompt
  are near enough: each replica takes the best of those a stable hash of the instance id gives
  it, else its own place in their order. At 4 replicas in the simulator it cut conversation's
  L1 mean excess 1,037 -> 353 ms (1 replica: 119) and helped to-b, mix and rag, but raised
  agentic's and azure-conv's L2 p50 on every seed: off until it adapts online
  (docs/simulation.md).

Without ``spread_cold``, decode load breaks near-ties toward fewer running sequences. With
``kv_veto`` set (off by default), an instance whose GPU KV usage is at or above it, or that
could not fit the request's blocks, is passed over (unless every instance is). It was on by
default, to spare running decodes from preemption, until the cluster simulator showed it doing
the opposite under load (the instances it passed over are the busy ones holding the prefixes).
vLLM queues a request that does not fit rather than preempting for it, and the estimate prices
the queue.

With a cluster KV pool (the core's ``kv_pool`` link; the map's ``POOL_INSTANCE``), every
placement carries the engine's hint ``pool_load`` (``_pool_load``): load from the pool what
its own tiers miss, unless the link is slower than recomputing (with ``pool_toll``, off by
default: unless waiting costs the request more than recomputing costs the requests queued
behind it; that takes the mean excess down at L2 and some p99s up, ``docs/pool.md``).
``price_pool`` (off by default) also places by the pool's residency, each estimate taking the
quicker of loading and recomputing the pool's run: it equals placing by the engines' own tiers
on the suite but for the conversation trace at L2, where it costs a quarter more mean excess
(``docs/pool.md``). The candidate index for large clusters is ``router.scorers.kv_index``'s.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from cachemap import POOL_INSTANCE, CacheMap, Match
from engines.pool.link import PoolLink
from router.placement import (
    InstanceView,
    Placement,
    PlacementRequest,
    Scorer,
    healthy,
    kv_fits,
    pool_load_parts,
    profile_ttft,
    queued_past_a_step,
)
from router.scorers.calibration import TtftCalibration
from router.scorers.kv_index import _CandidateIndex, _Fill


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
        pool_toll: bool = False,
        replica_spread: bool = False,
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
        # router replica ``index`` of ``count`` (``as_replica``), and whether replicas share
        # out near-equal candidates (``replica_spread``, where there are several)
        self._replica = (0, 1)
        self.replica_spread = replica_spread
        self._spreading = False
        self._cache_map: CacheMap | None = None
        self.price_pool = price_pool
        self.pool_toll = pool_toll
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
        self, request: PlacementRequest, inst: InstanceView, m: Match | None
    ) -> tuple[float, int, float]:
        """(estimated TTFT in seconds, calibrated; leading cached blocks; the profile's part)."""
        base, cached = self.profile_estimate(request, inst, m)
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
        chosen = None
        if self._spreading:
            # the other replicas may each send a request like this one to the best at once:
            # what that adds to it makes the candidates within it as good
            lead = min(scored, key=_estimate)
            own = self.profile_estimate(request, lead[3], match.get(lead[3].instance_id), idle=True)
            spread = own[0] * (cal.a if cal else 1.0)
            if spread > self.tie_s:
                chosen = self._replicas_pick(scored, lead, spread)
        s, cached, base, inst = chosen or self._choose(scored, filler)
        if toll > 0 or stall > 0:  # the estimate itself, for admission
            s = cal.correct(base, inst.running, inst.waiting) if cal else base
        detail: dict[str, Any] = dict(
            profile_ttft_s=base, running=inst.running, waiting=inst.waiting
        )
        if self._link is not None:
            weight = toll if self.pool_toll else 0.0
            detail["pool_load"] = self._pool_load(request, inst, match, in_pool, weight)
        return Placement(inst.instance_id, estimated_ttft_s=s, cached_blocks=cached, detail=detail)

    def _pool_load(
        self,
        request: PlacementRequest,
        inst: InstanceView,
        match: Mapping[str, Match],
        in_pool: int,
        toll: float,
    ) -> bool:
        """The hint to ``inst``: load from the pool what it finds past its own tiers (all the
        prompt's blocks where the map shows none: it may find some the map does not show yet),
        unless the link's wait costs the request more than a recompute's engine time costs the
        requests queued behind it (``toll`` per second, as placement prices it): a slow link's
        loads are declined while nothing queues, taken once the cluster lacks compute."""
        m = match.get(inst.instance_id)
        reach = max(in_pool, (request.prompt_tokens - 1) // inst.block_size)
        parts = pool_load_parts(request, inst, m, reach, self._link, idle=True)
        if parts is None:
            return False
        engine, wait = parts
        recompute = self.profile_estimate(request, inst, m, idle=True)[0]
        return engine + wait - recompute < toll * (recompute - engine)

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

    def _replicas_pick(
        self,
        scored: list[tuple[float, int, float, InstanceView]],
        lead: tuple[float, int, float, InstanceView],
        spread: float,
    ) -> tuple[float, int, float, InstanceView]:
        """``replica_spread``: replicas deciding from one view at once (a burst spread over
        them) would all take the best (``lead``); among the candidates within ``spread`` of it
        that hold as much of the prompt (never a cache hit traded), each takes the best of its
        own (by a stable hash of the instance id), else its own place in the estimates' order."""
        me, count = self._replica
        ahead = sorted(
            (x for x in scored if x[0] <= lead[0] + spread and x[1] >= lead[1]), key=_estimate
        )
        mine = [x for x in ahead if _owner(x[3].instance_id, count) == me]
        return mine[0] if mine else ahead[me % len(ahead)]

    def as_replica(self, index: int, count: int) -> None:
        if not 0 <= index < count:
            raise ValueError(f"replica index must be in [0, {count}), got {index}")
        self._replica = (index, count)
        self._spreading = self.replica_spread and count > 1

    def on_first_token(self, placement: Placement, ttft_s: float) -> None:
        cal, d = self.calibration, placement.detail
        if cal is not None and "profile_ttft_s" in d:
            cal.observe(float(d["profile_ttft_s"]), int(d["running"]), int(d["waiting"]), ttft_s)


# placements over which ``KvTtftScorer.queued_share`` averages (an exponential moving average)
_SHARE_WINDOW = 64

# from this many instances on (and without ``kv_veto``), ``place`` prices only the instances
# ``_CandidateIndex`` says can win
_INDEXED_FROM = 32


def _estimate(x: tuple[float, int, float, InstanceView]) -> float:
    return x[0]


def _owner(instance_id: str, count: int) -> int:
    """The router replica (of ``count``) whose own an instance is among near-equal candidates:
    a stable hash, the same in every replica whatever order it learnt the instances in."""
    return zlib.crc32(instance_id.encode()) % count
