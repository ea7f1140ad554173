"""Prefill/decode pools against colocated engines in the cluster simulator, at equal GPU count.

Replays the shared Mooncake conversation trace on 16 virtual H100s (Llama-3.1-8B profile) with
the production routing core: colocated (kv_ttft over 16 engines) and every ``--splits`` P:D
split (the PD planner over P prefill and D decode engines, KV pulled at ``--transfer-gbps``),
each at every ``--rate-scales`` (2 replays the trace twice as fast). Prints JSON: per load and
configuration TTFT and TPOT p50/p99, goodput under the SLOs, hit rate, how many requests were
split; and per load the best PD split's TPOT p99 against colocated's, which says where PD wins
on TPOT p99 (the reason it exists) and by how much.

Every run is deterministic (seeded); the engines are perturbed as ``kvroute simulate``'s
defaults (speed sigma 0.1, jitter 0.05). Usage:
  .venv/bin/python benchmarks/pd_sim_bench.py [--rate-scales 1,2,3,4] [--splits 4:12,6:10,8:8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MOONCAKE_TRACE
from engines.profile import LatencyProfile
from loadgen.metrics import summarize
from loadgen.traces import load_trace
from loadgen.workloads import Planned, build_schedule
from simulation.cluster import simulate
from simulation.settings import SimSettings


def one(
    plan: list[Planned],
    block_size: int,
    profile: LatencyProfile,
    prefill: int,
    args: argparse.Namespace,
) -> dict:
    settings = SimSettings(
        instances=args.instances,
        prefill_instances=prefill,
        engine={"transfer_gbps": args.transfer_gbps},
    )
    run = simulate(plan, block_size, profile, "kv_ttft", settings)
    s = summarize(
        run.records,
        duration_s=run.span_s,
        requested_span_s=plan[-1].offset_s,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_tpot_ms,
    )
    on_prefill = {f"sim-{i}" for i in range(prefill)}
    return {
        "ttft_ms": s["ttft_ms"],
        "tpot_ms": s["tpot_ms"],
        "goodput_rps": round(s["goodput_rps"], 3),
        "good_fraction": round(s["good_requests"] / max(1, len(run.records)), 4),
        "hit_rate": round(s["server_hit_rate"], 4),
        "completed": sum(r.ok for r in run.records),
        "requests_on_prefill_engines": sum(r.instance in on_prefill for r in run.records),
        "wall_s": round(run.wall_s, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(MOONCAKE_TRACE))
    ap.add_argument("--profile", default="h100-llama3.1-8b")
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--rate-scales", default="1,2,3,4")
    ap.add_argument("--splits", default="4:12,6:10,8:8", help="P:D prefill and decode engines")
    ap.add_argument("--transfer-gbps", type=float, default=25.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    args = ap.parse_args()
    trace = load_trace(args.trace)
    profile = LatencyProfile.load(args.profile)
    splits = []
    for item in args.splits.split(","):
        p, d = (int(x) for x in item.split(":"))
        if p + d != args.instances:
            raise SystemExit(f"--splits: {item} is not {args.instances} engines")
        splits.append(p)
    out: dict = {
        "benchmark": "pd_vs_colocated_simulated",
        "trace": Path(args.trace).name,
        "profile": profile.name,
        "instances": args.instances,
        "transfer_gbps": args.transfer_gbps,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "loads": {},
    }
    for scale in (float(x) for x in args.rate_scales.split(",")):
        plan = build_schedule(trace.requests, time_scale=1.0 / scale)
        runs = {"colocated": one(plan, trace.block_size, profile, 0, args)}
        for p in splits:
            runs[f"pd_{p}:{args.instances - p}"] = one(plan, trace.block_size, profile, p, args)
        colo = runs["colocated"]["tpot_ms"]["p99"]
        best = min((k for k in runs if k != "colocated"), key=lambda k: runs[k]["tpot_ms"]["p99"])
        runs["tpot_p99_best_pd"] = {
            "config": best,
            "pd_ms": runs[best]["tpot_ms"]["p99"],
            "colocated_ms": colo,
            "pd_over_colocated": round(runs[best]["tpot_ms"]["p99"] / colo, 4),
        }
        out["loads"][f"x{scale:g}"] = runs
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
