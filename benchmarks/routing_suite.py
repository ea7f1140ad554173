"""The routing suite: every router on workloads it was never tuned on, at loads set by a rule.

Workloads (``WORKLOADS``, in ``benchmarks/routing_workloads.py``): the shared Mooncake
conversation trace (``conversation``), the synthetic ``to-b``, ``mix``, ``agentic`` and ``rag``
(``loadgen.synthetic``), and the Azure LLM inference 2023 conversation trace (``azure-conv``, its
prefixes drawn by ``loadgen.traces.PrefixModel``). Any trace file ``kvroute simulate --trace``
reads (Mooncake or Bailian JSONL, Azure or BurstGPT CSV) is a workload too, named by its path in
``--workloads``: the suite's loads, seeds and table apply to it unchanged. Each run is the first
``--requests`` requests of the workload (a trace's first requests, its gaps divided by the rate
scale; a synthetic workload generated at ``SYNTH_BASE_RATE`` times the rate scale for as long as
that many requests take).

Loads, by rule, per workload: L1 is the rate scale at which round_robin's TTFT p50 is twice its
idle p50 (the p50 at rate scale ``IDLE_SCALE``), found by bisection in log scale on
``--bisect-requests`` requests with seed 0 (bracketed by doubling or halving from 1, then
``--bisect-steps`` halvings of the bracket; L1 is the geometric middle of the last bracket); L2
is 1.5 times L1. The chosen loads go into the output (``loads``); ``--loads FILE`` reuses a
previous output's instead of searching again (workloads missing there are searched).

Per workload x load x router, over ``--seeds`` seeds (seed k: the simulator's perturbation seed
and the workload's seed; a trace's requests are the same for every seed, the Azure trace's
prefix model is drawn anew): TTFT p50 and p99, the excess TTFT over each request's ideal
(``simulation.settings.ideal_ttfts``) mean and p99, TPOT p99, hit rate (over prompt tokens),
goodput (requests meeting TTFT <= 2000 ms and TPOT <= 50 ms per second of the window's arrival
span: the offered rate times the SLO attainment, so routers are compared on one time base) and the
per-engine request spread (max over min requests per engine; None when an engine got none), each
as its mean, min and max over seeds. 16 instances of ``h100-llama3.1-8b`` unless told otherwise.

NOTE: goodput over each run's own span (first arrival to last completion, ``summarize``'s
``goodput_rps``, kept as ``makespan_goodput_rps``) is not used: where a window's arrivals last a
few virtual seconds, that span is mostly the decode of its last long answers, so the figure
ranks routers by where one long answer went (a router that kept every request within both SLOs
could read 10% below another that did the same).

NOTE: a run is a window of ``--requests`` requests, not a steady state: where 16 engines serve
hundreds of requests a second (to-b, mix, azure-conv at L1), the window's arrivals last only a
few virtual seconds (``meta.arrival_span_s``), and the loads measure how a router absorbs such
a burst. Longer windows (``--requests``) cost wall time in proportion.

Prints the JSON on stdout (and to ``--out``) and the table on stderr.

Usage: .venv/bin/python benchmarks/routing_suite.py [--quick] [--jobs 2] [--out FILE.json]
           [--loads FILE.json] [--workloads A,B] [--routers A,B] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks.common import print_json
from benchmarks.routing_table import table
from benchmarks.routing_workloads import SYNTH_BASE_RATE, WORKLOADS, make_plan, parse_workloads
from engines.profile import LatencyProfile
from loadgen.metrics import summarize
from loadgen.workloads import Planned, ideal_hit_rate
from router.placement import parse_options, scorer_names
from router.settings import DEFAULTS
from simulation.cluster import simulate
from simulation.jobs import DEFAULT_JOBS, run_each
from simulation.measures import excess_ttfts
from simulation.options import POOL_FLAGS, add_pool_arguments, parse_router, parse_routers
from simulation.settings import Perturbation, SimSettings, ideal_ttfts
from simulation.tenants import check_tenants, isolate

SIM = SimSettings()  # the simulator's defaults, which the suite's runs keep

IDLE_SCALE = 0.05  # the rate scale whose round_robin p50 is the idle p50
MAX_SCALE = 256.0  # the search gives up above this rate scale (``capped`` in its output)
L2_OVER_L1 = 1.5
SLO_TTFT_MS, SLO_TPOT_MS = 2000.0, 50.0
# requests per run and per bisection probe, bisection halvings: (default, --quick)
REQUESTS = (800, 200)
BISECT_REQUESTS = (300, 150)
BISECT_STEPS = (4, 3)
METRICS: tuple[str, ...] = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "excess_mean_ms",
    "excess_p99_ms",
    "tpot_p99_ms",
    "hit_rate",
    "goodput_rps",
    "makespan_goodput_rps",
    "spread",
)

# a run of the suite: (workload, load, seed, plan, block size, each request's ideal TTFT)
Cell = tuple[str, str, int, list[Planned], int, list[float]]


def _with_tier(
    engine: dict[str, Any] | None, gib: float, block: int, truth: LatencyProfile
) -> dict[str, Any]:
    """``engine`` with a CPU tier of ``gib`` GiB in ``block``-token blocks (0: as it is)."""
    if not gib:
        return dict(engine or {})
    blocks = max(int(gib * (1 << 30)) // (block * truth.kv_bytes_per_token), 1)
    return {**(engine or {}), "cpu_capacity_blocks": blocks}


def settings_for(
    seed: int,
    instances: int,
    inflight_prompts: bool = DEFAULTS.inflight_prompts,
    engine: dict[str, Any] | None = None,
    pool: dict[str, Any] | None = None,
    router_replicas: int = SIM.router_replicas,
    share_assignments: bool = SIM.share_assignments,
    load_interval_s: float = SIM.load_interval_s,
) -> SimSettings:
    """``pool``: the ``SimSettings`` pool fields (``simulation.options.POOL_FLAGS``)."""
    return SimSettings(
        instances=instances,
        load_interval_s=load_interval_s,
        perturbation=Perturbation(seed=seed),
        inflight_prompts=inflight_prompts,
        engine=dict(engine or {}),
        router_replicas=router_replicas,
        share_assignments=share_assignments,
        **(pool or {}),
    )


def measure(
    plan: list[Planned],
    block: int,
    truth: LatencyProfile,
    router: str,
    settings: SimSettings,
    ideal_s: list[float],
) -> dict[str, Any]:
    """One router on one plan (``router``: a scorer name, or ``NAME@key=value+...`` as
    ``kvroute simulate --router`` takes it): the suite's metrics."""
    name, options = parse_router(router)
    sim = simulate(plan, block, truth, name, settings, scorer_options=options)
    span = plan[-1].offset_s - plan[0].offset_s if len(plan) > 1 else 0.0
    s = summarize(
        sim.records,
        duration_s=sim.span_s,
        requested_span_s=span,
        slo_ttft_ms=SLO_TTFT_MS,
        slo_itl_ms=SLO_TPOT_MS,
        ideal_hit_rate=ideal_hit_rate((p.req for p in plan), block),
    )
    excess = np.asarray(excess_ttfts(sim.records, ideal_s)) * 1e3
    per = Counter(r.instance for r in sim.records if r.instance is not None)
    counts = [per.get(f"sim-{i}", 0) for i in range(settings.instances)]
    return {
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "ttft_p99_ms": s["ttft_ms"]["p99"],
        "excess_mean_ms": round(float(excess.mean()), 3) if excess.size else None,
        "excess_p99_ms": round(float(np.percentile(excess, 99)), 3) if excess.size else None,
        "tpot_p99_ms": s["tpot_ms"]["p99"],
        "hit_rate": s["server_hit_rate"],
        "goodput_rps": s["good_requests"] / span if span > 0 else None,
        "makespan_goodput_rps": s["goodput_rps"],
        "spread": round(max(counts) / min(counts), 3) if min(counts) > 0 else None,
        "completed": s["completed"],
        "wall_s": round(sim.wall_s, 2),
    }


def rr_p50_ms(workload: str, scale: float, requests: int, truth: LatencyProfile, n: int) -> float:
    plan, block = make_plan(workload, scale, 0, requests)
    sim = simulate(plan, block, truth, "round_robin", settings_for(0, n))
    ttft = [r.ttft_s for r in sim.records if r.ok]
    return float(np.percentile(ttft, 50)) * 1e3 if ttft else math.inf


def find_l1(
    workload: str, requests: int, steps: int, truth: LatencyProfile, instances: int
) -> dict[str, Any]:
    """The rate scale where round_robin's TTFT p50 is twice its idle p50 (see the module)."""
    t0 = time.perf_counter()
    idle = rr_p50_ms(workload, IDLE_SCALE, requests, truth, instances)
    target = 2 * idle
    probes: list[tuple[float, float]] = []

    def above(scale: float) -> bool:
        p50 = rr_p50_ms(workload, scale, requests, truth, instances)
        probes.append((round(scale, 4), round(p50, 2)))
        return p50 > target

    lo, hi, capped = 1.0, 1.0, False
    if above(1.0):
        while lo > 2 * IDLE_SCALE:
            lo /= 2
            if not above(lo):
                break
            hi = lo
    else:
        while True:
            hi *= 2
            if above(hi):
                break
            lo = hi
            if hi >= MAX_SCALE:
                capped = True
                break
    for _ in range(0 if capped else steps):
        mid = math.sqrt(lo * hi)
        if above(mid):
            hi = mid
        else:
            lo = mid
    l1 = math.sqrt(lo * hi)
    return {
        "idle_p50_ms": round(idle, 2),
        "idle_scale": IDLE_SCALE,
        "l1_scale": round(l1, 4),
        "l2_scale": round(l1 * L2_OVER_L1, 4),
        "bracket": [round(lo, 4), round(hi, 4)],
        "capped": capped,
        "probes": probes,
        "probe_requests": requests,
        "search_wall_s": round(time.perf_counter() - t0, 1),
    }


def _spread_stats(values: list[Any]) -> dict[str, Any]:
    got = [v for v in values if v is not None]
    if not got:
        return {"mean": None, "min": None, "max": None, "seeds": values}
    return {
        "mean": round(float(np.mean(got)), 4),
        "min": min(got),
        "max": max(got),
        "seeds": values,
    }


def _loads(
    workloads: list[str],
    loads: dict[str, Any] | None,
    requests: int,
    steps: int,
    truth: LatencyProfile,
    instances: int,
    jobs: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Each workload's loads: a previous output's (``loads``) where it has them, else found by
    the rule (``find_l1`` on ``requests`` requests a probe), ``jobs`` searches at a time."""
    chosen = {w: v for w, v in (loads or {}).items() if w in workloads}
    todo = [w for w in workloads if w not in chosen]
    if todo:
        log(f"routing suite: searching L1 for {', '.join(todo)} ({requests} requests a probe)")
        found = run_each(
            [partial(find_l1, w, requests, steps, truth, instances) for w in todo], jobs
        )
        chosen.update(zip(todo, found, strict=True))
    return chosen


def _plans(
    workloads: list[str],
    loads: dict[str, Any],
    seeds: int,
    requests: int,
    tenants: int,
    truth: LatencyProfile,
    instances: int,
) -> tuple[list[Cell], dict[str, dict[str, list[float]]]]:
    """Every run's plan, per workload x load x seed (split into ``tenants`` isolated tenants),
    and per workload and load the virtual seconds from each run's first to its last arrival."""
    cells: list[Cell] = []
    spans: dict[str, dict[str, list[float]]] = {}
    for w in workloads:
        for load, key in (("L1", "l1_scale"), ("L2", "l2_scale")):
            for seed in range(seeds):
                plan, block = make_plan(w, loads[w][key], seed, requests)
                plan = isolate(plan, tenants, seed)
                span = plan[-1].offset_s - plan[0].offset_s if plan else 0.0
                spans.setdefault(w, {}).setdefault(load, []).append(round(span, 2))
                ideal = ideal_ttfts(plan, block, truth, settings_for(seed, instances))
                cells.append((w, load, seed, plan, block, ideal))
    return cells, spans


def _results(cells: list[Cell], routers: list[str], out: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs' metrics (``out``: per cell, a run per router) as a row per workload, load and
    router: each metric's spread over the seeds, the completed requests and the wall time."""
    results: dict[str, Any] = {}
    it = iter(out)
    raw: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for w, load, _seed, _p, _b, _i in cells:
        for r in routers:
            raw.setdefault((w, load, r), []).append(next(it))
    for (w, load, r), runs in raw.items():
        row: dict[str, Any] = {m: _spread_stats([x[m] for x in runs]) for m in METRICS}
        row["completed"] = [x["completed"] for x in runs]
        row["wall_s"] = round(sum(x["wall_s"] for x in runs), 2)
        results.setdefault(w, {}).setdefault(load, {})[r] = row
    return results


def run_suite(
    workloads: list[str],
    routers: list[str],
    seeds: int,
    quick: bool,
    jobs: int,
    loads: dict[str, Any] | None = None,
    requests: int | None = None,
    bisect_requests: int | None = None,
    bisect_steps: int | None = None,
    instances: int = 16,
    profile: str = "h100-llama3.1-8b",
    log: Callable[[str], None] = lambda _m: None,
    inflight_prompts: bool = DEFAULTS.inflight_prompts,
    engine: dict[str, Any] | None = None,
    tenants: int = 0,
    pool: dict[str, Any] | None = None,
    cpu_tier_gib: float = 0.0,
    router_replicas: int = SIM.router_replicas,
    share_assignments: bool = SIM.share_assignments,
    load_interval_s: float = SIM.load_interval_s,
) -> dict[str, Any]:
    """The suite's JSON document (see the module); ``engine``: sim engine options for the
    routers' runs (``kvroute simulate --engine``'s); ``tenants``: their workloads split into
    that many isolated tenants (``kvroute simulate --tenants``; the loads are found without);
    ``pool``: the routers' runs share a cluster KV pool (``SimSettings``' pool fields; the
    loads are found without); ``cpu_tier_gib``: each engine has a CPU tier of that size (in
    blocks of the workload's size; 0: none)."""
    q = int(quick)
    n = requests or REQUESTS[q]
    nb = bisect_requests or BISECT_REQUESTS[q]
    steps = BISECT_STEPS[q] if bisect_steps is None else bisect_steps
    truth = LatencyProfile.load(profile)
    t0 = time.perf_counter()
    chosen = _loads(workloads, loads, nb, steps, truth, instances, jobs, log)
    search_s = time.perf_counter() - t0
    cells, spans = _plans(workloads, chosen, seeds, n, tenants, truth, instances)
    calls = [
        partial(
            measure,
            plan,
            block,
            truth,
            r,
            settings_for(
                seed,
                instances,
                inflight_prompts,
                _with_tier(engine, cpu_tier_gib, block, truth),
                pool,
                router_replicas,
                share_assignments,
                load_interval_s,
            ),
            ideal,
        )
        for (_w, _l, seed, plan, block, ideal) in cells
        for r in routers
    ]
    log(f"routing suite: {len(calls)} simulations of {n} requests, {jobs} at a time")
    t1 = time.perf_counter()
    results = _results(cells, routers, run_each(calls, jobs))
    meta_tenants = {"tenants": tenants} if tenants > 1 else {}
    return {
        "meta": {
            **meta_tenants,
            **({"pool": dict(pool)} if pool else {}),
            **({"cpu_tier_gib": cpu_tier_gib} if cpu_tier_gib else {}),
            **(
                {"router_replicas": router_replicas, "share_assignments": share_assignments}
                if router_replicas > 1
                else {}
            ),
            "instances": instances,
            "inflight_prompts": inflight_prompts,
            "engine": dict(engine or {}),
            "profile": profile,
            "routers": routers,
            "seeds": seeds,
            "requests_per_run": n,
            "quick": quick,
            "jobs": jobs,
            "slo_ttft_ms": SLO_TTFT_MS,
            "slo_tpot_ms": SLO_TPOT_MS,
            "synth_base_rate": SYNTH_BASE_RATE,
            "l2_over_l1": L2_OVER_L1,
            "arrival_span_s": spans,
            "search_wall_s": round(search_s, 1),
            "runs_wall_s": round(time.perf_counter() - t1, 1),
            "wall_s": round(time.perf_counter() - t0, 1),
        },
        "loads": chosen,
        "results": results,
    }


def _parser() -> argparse.ArgumentParser:
    """The suite's command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="comma-separated suite workloads or trace files (.jsonl, .csv) [all]",
    )
    ap.add_argument(
        "--routers",
        default=",".join(scorer_names()),
        help="comma-separated scorers, each NAME or NAME@key=value+... [all]",
    )
    ap.add_argument("--seeds", type=int, default=3, help="seeds per cell [3]")
    ap.add_argument("--quick", action="store_true", help="shorter runs and searches")
    ap.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="parallel processes")
    ap.add_argument("--out", help="write the JSON here too")
    ap.add_argument("--loads", help="reuse the loads of a previous output JSON")
    ap.add_argument(
        "--requests", type=int, help=f"requests per run [{REQUESTS[0]}; quick {REQUESTS[1]}]"
    )
    ap.add_argument(
        "--bisect-requests",
        type=int,
        help=f"requests per L1 probe [{BISECT_REQUESTS[0]}; quick {BISECT_REQUESTS[1]}]",
    )
    ap.add_argument(
        "--bisect-steps",
        type=int,
        help=f"halvings of the L1 bracket [{BISECT_STEPS[0]}; quick {BISECT_STEPS[1]}]",
    )
    ap.add_argument("--instances", type=int, default=16, help="engines [16]")
    ap.add_argument("--profile", default="h100-llama3.1-8b", help="latency profile")
    ap.add_argument(
        "--inflight-prompts",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.inflight_prompts,
        help="routers count the prompts they sent that no KV event shows yet (router.inflight; "
        "on by default)",
    )
    ap.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a sim engine option for the routers' runs, as kvroute simulate --engine takes it "
        "(e.g. queued_until_first_token=false: report what is still to schedule)",
    )
    ap.add_argument(
        "--tenants",
        type=int,
        default=0,
        metavar="K",
        help="split each run's workload into K isolated tenants, as kvroute simulate --tenants "
        "(0 or 1: one shared cache) [0]",
    )
    ap.add_argument(
        "--cpu-tier-gib",
        type=float,
        default=0.0,
        help="each engine's CPU tier, GiB (in blocks of each workload's size) [0: none]",
    )
    ap.add_argument(
        "--router-replicas",
        type=int,
        default=SIM.router_replicas,
        help="router replicas per run, as kvroute simulate --router-replicas "
        f"[{SIM.router_replicas}]",
    )
    ap.add_argument(
        "--share-assignments",
        action=argparse.BooleanOptionalAction,
        default=SIM.share_assignments,
        help="replicas share their assignments, as kvroute simulate --share-assignments "
        f"[{'on' if SIM.share_assignments else 'off'}]",
    )
    ap.add_argument(
        "--load-interval-ms",
        type=float,
        default=SIM.load_interval_s * 1e3,
        help="each engine's load sample interval in the routers' runs, as kvroute simulate "
        f"--load-interval-ms [{SIM.load_interval_s * 1e3:g}]",
    )
    add_pool_arguments(ap.add_argument_group("the cluster KV pool (the routers' runs)"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        workloads = parse_workloads(args.workloads)
        routers = [label for label, _, _ in parse_routers(args.routers)]
        for v, flag in (
            (args.seeds, "--seeds"),
            (args.jobs, "--jobs"),
            (args.instances, "--instances"),
        ):
            if v < 1:
                raise ValueError(f"{flag} must be >= 1, got {v}")
        for v, flag in ((args.requests, "--requests"), (args.bisect_requests, "--bisect-requests")):
            if v is not None and v < 10:
                raise ValueError(f"{flag} must be >= 10, got {v}")
        engine = parse_options(args.engine, "--engine")
        check_tenants(args.tenants)
        if not (args.cpu_tier_gib >= 0 and math.isfinite(args.cpu_tier_gib)):
            raise ValueError(f"--cpu-tier-gib must be a number >= 0, got {args.cpu_tier_gib}")
        pool = {k: getattr(args, k) for k in POOL_FLAGS} if args.pool_gib else {}
        settings_for(
            0, 1, engine=engine, pool=pool, router_replicas=args.router_replicas
        ).validate()
        if args.bisect_steps is not None and args.bisect_steps < 0:
            raise ValueError(f"--bisect-steps must be >= 0, got {args.bisect_steps}")
        loads = None
        if args.loads:
            try:
                loads = json.loads(Path(args.loads).read_text())["loads"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--loads: cannot read loads from {args.loads}: {e}") from None
        if args.out and not Path(args.out).resolve().parent.is_dir():
            raise ValueError(f"--out: directory of {args.out} does not exist")
    except ValueError as e:
        print(f"routing_suite: error: {e}", file=sys.stderr)
        return 2
    doc = run_suite(
        workloads,
        routers,
        args.seeds,
        args.quick,
        args.jobs,
        loads,
        args.requests,
        args.bisect_requests,
        args.bisect_steps,
        instances=args.instances,
        profile=args.profile,
        log=lambda m: print(m, file=sys.stderr, flush=True),
        inflight_prompts=args.inflight_prompts,
        engine=engine,
        tenants=args.tenants,
        pool=pool,
        cpu_tier_gib=args.cpu_tier_gib,
        router_replicas=args.router_replicas,
        share_assignments=args.share_assignments,
        load_interval_s=args.load_interval_ms / 1e3,
    )
    print_json(doc, args.out)
    print(table(doc), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
