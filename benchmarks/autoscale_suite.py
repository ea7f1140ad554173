"""The autoscaling suite (issue 33's figures): each policy of ``router.autoscale`` against
static provisioning at the peak, on burst-and-lull traffic, in the cluster simulator.

Workloads (``WORKLOADS``), each re-timed into a burst-and-lull day (``burst_and_lull``): the
arrival rate follows cycles of ``PERIOD_S`` seconds, a lull at ``LOW`` times the mean base rate
for two thirds of the cycle and a burst at ``HIGH`` times it for the last third; the requests
keep their order and their tokens and prefixes, and only their arrival times are warped (the
inverse of the cumulative rate):

- ``conversation``: the shared Mooncake conversation trace (all 12,031 requests; its mean
  rate, 3.4 req/s, times ``--rate-scale``);
- ``to-b`` and ``mix``: ``loadgen.synthetic``'s workloads at ``SYNTH_RATE`` req/s mean for
  ``--duration`` seconds.

Per workload and seed (the perturbation's and the synthetic workload's): the static peak is
the smallest fixed size that meets the target, found by bisection between 1 and
``--max-instances`` (fixed-size runs); then each policy runs from that size with
``--min-instances`` to ``--max-instances``. The SLO is the planning example's (TTFT <= 2000 ms,
TPOT <= 50 ms); the target is 99%, or one point under the workload's ceiling (the attainment of
every request's ideal TTFT, ``loadgen.simulator.ideal_ttfts``) where that is lower. Reported per
policy: attainment, GPU-hours (every engine from its scale decision to its release), peak
replicas, number of changes; and the static peak's. Not run: the hindsight oracle.

Prints JSON on stdout (and to ``--out``).

Usage: .venv/bin/python benchmarks/autoscale_suite.py [--quick] [--seeds 3] [--jobs 2]
           [--workloads conversation,to-b] [--policies kvroute,throughput,...] [--out F.json]
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines.sim.profile import LatencyProfile
from loadgen.simulate_cmd import DEFAULT_JOBS, slo_attainment
from loadgen.simulator import Perturbation, SimSettings, ideal_ttfts, run_each, simulate
from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate
from loadgen.traces import load_trace
from loadgen.workloads import Planned, build_schedule
from router.autoscale import Autoscaler, Slo, create_policy

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
WORKLOADS = ("conversation", "to-b", "mix")
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.05
PERIOD_S, LOW, HIGH = 600.0, 0.5, 2.0  # a lull at half the mean rate, a burst at twice it
SYNTH_RATE = 20.0
POLICIES = (
    "kvroute",
    "throughput",
    "ray_default",
    "ray_default@target_ongoing_requests=16+downscale_delay_s=120",
)
INTERVAL_S = 10.0


def rate_at(t: float) -> float:
    """The burst-and-lull multiplier of the mean rate at ``t`` (its mean over a cycle is 1)."""
    return LOW if (t % PERIOD_S) < PERIOD_S * 2 / 3 else HIGH


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
    if workload == "conversation":
        trace = load_trace(TRACES / "mooncake_conversation.jsonl")
        plan = build_schedule(trace.requests, time_scale=1.0 / rate_scale)
        return burst_and_lull(plan), trace.block_size
    p = SynthParams(rate=SYNTH_RATE, duration_s=duration, seed=seed)
    return burst_and_lull(build_schedule(generate(workload, p))), SYNTH_BLOCK_SIZE


def one_run(
    plan: list, block: int, truth: LatencyProfile, seed: int, n: int, spec: str | None, hi: int,
    lo: int, target: float,
) -> dict[str, Any]:  # fmt: skip
    settings = SimSettings(instances=n, perturbation=Perturbation(seed=seed))
    scaler = None
    if spec is not None:
        slo = Slo(SLO_TTFT_S, SLO_TPOT_S, target)
        policy = create_policy(spec, profile=truth, slo=slo, cold_start_s=settings.cold_start_s)
        scaler = Autoscaler(policy, lo, hi, INTERVAL_S)
    t0 = time.perf_counter()
    sim = simulate(plan, block, truth, "kv_ttft", settings, autoscaler=scaler)
    return {
        "attainment": round(slo_attainment(sim.records, SLO_TTFT_S, SLO_TPOT_S), 5),
        "gpu_hours": round(sim.gpu_seconds / 3600, 4),
        "peak": max((k for _, k, _ in sim.replicas), default=n),
        "changes": max(0, len(sim.replicas) - 1),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def static_peak(
    plan: list, block: int, truth: LatencyProfile, seed: int, target: float, hi: int
) -> tuple[int, dict[str, Any]]:
    """The smallest fixed size meeting ``target`` (bisection on 1..hi; hi if none does)."""
    lo_n, hi_n = 1, hi
    runs: dict[int, dict[str, Any]] = {}
    while lo_n < hi_n:
        mid = (lo_n + hi_n) // 2
        runs[mid] = r = one_run(plan, block, truth, seed, mid, None, hi, 1, target)
        if r["attainment"] >= target:
            hi_n = mid
        else:
            lo_n = mid + 1
    if hi_n not in runs:
        runs[hi_n] = one_run(plan, block, truth, seed, hi_n, None, hi, 1, target)
    return hi_n, runs[hi_n]


def cell(
    workload: str, seed: int, args: argparse.Namespace, truth: LatencyProfile
) -> dict[str, Any]:
    plan, block = make_plan(workload, seed, args.rate_scale, args.duration)
    settings = SimSettings(instances=1)
    ideal = ideal_ttfts(plan, block, truth, settings)
    ceiling = sum(1 for x in ideal if not math.isnan(x) and x <= SLO_TTFT_S) / len(plan)
    target = min(0.99, ceiling - 0.01)
    peak, static = static_peak(plan, block, truth, seed, target, args.max_instances)
    out: dict[str, Any] = {
        "requests": len(plan),
        "span_s": round(plan[-1].offset_s, 1),
        "ceiling": round(ceiling, 4),
        "target": round(target, 4),
        "static_peak": {"instances": peak, **static},
    }
    for spec in args.policies:
        out[spec] = r = one_run(
            plan, block, truth, seed, peak, spec, args.max_instances, args.min_instances, target
        )
        r["meets"] = r["attainment"] >= target
        r["gpu_vs_static"] = round(r["gpu_hours"] / static["gpu_hours"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="conversation only, seed 0")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--policies", default=",".join(POLICIES), help="specs, separated by ';'")
    ap.add_argument("--rate-scale", type=float, default=2.0, help="conversation's rate scale [2]")
    ap.add_argument("--duration", type=float, default=1800.0, help="synthetic seconds [1800]")
    ap.add_argument("--min-instances", type=int, default=1)
    ap.add_argument("--max-instances", type=int, default=48)
    ap.add_argument("--jobs", type=int, default=DEFAULT_JOBS)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    args.policies = [p for p in args.policies.split(";" if ";" in args.policies else ",") if p]
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"--workloads: unknown {w!r}; valid: {', '.join(WORKLOADS)}")
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
            "wall_s": round(time.perf_counter() - t0, 1),
        },
        "results": {f"{w}/seed{s}": c for (w, s), c in zip(keys, cells, strict=True)},
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
