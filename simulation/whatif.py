"""The model-predictive autoscaling policy's simulator of the pool (``WhatIfSimulator``): a
cluster simulation of the recent requests, re-timed, on a candidate pool size."""

from __future__ import annotations

import gc
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from engines.profile import LatencyProfile
from loadgen.records import RequestRecord
from loadgen.traces import TraceRequest
from loadgen.workloads import Planned
from router.autoscale import Slo, replica_capacity
from simulation.settings import EXACT, SimSettings, SloBudget, ideal_ttfts
from simulation.warming import longest_prompts

if TYPE_CHECKING:  # the cluster simulator builds this with itself: no import circle
    from simulation.cluster import ClusterSimulator


class WhatIfSimulator:
    """The model-predictive policy's simulator of the pool (``router.autoscale.WhatIf``): what
    a pool of ``replicas`` engines would attain if requests arrived at ``rate`` per second for
    ``horizon_s``, replayed by ``cluster`` (the ``ClusterSimulator`` class) on the production
    router core (scorer ``scorer``, default options) and sim engines of the router's profile,
    unperturbed (the router does not know the engines' speeds).

    The traffic: the most recent of ``recent`` (the requests of the last few minutes, their
    tokens and prefixes) re-timed to arrive evenly at the rate, after a backlog of the
    ``waiting`` requests queued now (the latest requests again, all at the start). At most
    ``max_engines`` are simulated: a larger pool is simulated as a slice of that many engines
    given that share of the rate and of the backlog (the router spreads load evenly), so a
    decision at 64 instances costs what one at ``max_engines`` does; the slice is thinner
    still where the forecast and the backlog would bring more than ``max_requests`` requests
    (short prompts, many requests a second per engine), down to one engine, and where one
    engine's share of the arrivals alone would, the run is shorter than the horizon
    (``span``: at least ``min_horizon_s``), so a decision's cost is bounded whatever the rate
    and the queue; such a run fails a rate over one engine's capacity by the closed-form
    model (``_sustainable``), which a short run cannot show. A request used again (a short
    history) gets fresh block ids for each lap. The engines start with empty caches,
    so the requests of the first ``warm_fraction`` of the horizon only warm them (the
    backlog's are always counted). With ``cached`` (the tokens each request of ``recent``
    found cached when it was placed, by schedule index) they start holding that instead: the
    run begins with a one-token request per such prefix (none a prefix of another taken),
    placed by the router like any other, and the sample arrives once those could be
    prefilled (``_warmed``), so that a conversation whose earlier turns the pool holds is not
    simulated cold. The attainment returned is over the requests some pool
    could serve in time (their ``ideal_ttfts`` within the TTFT SLO): the policy's goal is set
    over those (``PredictivePolicy.sim_goal``). Asked for a ``goal``, a run ends once more of
    those have missed than the goal allows (a ``SloBudget`` over them): the answer is then the
    share not yet missed, under the goal, and a failing candidate costs a fraction of a run.
    Built fresh by the cluster simulator at each
    decision; in production the same object can be built from the ingress's recent
    requests."""

    def __init__(
        self,
        cluster: type[ClusterSimulator],
        profile: LatencyProfile,
        scorer: str,
        trace_block_size: int,
        recent: Sequence[Planned],
        *,
        waiting: int = 0,
        ready: int = 1,
        settings: SimSettings | None = None,
        max_engines: int = 8,
        warm_fraction: float = 0.25,
        max_requests: int = 400,
        min_horizon_s: float = 20.0,
        cached: Mapping[int, int] | None = None,
    ) -> None:
        self.cluster, self.profile, self.scorer = cluster, profile, scorer
        self.trace_block_size, self.recent = trace_block_size, list(recent)
        self.waiting, self.ready = waiting, max(1, ready)
        base = settings or SimSettings()
        self.settings = SimSettings(
            instances=1,
            block_size=base.block_size,
            engine=dict(base.engine),
            perturbation=EXACT,
            event_lag_s=base.event_lag_s,
            load_lag_s=base.load_lag_s,
            load_interval_s=base.load_interval_s,
            what_if=False,
        )
        self.max_engines, self.warm_fraction = max(1, max_engines), warm_fraction
        self.max_requests = max(1, max_requests)
        self.min_horizon_s = min_horizon_s
        self.cached = cached
        self.calls = 0

    def span(self, replicas: int, rate: float, horizon_s: float) -> float:
        """The seconds simulated for ``replicas`` engines: ``horizon_s``, or less where one
        engine's share of ``rate`` would bring more than ``max_requests`` arrivals in it (at
        least ``min_horizon_s``)."""
        per_engine = rate / max(1, replicas)
        if per_engine * horizon_s <= self.max_requests:
            return horizon_s
        return max(min(self.min_horizon_s, horizon_s), self.max_requests / per_engine)

    def plan(self, replicas: int, rate: float, horizon_s: float) -> tuple[int, list[Planned]]:
        """The slice simulated for ``replicas`` engines over ``span(replicas, rate,
        horizon_s)``: its size, and its requests (the backlog's first, at 0)."""
        m, out, _ = self._slice(replicas, rate, self.span(replicas, rate, horizon_s))
        return m, out

    def _slice(
        self, replicas: int, rate: float, horizon_s: float
    ) -> tuple[int, list[Planned], list[tuple[TraceRequest, tuple[int, ...]]]]:
        """``plan``'s slice, and the prefixes (trace block ids, each with its request) its
        requests found cached when they were placed (``cached``; none without it)."""
        m = min(replicas, self.max_engines)
        # one engine's arrivals and share of the backlog; at most ``max_requests`` in all
        per = rate * horizon_s / replicas + self.waiting / self.ready
        if per > 0:  # a thinner slice
            m = max(1, min(m, int(self.max_requests / per)))
        share = m / replicas
        lam = rate * share
        backlog = round(self.waiting * m / self.ready)
        n = max(1, math.ceil(lam * horizon_s)) if lam > 0 else 0
        pool = self.recent
        if not pool:
            return m, [], []
        take = backlog + n
        out = []
        held: list[tuple[TraceRequest, tuple[int, ...]]] = []
        for k in range(take):
            lap, j = divmod(take - 1 - k, len(pool))
            src = pool[-1 - j]
            req = src.req
            if lap:  # a request used again: fresh blocks, so it hits only its own lap's
                req = replace(req, hash_ids=tuple(b + (lap << 48) for b in req.hash_ids))
            out.append(Planned(k, 0.0 if k < backlog else (k - backlog) / lam, req))
            if self.cached:
                blocks = self.cached.get(src.index, 0) // self.trace_block_size
                if blocks:
                    held.append((req, req.hash_ids[:blocks]))
        return m, out, held

    def _warmed(
        self, plan: list[Planned], held: list[tuple[TraceRequest, tuple[int, ...]]], m: int
    ) -> tuple[list[Planned], float, int]:
        """``plan`` behind a one-token request per prefix of ``held`` (longest first, none a
        prefix of another taken), all at 0, with ``plan`` shifted to arrive ``lead`` seconds
        later: when ``m`` engines could have prefilled them all at the profile's queue rate,
        with half as much again for an uneven spread, and a second. Returns the plan, the
        lead and the number of warming requests (the plan's first)."""
        if not held:
            return plan, 0.0, 0
        tbs = self.trace_block_size
        prefills = [Planned(0, 0.0, _prefill_only(req, h, tbs)) for req, h in held]
        taken = longest_prompts(prefills, len(prefills))
        tokens = sum(len(h) for _, h in taken) * tbs
        lead = 1.5 * self.profile.queue_s(math.ceil(tokens / m)) + 1.0
        warm = [Planned(i, 0.0, req) for i, (req, _) in enumerate(taken)]
        w = len(warm)
        late = [replace(p, index=p.index + w, offset_s=p.offset_s + lead) for p in plan]
        return warm + late, lead, w

    def __call__(
        self, replicas: int, rate: float, horizon_s: float, slo: Slo, goal: float | None = None
    ) -> float:
        # NOTE: without the collector, from the plan to the answer: its full passes would walk
        # the caller's heap (a whole day's replay around a decision), up to half a what-if's
        # cost (mix, one decision's four what-ifs: 0.28 s each, one 1.25 s from a full pass in
        # building the run); the call is short, and its cycles are collected once it is back on
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._attainment(replicas, rate, horizon_s, slo, goal)
        finally:
            if collecting:
                gc.enable()

    def _attainment(
        self, replicas: int, rate: float, horizon_s: float, slo: Slo, goal: float | None
    ) -> float:
        self.calls += 1
        span = self.span(replicas, rate, horizon_s)
        m, plan, held = self._slice(replicas, rate, span)
        if not plan:
            return 1.0
        plan, lead, n_warm = self._warmed(plan, held, m)
        settings = replace(self.settings, instances=m)
        # requests no pool can serve within the TTFT SLO (alone on an idle engine with every
        # earlier block cached: ``ideal_ttfts``) are left out: the policy's goal is over the
        # attainable ones, and the few in a small sample would swing it
        ideal = ideal_ttfts(plan, self.trace_block_size, self.profile, settings)
        warm = self.warm_fraction * span
        counted = frozenset(
            str(p.index)
            for p in plan
            if p.offset_s >= lead
            and not 0 < p.offset_s - lead < warm
            and ideal[p.index] <= slo.ttft_s
        )
        if not counted:
            return 1.0
        budget = None
        if goal is not None:  # ends the run once its counted misses rule the goal out
            allowed = _allowed_misses(len(counted), goal)
            budget = SloBudget(slo.ttft_s, slo.tpot_s, allowed, counted=counted)
        sim = self.cluster(
            self.profile, self.scorer, settings, self.trace_block_size, router_profile=self.profile
        )
        try:
            run = sim.run(plan, budget=budget)
        finally:
            sim.close()
        if run.aborted and budget is not None:  # at least this many missed: at most the rest
            return (len(counted) - budget.misses) / len(counted)
        met = [r.meets(slo.ttft_s, slo.tpot_s) for r in run.records if str(r.index) in counted]
        sample = [r for r in run.records if r.index >= n_warm]
        if span < horizon_s and not _sustainable(self.profile, sample, rate / replicas, slo.tpot_s):
            # over one engine's capacity: the horizon beyond the span would miss
            later = len(met) * (horizon_s - span) / (span - warm)
            return sum(met) / (len(met) + later)
        return sum(met) / len(met)


def _prefill_only(req: TraceRequest, blocks: tuple[int, ...], block_size: int) -> TraceRequest:
    """A one-token request prefilling ``blocks`` of ``req`` (its category kept, no session)."""
    return replace(
        req,
        input_length=len(blocks) * block_size,
        output_length=1,
        hash_ids=blocks,
        chat_id=None,
        parent_chat_id=None,
    )


def _sustainable(
    profile: LatencyProfile, records: Sequence[RequestRecord], rate: float, tpot_s: float | None
) -> bool:
    """Whether one engine sustains ``rate`` requests a second of the run's requests (their mean
    prompt, cached and output tokens) by the closed-form capacity model
    (``router.autoscale.replica_capacity``). A run shortened to its ``span`` needs this: an
    engine a little over its capacity builds its batch and queue slowly, so 20 s pass what 60 s
    fail (one engine at 24.75 req/s of the Azure conv trace: 0.987 over 20 s, 0.004 over 60 s;
    the model said 21.2)."""
    if not records:
        return True
    n = len(records)
    # the simulator sets both on every record (None only over HTTP, where usage may be absent)
    prompt = sum(r.prompt_tokens or 0 for r in records) / n
    cached = sum(r.cached_tokens or 0 for r in records) / n
    output = sum(r.output_tokens for r in records) / n
    cap = replica_capacity(profile, prompt, max(prompt - cached, 1.0), output, tpot_s)
    return rate <= cap


def _allowed_misses(n: int, goal: float) -> int:
    """The most misses among ``n`` requests that still attain ``goal`` (as the fraction met,
    ``(n - k) / n >= goal``, compares: -1 when none is allowed)."""
    k = n - math.ceil(n * goal)
    while k >= 0 and (n - k) / n < goal:
        k -= 1
    while k + 1 <= n and (n - k - 1) / n >= goal:
        k += 1
    return k
