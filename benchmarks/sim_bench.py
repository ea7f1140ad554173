"""Speed of the cluster simulator with the production routing core in the loop.

Replays the shared Mooncake conversation trace (12,031 requests over ~59 minutes) on virtual sim
engines (H100 Llama-3.1-8B profile) placed by ``simulation.cluster`` (the real ``RouterCore``,
scorer, event ingestion and load tracking), and prints JSON: per router the median over
``--runs`` of wall seconds and simulated requests per wall second of each router run alone in
this process (``per_router_single_process``; goals: <= 10 s per router for the trace on 16
instances, >= 5,000 req/s), plus what the simulated cluster did, so a speed-up that breaks the
simulation shows. Then the whole router batch as ``kvroute simulate --jobs`` runs it, ``--jobs``
routers at a time in forked processes (``batch_parallel``): its wall time and the aggregate
simulated requests (all routers') per wall second, medians over ``--runs`` batches.

``--tile K`` replays the trace K times (copy k shifted by k trace-lengths in time when
``--tile-time``, overlaid otherwise; hash ids offset per copy so copies share nothing): the scale
run is ``--tile 84 --tile-time 6 --instances 256`` (>= 1M requests), with peak memory reported.

Usage: .venv/bin/python benchmarks/sim_bench.py [--instances 16] [--runs 3] [--routers A,B]
                                                [--jobs 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MOONCAKE_TRACE
from engines.profile import LatencyProfile
from loadgen.metrics import summarize
from loadgen.traces import TraceRequest, load_trace
from loadgen.workloads import Planned, build_schedule
from simulation.cluster import simulate
from simulation.jobs import DEFAULT_JOBS, run_each
from simulation.settings import SimSettings


def tiled(requests: list[TraceRequest], copies: int, time_copies: int) -> list[TraceRequest]:
    """``copies`` copies of ``requests``: ``time_copies`` of them one after another in time, the
    rest overlaid on those; every copy's hash ids moved to a range of its own."""
    if copies <= 1:
        return requests
    span = requests[-1].timestamp_s - requests[0].timestamp_s + 1.0
    stride = 1 + max(max(r.hash_ids, default=0) for r in requests)
    out = []
    for k in range(copies):
        shift = (k % max(time_copies, 1)) * span
        out += [
            dataclasses.replace(
                r,
                timestamp_s=r.timestamp_s + shift,
                hash_ids=tuple(h + k * stride for h in r.hash_ids),
            )
            for r in requests
        ]
    out.sort(key=lambda r: r.timestamp_s)
    return out


def one_run(plan: list[Planned], block_size: int, profile, router: str, args) -> dict:  # type: ignore[no-untyped-def]
    cpu0 = time.process_time()
    run = simulate(plan, block_size, profile, router, SimSettings(instances=args.instances))
    cpu_s = time.process_time() - cpu0
    s = summarize(run.records, duration_s=run.span_s, requested_span_s=plan[-1].offset_s)
    return {
        "wall_s": run.wall_s,
        "cpu_s": cpu_s,
        "req_per_s": run.requests_per_wall_s,
        "requests": len(run.records),
        "sim_span_s": round(run.span_s, 1),
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "ttft_p99_ms": s["ttft_ms"]["p99"],
        "tpot_p50_ms": s["tpot_ms"]["p50"],
        "hit_rate": s["server_hit_rate"],
        "preemptions": sum(r.preemptions for r in run.records),
        "errors": s["errors"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(MOONCAKE_TRACE))
    ap.add_argument("--profile", default="h100-llama3.1-8b")
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--routers", default="round_robin,kv_ttft")
    ap.add_argument("--tile", type=int, default=1, help="copies of the trace")
    ap.add_argument("--tile-time", type=int, default=1, help="of which one after another")
    ap.add_argument(
        "--jobs",
        type=int,
        default=DEFAULT_JOBS,
        help="routers at once in the batch_parallel figure; 0: no batch [min(2, cores)]",
    )
    args = ap.parse_args()
    trace = load_trace(args.trace)
    requests = tiled(trace.requests, args.tile, args.tile_time)
    plan = build_schedule(requests)
    profile = LatencyProfile.load(args.profile)
    out: dict = {
        "benchmark": "cluster_simulator_speed",
        "trace": Path(args.trace).name,
        "requests": len(plan),
        "tiles": args.tile,
        "profile": profile.name,
        "instances": args.instances,
        "block_size": trace.block_size,
        "runs": args.runs,
        "goal": {"wall_s_per_router_16_instances": 10, "req_per_s": 5000},
        "per_router_single_process": {},
    }
    routers = args.routers.split(",")
    for router in routers:
        runs = [one_run(plan, trace.block_size, profile, router, args) for _ in range(args.runs)]
        out["per_router_single_process"][router] = {
            "wall_s_median": round(statistics.median(r["wall_s"] for r in runs), 3),
            # the process's CPU time for the whole call (cluster built, run and freed): less
            # moved by other processes on the box than the wall time
            "cpu_s_median": round(statistics.median(r["cpu_s"] for r in runs), 3),
            "cpu_s_all": [round(r["cpu_s"], 3) for r in runs],
            "req_per_wall_s_median": round(statistics.median(r["req_per_s"] for r in runs), 1),
            "req_per_wall_s_all": [round(r["req_per_s"], 1) for r in runs],
            "simulated": {
                k: v for k, v in runs[-1].items() if k not in ("wall_s", "cpu_s", "req_per_s")
            },
        }
    calls = [partial(one_run, plan, trace.block_size, profile, r, args) for r in routers]
    walls: list[float] = []
    for _ in range(args.runs if args.jobs > 0 else 0):
        t0 = time.perf_counter()
        batch = run_each(calls, args.jobs)
        walls.append(time.perf_counter() - t0)
    if walls:
        simulated = sum(r["requests"] for r in batch)
        out["batch_parallel"] = {
            "jobs": args.jobs,
            "routers": routers,
            "wall_s_median": round(statistics.median(walls), 3),
            "wall_s_all": [round(w, 3) for w in walls],
            "aggregate_req_per_wall_s_median": round(simulated / statistics.median(walls), 1),
            "aggregate_req_per_wall_s_all": [round(simulated / w, 1) for w in walls],
        }
    out["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out["load_average_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
