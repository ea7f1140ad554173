"""Speed of the cluster simulator with the production routing core in the loop.

Replays the shared Mooncake conversation trace (12,031 requests over ~59 minutes) on virtual sim
engines (H100 Llama-3.1-8B profile) placed by ``loadgen.simulator`` (the real ``RouterCore``,
scorer, event ingestion and load tracking), and prints JSON: per router the median over
``--runs`` of wall seconds and simulated requests per wall second (goals: <= 10 s per router for
the trace on 16 instances, >= 5,000 req/s), plus what the simulated cluster did, so a speed-up
that breaks the simulation shows.

``--tile K`` replays the trace K times (copy k shifted by k trace-lengths in time when
``--tile-time``, overlaid otherwise; hash ids offset per copy so copies share nothing): the scale
run is ``--tile 84 --tile-time 6 --instances 256`` (>= 1M requests), with peak memory reported.

Usage: .venv/bin/python benchmarks/sim_bench.py [--instances 16] [--runs 3] [--routers A,B]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines.sim.profile import LatencyProfile
from loadgen.metrics import summarize
from loadgen.simulator import SimSettings, simulate
from loadgen.traces import TraceRequest, load_trace
from loadgen.workloads import Planned, build_schedule

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
)


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
    run = simulate(plan, block_size, profile, router, SimSettings(instances=args.instances))
    s = summarize(run.records, duration_s=run.span_s, requested_span_s=plan[-1].offset_s)
    return {
        "wall_s": run.wall_s,
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
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--profile", default="h100-llama3.1-8b")
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--routers", default="round_robin,kv_ttft")
    ap.add_argument("--tile", type=int, default=1, help="copies of the trace")
    ap.add_argument("--tile-time", type=int, default=1, help="of which one after another")
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
        "routers": {},
    }
    for router in args.routers.split(","):
        runs = [one_run(plan, trace.block_size, profile, router, args) for _ in range(args.runs)]
        out["routers"][router] = {
            "wall_s_median": round(statistics.median(r["wall_s"] for r in runs), 3),
            "req_per_wall_s_median": round(statistics.median(r["req_per_s"] for r in runs), 1),
            "req_per_wall_s_all": [round(r["req_per_s"], 1) for r in runs],
            "simulated": {k: v for k, v in runs[-1].items() if k not in ("wall_s", "req_per_s")},
        }
    out["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out["load_average_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
