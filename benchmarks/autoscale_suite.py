"""The autoscaling suite (issue 33's figures): each policy of ``router.autoscale`` against
static provisioning at the peak, on burst-and-lull traffic, in the cluster simulator.

Workloads (``WORKLOADS``; they, their days and a run's scoring are in
``benchmarks/autoscale_runs.py``), each re-timed into a burst-and-lull day (``burst_and_lull``):
the arrival rate follows cycles of ``PERIOD_S`` seconds, a lull at ``LOW`` times the mean base
rate for two thirds of the cycle and a burst at ``HIGH`` times it for the last third; the
requests keep their order and their tokens and prefixes, and only their arrival times are warped
(the inverse of the cumulative rate):

- ``conversation``: the shared Mooncake conversation trace (all 12,031 requests; its mean
  rate, 3.4 req/s, times ``--rate-scale``);
- ``to-b`` and ``mix``: ``loadgen.synthetic``'s workloads at ``SYNTH_RATE`` req/s mean for
  ``--duration`` seconds.

Per workload and seed (the perturbation's and the synthetic workload's): the static peak is
the smallest fixed size that meets the target, found by bisection between 1 and
``--max-instances`` (fixed-size runs); then each policy runs from that size with
``--min-instances`` to ``--max-instances``. The SLO is the planning example's (TTFT <= 2000 ms,
TPOT <= 50 ms); the target is 99%, or one point under the workload's ceiling (the attainment of
every request's ideal TTFT, ``simulation.settings.ideal_ttfts``) where that is lower. Reported per
policy: attainment, GPU-hours (every engine from its scale decision to its release), peak
replicas, number of changes; and the static peak's. Two hindsight references: ``oracle`` (a
per-minute fixed pool, each minute simulated alone after a minute of warm-up) and ``two_level``
(periodic days: the cheapest pair of one count for every lull and one for every burst, each
pair simulated over the whole day, caches included). The engines have no CPU tier unless
``--cpu-tier-gib`` gives one (``deploy/serve-gpu.yaml`` ships 160 GiB, ``wa``); ``--pool-gib``
gives the cluster a KV pool of that size, whatever its engine count (``engines.sim.pool``).

Prints JSON on stdout (and to ``--out``).

Usage: .venv/bin/python benchmarks/autoscale_suite.py [--quick] [--seeds 3] [--jobs 2]
           [--workloads conversation,to-b] [--policies kvroute,throughput,...] [--out F.json]
           [--cpu-tier-gib 160 [--cpu-policy wa]]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.autoscale_runs import (
    BURST_FROM_S,
    HIGH,
    INTERVAL_S,
    LOW,
    PERIOD_S,
    PERIODIC,
    SLO_TPOT_S,
    SLO_TTFT_S,
    WORKLOADS,
    ceiling_and_target,
    ideal_ttfts_of,
    make_plan,
    one_run,
    sim_settings,
)
from benchmarks.common import NonNegative, print_json
from engines.config import CpuTierConfig
from engines.profile import LatencyProfile
from loadgen.workloads import Planned
from router.autoscale import SchedulePolicy
from simulation.cluster import simulate
from simulation.jobs import DEFAULT_JOBS, run_each
from simulation.options import POOL_FLAGS, add_pool_arguments
from simulation.settings import SimSettings

# the peers; ``ray_default`` is swept (RAY_SWEEP) and reported at its best setting
POLICIES = ("kvroute", "throughput", "ray_default")
RAY_SWEEP = (
    "ray_default",
    "ray_default@target_ongoing_requests=8+downscale_delay_s=600",
    "ray_default@target_ongoing_requests=2+downscale_delay_s=60",
    "ray_default@target_ongoing_requests=8+downscale_delay_s=60",
)
ORACLE_INTERVAL_S, ORACLE_WARM_S, ORACLE_GOAL, ORACLE_REPAIRS = 60.0, 60.0, 0.99, 4


def static_peak(
    plan: list, block: int, truth: LatencyProfile, seed: int, target: float, hi: int,
    since: float, engine: dict[str, Any] | None = None,
) -> tuple[int, dict[str, Any]]:  # fmt: skip
    """The smallest fixed size meeting ``target`` (bisection on 1..hi; hi if none does)."""
    lo_n, hi_n = 1, hi
    runs: dict[int, dict[str, Any]] = {}
    while lo_n < hi_n:
        mid = (lo_n + hi_n) // 2
        runs[mid] = r = one_run(
            plan, block, truth, seed, mid, None, hi, 1, target, since, engine=engine
        )
        if r["attainment"] >= target:
            hi_n = mid
        else:
            lo_n = mid + 1
    if hi_n not in runs:
        runs[hi_n] = one_run(
            plan, block, truth, seed, hi_n, None, hi, 1, target, since, engine=engine
        )
    return hi_n, runs[hi_n]


def oracle_schedule(
    plan: list, block: int, truth: LatencyProfile, seed: int, hi: int,
    engine: dict[str, Any] | None = None,
) -> list[tuple[float, int]]:  # fmt: skip
    """The hindsight oracle's schedule, an approximation: per ``ORACLE_INTERVAL_S`` of the
    day, the smallest fixed pool (bisection on 1..hi) under which ``ORACLE_GOAL`` of that
    interval's attainable requests (``ideal_ttfts`` within the TTFT SLO) meet the SLO, each
    interval simulated alone on the engines' truth (this seed's speeds), preceded by
    ``ORACLE_WARM_S`` of the day's earlier requests (caches and queues warm, unscored).
    Intervals are sized independently: the queue an interval inherits is the one its own
    warm-up builds at its size, not the one the previous interval's size left."""
    end = plan[-1].offset_s
    sched: list[tuple[float, int]] = []
    k = 0
    while k * ORACLE_INTERVAL_S <= end:
        t0 = k * ORACLE_INTERVAL_S
        t1 = t0 + ORACLE_INTERVAL_S
        window = [p for p in plan if t0 - ORACLE_WARM_S <= p.offset_s < t1]
        k += 1
        if not [p for p in window if p.offset_s >= t0]:
            sched.append((t0, 1))
            continue
        base = window[0].offset_s
        sub = [Planned(j, p.offset_s - base, p.req) for j, p in enumerate(window)]
        ideal = ideal_ttfts_of(sub, block, truth)
        count = [j for j, p in enumerate(window) if p.offset_s >= t0 and ideal[j] <= SLO_TTFT_S]

        def ok(n: int, sub: list = sub, count: list = count) -> bool:
            settings = sim_settings(n, seed, engine)
            settings.what_if = False
            recs = simulate(sub, block, truth, "kv_ttft", settings).records
            want = set(count)
            good = sum(
                1
                for r in recs
                if r.index in want and r.ok and r.ttft_s <= SLO_TTFT_S
                and (math.isnan(r.tpot_s) or r.tpot_s <= SLO_TPOT_S)
            )  # fmt: skip
            return good >= ORACLE_GOAL * len(want)

        lo_n, hi_n = 1, hi
        while lo_n < hi_n:
            mid = (lo_n + hi_n) // 2
            if ok(mid):
                hi_n = mid
            else:
                lo_n = mid + 1
        sched.append((t0, hi_n))
    return sched


def oracle_run(
    plan: list, block: int, truth: LatencyProfile, seed: int, target: float, hi: int,
    since: float, engine: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The oracle's schedule replayed (engines decided a cold start ahead, billed from the
    decision). Where the replay misses ``target``, the minutes in which under
    ``ORACLE_GOAL`` of the attainable requests met the SLO get a tenth more engines (at least
    one), the minute before them too (its queue is theirs), and the day is replayed again,
    at most ``ORACLE_REPAIRS`` times (the repairs, in ``repairs``)."""
    sched = oracle_schedule(plan, block, truth, seed, hi, engine)
    ideal = ideal_ttfts_of(plan, block, truth)
    cold = SimSettings().cold_start_s
    counts = [n for _, n in sched]
    r: dict[str, Any] = {}
    for repair in range(ORACLE_REPAIRS + 1):
        steps = [(t, min(hi, n)) for (t, _), n in zip(sched, counts, strict=True)]
        policy = SchedulePolicy(steps, lead_s=cold)
        r, recs = one_run(
            plan, block, truth, seed, steps[0][1], policy, hi, 1, target, since, records=True,
            engine=engine,
        )  # fmt: skip
        r["repairs"] = repair
        if r["attainment"] >= target or repair == ORACLE_REPAIRS:
            break
        good = [0] * len(counts)
        total = [0] * len(counts)
        for rec in recs:
            if not ideal[rec.index] <= SLO_TTFT_S:
                continue
            k = min(len(counts) - 1, int(rec.intended_s // ORACLE_INTERVAL_S))
            total[k] += 1
            good[k] += rec.meets(SLO_TTFT_S, SLO_TPOT_S)
        bad = [k for k in range(len(counts)) if total[k] and good[k] < ORACLE_GOAL * total[k]]
        for j in sorted({j for b in bad for j in (b - 1, b) if j >= 0}):
            counts[j] = min(hi, counts[j] + max(1, math.ceil(counts[j] / 10)))
    r["schedule"] = [n for _, n in sched]
    r["repaired_schedule"] = counts
    return r


def two_level_schedule(end_s: float, lull: int, burst: int) -> list[tuple[float, int]]:
    """A burst-and-lull day's steps: ``lull`` engines in every lull, ``burst`` in every burst."""
    steps: list[tuple[float, int]] = []
    k = 0
    while k * PERIOD_S <= end_s:
        steps += [(k * PERIOD_S, lull), (k * PERIOD_S + BURST_FROM_S, burst)]
        k += 1
    return steps


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``"9/14,10/12"`` as ``[(9, 14), (10, 12)]``: engine counts >= 1, burst >= lull."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        lull, sep, burst = item.partition("/")
        if not sep or not lull.isdigit() or not burst.isdigit():
            raise ValueError(f"{item!r} is not LULL/BURST (two whole numbers)")
        pair = int(lull), int(burst)
        if not 1 <= pair[0] <= pair[1]:
            raise ValueError(f"{item!r}: need 1 <= LULL <= BURST")
        out.append(pair)
    if not out:
        raise ValueError("give at least one LULL/BURST pair")
    return out


def two_level_run(
    plan: list, block: int, truth: LatencyProfile, seed: int, target: float, hi: int,
    since: float, peak: int, static_gpu_hours: float, engine: dict[str, Any] | None = None,
    pairs: list[tuple[int, int]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The cheapest two-level schedule meeting ``target`` on a burst-and-lull day, with
    hindsight: ``lull`` engines through every lull, ``burst`` through every burst (decided a
    cold start ahead, billed from the decision, as ``SchedulePolicy`` does). Per lull count
    from 1 to the static ``peak``, the smallest burst count from the lull's to ``hi`` that
    meets the target (bisection, under the last lull's), until a lull held all day (priced
    as its share of the static peak's ``static_gpu_hours``) costs more than the cheapest pair
    found; the cheapest pair that does, else the best attainment. A
    lower bound on what a policy that knows the cycle can cost, within this family (what
    ``oracle`` approximates per minute with fresh caches, this keeps every cache a day
    builds); ``tried`` lists each ``[lull, burst, attainment, GPU-h]`` run. Given ``pairs``
    it runs those instead of searching."""
    cold = SimSettings().cold_start_s
    end = plan[-1].offset_s
    tried: dict[tuple[int, int], dict[str, Any]] = {}

    def run(lull: int, burst: int) -> dict[str, Any]:
        if (lull, burst) not in tried:
            policy = SchedulePolicy(two_level_schedule(end, lull, burst), lead_s=cold)
            tried[lull, burst] = one_run(
                plan, block, truth, seed, lull, policy, hi, 1, target, since, engine=engine
            )
        return tried[lull, burst]

    for lull, burst in pairs or ():
        run(lull, burst)
    top, best_gpu = hi, math.inf
    for lull in range(1, 0 if pairs else peak + 1):
        # more engines in the lull need no more in the burst; and no burst makes a day
        # cheaper than its lull count held all day, so the search stops there
        if lull / peak * static_gpu_hours >= best_gpu:
            break
        lo_b, hi_b = lull, top
        if run(lull, hi_b)["attainment"] < target:
            continue
        while lo_b < hi_b:
            mid = (lo_b + hi_b) // 2
            if run(lull, mid)["attainment"] >= target:
                hi_b = mid
            else:
                lo_b = mid + 1
        top, best_gpu = hi_b, min(best_gpu, run(lull, hi_b)["gpu_hours"])
    meets = [k for k, r in tried.items() if r["attainment"] >= target]
    best = (
        min(meets, key=lambda k: tried[k]["gpu_hours"])
        if meets
        else max(tried, key=lambda k: tried[k]["attainment"])
    )
    return {
        **tried[best],
        "lull": best[0],
        "burst": best[1],
        "tried": [[*k, r["attainment"], r["gpu_hours"]] for k, r in sorted(tried.items())],
    }


def engine_options(args: argparse.Namespace, truth: LatencyProfile, block: int) -> dict[str, Any]:
    """The cluster's options (``sim_settings``): a CPU tier of ``--cpu-tier-gib`` in blocks of
    ``block`` tokens of ``truth``'s KV (``--cpu-policy``), and the pool of ``--pool-gib``."""
    out: dict[str, Any] = {k: getattr(args, k) for k in POOL_FLAGS} if args.pool_gib else {}
    tier = args.cpu_tier
    if tier is not None:
        out["cpu_capacity_blocks"] = tier.capacity_blocks(block, truth.kv_bytes_per_token)
        out["cpu_policy"] = tier.policy
    return out


def cell(
    workload: str, seed: int, args: argparse.Namespace, truth: LatencyProfile
) -> dict[str, Any]:
    plan, block = make_plan(workload, seed, args.rate_scale, args.duration)
    period = PERIOD_S if workload in PERIODIC else 0.0
    since = period  # scored after the first cycle (the whole day is reported too)
    ceiling, target = ceiling_and_target(plan, ideal_ttfts_of(plan, block, truth), since)
    hi = args.max_instances
    engine = engine_options(args, truth, block)
    peak, static = static_peak(plan, block, truth, seed, target, hi, since, engine)
    out: dict[str, Any] = {
        "requests": len(plan),
        "span_s": round(plan[-1].offset_s, 1),
        "scored_from_s": since,
        "ceiling": round(ceiling, 4),
        "target": round(target, 4),
        "static_peak": {"instances": peak, **static},
    }
    for spec in args.policies:
        if spec == "ray_default":  # swept: the cheapest setting meeting the target, else best
            lo = args.min_instances
            runs = {
                s: one_run(plan, block, truth, seed, peak, s, hi, lo, target, since, engine=engine)
                for s in RAY_SWEEP
            }
            meet = [s for s, r in runs.items() if r["attainment"] >= target]
            best = (
                min(meet, key=lambda s: runs[s]["gpu_hours"])
                if meet
                else max(runs, key=lambda s: runs[s]["attainment"])
            )
            r = {**runs[best], "setting": best}
            r["sweep"] = {s: [x["attainment"], x["gpu_hours"]] for s, x in runs.items()}
        elif spec in ("kvroute_warm", "kvroute_handover", "kvroute_cached"):
            # kvroute, its new engines warmed before they serve, or its leaving ones' prompts
            # handed over to the survivors, or its what-ifs' engines holding what the sampled
            # requests found cached
            warm = args.warm_prefixes if spec == "kvroute_warm" else 0
            handover = args.handover_prefixes if spec == "kvroute_handover" else 0
            r = one_run(
                plan, block, truth, seed, peak, "kvroute", hi, args.min_instances, target, since,
                period, warm=warm, handover=handover, engine=engine,
                what_if_cached=spec == "kvroute_cached",
            )  # fmt: skip
        elif spec == "two_level":
            if workload not in PERIODIC:
                continue
            r = two_level_run(
                plan, block, truth, seed, target, hi, since, peak, static["gpu_hours"], engine,
                args.two_level_pairs,
            )  # fmt: skip
        elif spec == "oracle":
            r = oracle_run(plan, block, truth, seed, target, hi, since, engine)
        else:
            r = one_run(
                plan, block, truth, seed, peak, spec, hi, args.min_instances, target, since, period,
                engine=engine,
            )  # fmt: skip
        out[spec] = r
        r["meets"] = r["attainment"] >= target
        r["gpu_vs_static"] = round(r["gpu_hours"] / static["gpu_hours"], 3)
    return out


def summary(
    workloads: list[str], seeds: list[int], cells: list[dict[str, Any]], policies: list[str]
) -> dict[str, Any]:
    """Per workload and policy: attainment, GPU-hours and direction changes per hour (with the
    most in any hour and the reversals within a cold start, ``simulation.measures.flapping``)
    as mean [min, max] over the seeds, and kvroute's goals (issue 33) per seed: meets the
    target, GPU-hours <= 1.15x the oracle's, <= 0.6x the static peak's, >= 20% under
    ray_default's (at its best setting) with equal or better attainment."""
    out: dict[str, Any] = {}
    it = iter(cells)
    for w in workloads:
        rows = [next(it) for _ in seeds]
        agg: dict[str, Any] = {}
        for name in ("static_peak", *policies):
            att = [c[name]["attainment"] for c in rows if name in c]
            gpu = [c[name]["gpu_hours"] for c in rows if name in c]
            if att:
                agg[name] = {
                    "attainment": [round(sum(att) / len(att), 4), min(att), max(att)],
                    "gpu_hours": [round(sum(gpu) / len(gpu), 3), min(gpu), max(gpu)],
                }
            flaps = [c[name]["flapping"] for c in rows if "flapping" in c.get(name, {})]
            for key in ("per_hour", "max_in_an_hour", "quick_reversals"):
                xs = [f[key] for f in flaps]
                if xs:
                    agg[name][f"flapping_{key}"] = [round(sum(xs) / len(xs), 2), min(xs), max(xs)]
        goals = []
        for c in rows:
            k = c.get("kvroute")
            if k is None:
                continue
            g: dict[str, Any] = {"meets": k["meets"], "vs_static": k["gpu_vs_static"]}
            if "oracle" in c:
                g["vs_oracle"] = round(k["gpu_hours"] / c["oracle"]["gpu_hours"], 3)
            if "two_level" in c:
                g["vs_two_level"] = round(k["gpu_hours"] / c["two_level"]["gpu_hours"], 3)
            if "ray_default" in c:
                ray = c["ray_default"]
                g["vs_ray_default"] = round(k["gpu_hours"] / ray["gpu_hours"], 3)
                g["ray_default_attainment"] = ray["attainment"]
            g["all_goals"] = bool(
                k["meets"]
                and g["vs_static"] <= 0.6
                and g.get("vs_oracle", 0) <= 1.15
                and g.get("vs_ray_default", 0) <= 0.8
            )
            goals.append(g)
        out[w] = {"policies": agg, "kvroute_goals_per_seed": goals}
    return out


def _parser() -> argparse.ArgumentParser:
    """The suite's command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="conversation only, seed 0")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument(
        "--policies",
        default=",".join((*POLICIES, "oracle")),
        help="specs, separated by ',' (';' when a spec has commas); ray_default is swept, "
        "oracle is the hindsight oracle, two_level the cheapest hindsight schedule of one "
        "count per lull and one per burst (periodic days only), kvroute_warm is kvroute with "
        "warming (--warm-prefixes), kvroute_handover with hand-over on scale-down "
        "(--handover-prefixes), kvroute_cached with what-ifs whose engines hold what each "
        "request found cached",
    )
    ap.add_argument(
        "--rate-scale",
        type=float,
        default=2.0,
        help="conversation's rate scale; azure-conv's is twice it [2]",
    )
    ap.add_argument("--duration", type=float, default=1800.0, help="synthetic seconds [1800]")
    ap.add_argument(
        "--warm-prefixes",
        type=int,
        default=8,
        help="kvroute_warm: hot prefixes a new engine prefills before it serves [8]",
    )
    ap.add_argument(
        "--handover-prefixes",
        type=int,
        default=16,
        help="kvroute_handover: a leaving engine's longest recent prompts prefilled on the "
        "survivors [16]",
    )
    ap.add_argument(
        "--cpu-tier-gib",
        type=float,
        action=NonNegative,
        default=0.0,
        help="each engine's CPU KV tier in GiB (0: none; deploy/serve-gpu.yaml ships 160) [0]",
    )
    ap.add_argument("--cpu-policy", default="wa", help="the CPU tier's eviction policy [wa]")
    add_pool_arguments(ap.add_argument_group("the cluster KV pool (engines.sim.pool)"))
    ap.add_argument(
        "--two-level-pairs",
        metavar="LULL/BURST,...",
        help="two_level: run these (lull, burst) engine counts instead of searching",
    )
    ap.add_argument("--min-instances", type=int, default=1)
    ap.add_argument("--max-instances", type=int, default=48)
    ap.add_argument("--jobs", type=int, default=DEFAULT_JOBS)
    ap.add_argument("--out")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    args.policies = [p for p in args.policies.split(";" if ";" in args.policies else ",") if p]
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"--workloads: unknown {w!r}; valid: {', '.join(WORKLOADS)}")
    if PERIODIC.intersection(workloads) and not args.duration > PERIOD_S:
        ap.error(
            f"--duration must be > {PERIOD_S:g} (a first cycle to train on), got {args.duration:g}"
        )
    try:
        args.cpu_tier = (
            CpuTierConfig(gib=args.cpu_tier_gib, policy=args.cpu_policy)
            if args.cpu_tier_gib
            else None
        )
    except ValidationError as e:
        ap.error(f"--cpu-policy: {e.errors()[0]['msg'].removeprefix('Value error, ')}")
    try:
        args.two_level_pairs = parse_pairs(args.two_level_pairs) if args.two_level_pairs else None
    except ValueError as e:
        ap.error(f"--two-level-pairs: {e}")
    seeds = [0] if args.quick else list(range(args.seeds))
    if args.quick:
        workloads = workloads[:1]
    truth = LatencyProfile.load("h100-llama3.1-8b")
    keys = [(w, s) for w in workloads for s in seeds]
    t0 = time.perf_counter()
    cells = run_each([partial(cell, w, s, args, truth) for w, s in keys], args.jobs)
    doc: dict[str, Any] = {
        "meta": {
            "slo_ttft_ms": SLO_TTFT_S * 1e3,
            "slo_tpot_ms": SLO_TPOT_S * 1e3,
            "burst_and_lull": {"period_s": PERIOD_S, "low": LOW, "high": HIGH},
            "interval_s": INTERVAL_S,
            "cold_start_s": SimSettings().cold_start_s,
            "policies": args.policies,
            "router": "kv_ttft",
            "profile": truth.name,
            "cpu_tier": args.cpu_tier and args.cpu_tier.model_dump(include={"gib", "policy"}),
            "pool": {k: getattr(args, k) for k in POOL_FLAGS} if args.pool_gib else None,
            "wall_s": round(time.perf_counter() - t0, 1),
        },
        "results": {f"{w}/seed{s}": c for (w, s), c in zip(keys, cells, strict=True)},
        "summary": summary(workloads, seeds, cells, args.policies),
    }
    print_json(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
