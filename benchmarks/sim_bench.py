"""Virtual-time speed of the sim engine: simulated requests per wall second.

Replays the shared Mooncake conversation trace (12,031 requests over ~59 minutes) on a cluster of
virtual sim instances with the H100 Llama-3.1-8B profile and a simple placement, and prints JSON:
the median over ``--runs`` of requests per wall second (goal >= 5,000, i.e. the trace in < 3 s),
plus what the simulated cluster did (TTFT, hit rate, preemptions) so a speed-up that breaks the
simulation shows.

Usage: .venv/bin/python benchmarks/sim_bench.py [--instances 8] [--runs 5] [--placement NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines.sim import (
    LatencyProfile,
    VirtualCluster,
    least_loaded,
    prefix_affinity,
    round_robin,
    trace_arrival,
)
from loadgen.traces import load_trace

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
)
PLACEMENTS = {
    "least_loaded": lambda: least_loaded,
    "round_robin": round_robin,
    "prefix_affinity": lambda: prefix_affinity,
}


def one_run(trace, profile, args) -> dict:  # type: ignore[no-untyped-def]
    cluster = VirtualCluster.build(args.instances, profile, block_size=args.block_size)
    mml = cluster.instances[0].max_model_len
    start, cpu_start = time.perf_counter(), time.process_time()
    arrivals = [
        trace_arrival(
            str(i),
            tr.timestamp_s,
            tr.input_length,
            tr.output_length,
            tr.hash_ids,
            trace.block_size,
            args.block_size,
            mml,
        )
        for i, tr in enumerate(trace.requests)
        if tr.input_length < mml
    ]
    records = cluster.replay(arrivals, PLACEMENTS[args.placement]())
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    ttfts = sorted(r.ttft_s for r in records)
    prompt = sum(r.prompt_tokens for r in records)
    return {
        "wall_s": wall,
        "requests": len(records),
        "req_per_s": len(records) / wall,
        "cpu_s": cpu,
        "req_per_cpu_s": len(records) / cpu,
        "sim_duration_s": max(r.finish_s for r in records),
        "steps": sum(inst.steps for inst in cluster.instances),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[int(len(ttfts) * 0.99)],
        "cached_token_ratio": sum(r.cached_tokens for r in records) / prompt,
        "preemptions": sum(r.preemptions for r in records),
        "per_instance": [len(inst.finished) for inst in cluster.instances],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--profile", default="h100-llama3.1-8b")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=512, help="engine block size (trace: 512)")
    ap.add_argument("--placement", choices=sorted(PLACEMENTS), default="least_loaded")
    args = ap.parse_args()
    trace = load_trace(args.trace)
    profile = LatencyProfile.load(args.profile)
    runs = [one_run(trace, profile, args) for _ in range(args.runs)]
    speeds = [r["req_per_s"] for r in runs]
    last = runs[-1]
    print(
        json.dumps(
            {
                "benchmark": "sim_virtual_time",
                "trace": Path(args.trace).name,
                "trace_requests": len(trace.requests),
                "trace_duration_s": round(trace.duration_s, 1),
                "profile": profile.name,
                "instances": args.instances,
                "block_size": args.block_size,
                "placement": args.placement,
                "runs": args.runs,
                "req_per_wall_s_median": round(statistics.median(speeds), 1),
                "req_per_wall_s_all": [round(s, 1) for s in speeds],
                "wall_s_median": round(statistics.median(r["wall_s"] for r in runs), 3),
                # NOTE: process CPU time, for a machine shared with other work (wall time then
                # includes waiting for a core).
                "req_per_cpu_s_median": round(
                    statistics.median(r["req_per_cpu_s"] for r in runs), 1
                ),
                "load_average_1m": round(os.getloadavg()[0], 2),
                "goal_req_per_s": 5000,
                "simulated": {
                    k: (round(v, 4) if isinstance(v, float) else v)
                    for k, v in last.items()
                    if k not in ("wall_s", "req_per_s", "cpu_s", "req_per_cpu_s")
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
