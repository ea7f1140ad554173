"""The autoscaling suite's days and runs (``benchmarks/autoscale_suite.py``): its workloads
re-timed into burst-and-lull days (``make_plan``), the SLO and the attainment target a day's
ceiling allows (``ceiling_and_target``), and one simulated run of a day, at a fixed size or
under a policy, scored from a given time on (``one_run``; the suite scores a periodic day after
its first cycle), on the cluster's settings (``sim_settings``). What the suite's searches (the
static peak, the hindsight references) and ``benchmarks/autoscale_misses.py`` build on.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from typing import Any

import numpy as np

from benchmarks.common import TRACES
from engines.profile import LatencyProfile
from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate
from loadgen.traces import PrefixModel, load_trace
from loadgen.workloads import Planned, build_schedule
from router.autoscale import Autoscaler, Slo, create_policy
from simulation.cluster import simulate
from simulation.measures import flapping, slo_attainment
from simulation.options import POOL_FLAGS
from simulation.settings import Perturbation, SimSettings, ideal_ttfts

WORKLOADS = ("conversation", "to-b", "mix", "azure-conv")
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.05
PERIOD_S, LOW, HIGH = 600.0, 0.5, 2.0  # a lull at half the mean rate, a burst at twice it
BURST_FROM_S = PERIOD_S * 2 / 3  # each cycle's lull, then its burst from here to its end
# the synthetic days cycle every PERIOD_S and are scored after their first cycle (the
# forecaster's training, as yesterday is in production); the Azure trace's hour is scored whole
PERIODIC = frozenset(WORKLOADS) - {"azure-conv"}
SYNTH_RATE = 20.0
# the Azure conv trace's hour, compressed 4x at the default --rate-scale 2 (15 min, ~21 req/s)
AZURE_RATE_SCALE = 4.0
INTERVAL_S = 10.0  # between the autoscaler's decisions


def rate_at(t: float) -> float:
    """The burst-and-lull multiplier of the mean rate at ``t`` (its mean over a cycle is 1)."""
    return LOW if (t % PERIOD_S) < BURST_FROM_S else HIGH


def burst_and_lull(plan: list[Planned]) -> list[Planned]:
    """``plan`` re-timed: a request at the ``k``-th fraction of the plan's arrivals arrives
    where the burst-and-lull cumulative rate reaches it (mean rate kept)."""
    if len(plan) < 2:
        return plan
    span = plan[-1].offset_s - plan[0].offset_s
    # the cumulative rate on a grid of 1 s (mean 1), inverted by bisection
    grid = [0.0]
    t = 0.0
    while grid[-1] < span:
        grid.append(grid[-1] + rate_at(t))
        t += 1.0
    out = []
    for p in plan:
        x = p.offset_s - plan[0].offset_s
        k = bisect.bisect_left(grid, x)
        if k == 0:
            at = 0.0
        else:
            lo, hi = grid[k - 1], grid[k]
            at = (k - 1) + (x - lo) / (hi - lo)
        out.append(dataclasses.replace(p, offset_s=at))
    return out


def make_plan(workload: str, seed: int, rate_scale: float, duration: float) -> tuple[list, int]:
    """The workload's plan and block size. ``azure-conv`` keeps its own arrival curve (time
    compressed by ``rate_scale``), its prefixes drawn by ``PrefixModel(seed)`` as the routing
    suite does; the others are re-timed into burst-and-lull days."""
    if workload == "conversation":
        trace = load_trace(TRACES / "mooncake_conversation.jsonl")
        plan = build_schedule(trace.requests, time_scale=1.0 / rate_scale)
        return burst_and_lull(plan), trace.block_size
    if workload == "azure-conv":
        trace = load_trace(TRACES / "azure_llm_2023_conv.csv", prefix_model=PrefixModel(seed=seed))
        scale = AZURE_RATE_SCALE * rate_scale / 2.0
        return build_schedule(trace.requests, time_scale=1.0 / scale), trace.block_size
    p = SynthParams(rate=SYNTH_RATE, duration_s=duration, seed=seed)
    return burst_and_lull(build_schedule(generate(workload, p))), SYNTH_BLOCK_SIZE


def ideal_ttfts_of(plan: list, block: int, truth: LatencyProfile) -> list[float]:
    """Each request's ideal TTFT (``simulation.settings.ideal_ttfts``) on the suite's engines."""
    return ideal_ttfts(plan, block, truth, SimSettings(instances=1))


def ceiling_and_target(plan: list, ideal: list[float], since: float) -> tuple[float, float]:
    """The workload's ceiling (the share of the requests from ``since`` whose ideal TTFT is
    within the SLO) and its attainment target: 99%, or one point under the ceiling."""
    sc = [x for p, x in zip(plan, ideal, strict=True) if p.offset_s >= since]
    ceiling = sum(1 for x in sc if not math.isnan(x) and x <= SLO_TTFT_S) / len(sc)
    return ceiling, min(0.99, ceiling - 0.01)


def scored(records: list, since: float) -> list:
    return [r for r in records if r.intended_s >= since]


def one_run(
    plan: list, block: int, truth: LatencyProfile, seed: int, n: int, spec: Any, hi: int,
    lo: int, target: float, since: float, period: float = 0.0, records: bool = False,
    warm: int = 0, handover: int = 0, engine: dict[str, Any] | None = None,
    what_if_cached: bool = False,
) -> Any:  # fmt: skip
    """One run from ``n`` engines: fixed (``spec`` None), a policy spec, or a ``Policy``; its
    figures (and its records, with ``records``). ``engine``: the cluster's options
    (``sim_settings``: the CPU tier, the pool)."""
    settings = sim_settings(
        n,
        seed,
        engine,
        warm_prefixes=warm,
        handover_prefixes=handover,
        what_if_cached=what_if_cached,
    )
    scaler = None
    if spec is not None:
        slo = Slo(SLO_TTFT_S, SLO_TPOT_S, target)
        if isinstance(spec, str):
            if spec.split("@", 1)[0] == "kvroute" and period and "period_s" not in spec:
                spec += ("+" if "@" in spec else "@") + f"period_s={period:g}"
            policy = create_policy(spec, profile=truth, slo=slo, cold_start_s=settings.cold_start_s)
        else:
            policy = spec
        scaler = Autoscaler(policy, lo, hi, INTERVAL_S)
    else:
        settings.what_if = False
    t0 = time.perf_counter()
    sim = simulate(plan, block, truth, "kv_ttft", settings, autoscaler=scaler)
    cpu = sim.decision_cpu_s
    out = {
        "attainment": round(slo_attainment(scored(sim.records, since), SLO_TTFT_S, SLO_TPOT_S), 5),
        "gpu_hours": round(sim.gpu_seconds_in(since) / 3600, 4),
        "whole_day": {
            "attainment": round(slo_attainment(sim.records, SLO_TTFT_S, SLO_TPOT_S), 5),
            "gpu_hours": round(sim.gpu_seconds / 3600, 4),
        },
        "peak": max((k for _, k, _ in sim.replicas), default=n),
        "changes": max(0, len(sim.replicas) - 1),
        "flapping": flapping(sim.replicas, settings.cold_start_s, sim.span_s, period),
        "decision_cpu_s": {"mean": round(sum(cpu) / len(cpu), 4), "max": round(max(cpu), 4)}
        if cpu
        else None,
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    if sim.joins:
        out["after_join"] = after_join(sim)
    return (out, sim.records) if records else out


def after_join(sim: Any, window_s: float = 60.0) -> dict[str, Any]:
    """TTFT p99 (ms) in the minute after each scale-up: of every request arriving within
    ``window_s`` after an engine became routable, and of the requests the new engines served
    in their first ``window_s``."""
    joins = sorted(t for t, _, _ in sim.joins)
    first = {iid: t for t, iid, _ in sim.joins}
    near, own = [], []
    for r in sim.records:
        if not r.ok:
            continue
        k = bisect.bisect_right(joins, r.intended_s) - 1
        if k >= 0 and r.intended_s < joins[k] + window_s:
            near.append(r.ttft_s)
        t = first.get(r.instance)
        if t is not None and t <= r.intended_s < t + window_s:
            own.append(r.ttft_s)

    def p99(xs: list[float]) -> float | None:
        return round(float(np.percentile(xs, 99)) * 1e3, 1) if xs else None

    return {
        "joins": len(joins),
        "warmed": sum(w for _, _, w in sim.joins),
        "ttft_p99_ms_minute_after": p99(near),
        "ttft_p99_ms_new_engines_first_minute": p99(own),
        "requests_new_engines_first_minute": len(own),
    }


def sim_settings(n: int, seed: int, options: dict[str, Any] | None, **kw: Any) -> SimSettings:
    """``n`` engines, perturbation ``seed``, and the cluster's ``options``: the pool's
    (``POOL_FLAGS``, ``SimSettings`` fields) and the engines' (the rest, ``SimSettings.engine``)."""
    opts = dict(options or {})
    pool = {k: opts.pop(k) for k in POOL_FLAGS if k in opts}
    return SimSettings(instances=n, engine=opts, perturbation=Perturbation(seed=seed), **pool, **kw)
