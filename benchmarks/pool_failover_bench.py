"""What losing an engine costs the cluster's cache, with private CPU tiers and with the KV pool.
Prints JSON.

    .venv/bin/python benchmarks/pool_failover_bench.py [--rate-scale 2] [--at-s 900]
        [--window-s 60] [--seeds 0,1,2] [--jobs 2] [--out FILE]

The shared conversation trace on 16 simulated ``h100-llama3.1-8b`` engines, routed by kv_ttft,
in three set-ups: no CPU memory (GPU caches only), a private LRU CPU tier of 160 GiB per
engine, and the same memory as one 2,560 GiB pool (25 GB/s per node). In each, a run where at
``--at-s`` (virtual seconds from the first arrival) the engine holding the most GPU blocks is
lost with its caches (``SimSettings.lose_engine_at_s``), against the same run without the
loss. The figure is the
prompt-token hit rate of the requests arriving in the ``--window-s`` after the loss, with and
without it, and the drop in points (mean, min and max over seeds: the simulator's
perturbation seed). A loss that the cluster's cache survives drops nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MOONCAKE_TRACE, print_json
from engines.profile import LatencyProfile
from loadgen.records import RequestRecord
from loadgen.traces import load_trace
from loadgen.workloads import build_schedule
from router.placement import create_scorer
from simulation.cluster import ClusterSimulator
from simulation.jobs import run_each
from simulation.settings import Perturbation, SimSettings

SETUPS: dict[str, dict[str, Any]] = {
    "gpu_only": {},
    "private_tiers": {"engine": {"cpu_capacity_blocks": 2560}},  # 160 GiB of 512-token blocks
    "pool": {"pool_gib": 2560.0},
}


def _window_hit_rate(records: list[RequestRecord], start: float, end: float) -> float:
    got = [r for r in records if start <= r.intended_s < end and r.ok]
    prompt = sum(r.prompt_tokens or r.input_tokens for r in got)
    return sum(r.cached_tokens or 0 for r in got) / prompt if prompt else float("nan")


def run_one(
    setup: str, seed: int, lose: bool, rate_scale: float, at_s: float, window_s: float
) -> dict[str, Any]:
    plan = build_schedule(load_trace(str(MOONCAKE_TRACE)).requests, time_scale=1 / rate_scale)
    t0 = plan[0].offset_s
    settings = SimSettings(
        16,
        perturbation=Perturbation(seed=seed),
        lose_engine_at_s=at_s if lose else None,
        **SETUPS[setup],
    )
    truth = LatencyProfile.load("h100-llama3.1-8b")
    sim = ClusterSimulator(truth, create_scorer("kv_ttft"), settings, 512)
    try:
        run = sim.run(plan)
    finally:
        sim.close()
    return {
        "hit_rate": _window_hit_rate(run.records, t0 + at_s, t0 + at_s + window_s),
        "lost": sim.lost,
    }


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.fmean(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-scale", type=float, default=2.0, help="the trace's rate scale [2]")
    ap.add_argument("--at-s", type=float, default=900.0, help="when the engine is lost [900]")
    ap.add_argument("--window-s", type=float, default=60.0, help="the window after it [60]")
    ap.add_argument("--seeds", default="0,1,2", help="perturbation seeds [0,1,2]")
    ap.add_argument("--jobs", type=int, default=2, help="parallel processes [2]")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        print(f"pool_failover_bench: error: --seeds: not integers: {args.seeds!r}", file=sys.stderr)
        return 2
    if not seeds or args.rate_scale <= 0 or args.at_s < 0 or args.window_s <= 0:
        print(
            "pool_failover_bench: error: --seeds must name one seed or more, --rate-scale and "
            "--window-s must be > 0, --at-s >= 0",
            file=sys.stderr,
        )
        return 2
    cells = [(s, seed, lose) for s in SETUPS for seed in seeds for lose in (False, True)]
    calls = [
        partial(run_one, s, seed, lose, args.rate_scale, args.at_s, args.window_s)
        for s, seed, lose in cells
    ]
    out = dict(zip(cells, run_each(calls, args.jobs), strict=True))
    doc: dict[str, Any] = {
        "meta": {
            "trace": MOONCAKE_TRACE.name,
            "instances": 16,
            "profile": "h100-llama3.1-8b",
            "router": "kv_ttft",
            "rate_scale": args.rate_scale,
            "at_s": args.at_s,
            "window_s": args.window_s,
            "seeds": seeds,
            "setups": SETUPS,
        },
        "results": {},
    }
    for s in SETUPS:
        kept = [out[(s, seed, False)]["hit_rate"] for seed in seeds]
        lost = [out[(s, seed, True)]["hit_rate"] for seed in seeds]
        doc["results"][s] = {
            "hit_rate_without_loss": _stats(kept),
            "hit_rate_with_loss": _stats(lost),
            "drop_points": _stats([100 * (k - x) for k, x in zip(kept, lost, strict=True)]),
            "lost": [out[(s, seed, True)]["lost"] for seed in seeds],
        }
    print_json(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
