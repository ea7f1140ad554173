"""Where an autoscaled run's SLO misses come from, against a fixed pool: one workload of the
autoscaling suite (``benchmarks/autoscale_suite.py``), one seed, scored as the suite scores it
(after the first cycle on periodic days), counting only the requests some pool could serve in
time (ideal TTFT within the SLO).

Each miss is put in a class: TTFT or TPOT; its cache hit under or over half its prompt; and
where its predecessor ran, the latest earlier request holding its deepest previously seen
block: on the same engine, on another engine that still served requests afterwards, on an
engine that served nothing from then on (scaled down, or idle to the end), or no
predecessor. For the misses whose predecessor's engine was gone, the deciles of the gap to
the predecessor, of the blocks shared with it and of the prompt.

Prints JSON on stdout.

Usage: .venv/bin/python benchmarks/autoscale_misses.py [--workload conversation] [--seed 0]
           [--policy kvroute] [--static 31]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.autoscale_runs import (
    PERIOD_S,
    PERIODIC,
    SLO_TPOT_S,
    SLO_TTFT_S,
    WORKLOADS,
    ceiling_and_target,
    ideal_ttfts_of,
    make_plan,
    one_run,
)
from engines.profile import LatencyProfile


def predecessors(plan: list) -> dict[int, int | None]:
    """Per request index, the latest earlier request holding its deepest previously seen
    block (None: none of its blocks was seen before)."""
    out: dict[int, int | None] = {}
    seen: dict[int, int] = {}
    for p in sorted(plan, key=lambda p: p.offset_s):
        hs = p.req.hash_ids
        deepest = max((k for k, h in enumerate(hs) if h in seen), default=None)
        out[p.index] = seen[hs[deepest]] if deepest is not None else None
        for h in hs:
            seen[h] = p.index
    return out


def deciles(xs: list[float]) -> list[float]:
    return [round(x, 1) for x in statistics.quantiles(xs, n=10)] if len(xs) > 1 else xs


def classify(plan: list, records: list, ideal: list[float], since: float) -> dict[str, Any]:
    by = {r.index: r for r in records}
    hashes = {q.index: q.req.hash_ids for q in plan}
    pred = predecessors(plan)
    last: dict[str, float] = {}
    for r in records:
        if r.instance:
            last[r.instance] = max(last.get(r.instance, 0.0), r.intended_s)
    classes: Counter[str] = Counter()
    gone: dict[str, list[float]] = {"gap_s": [], "shared_blocks": [], "prompt_tokens": []}
    scored = 0
    for r in records:
        if r.intended_s < since or not ideal[r.index] <= SLO_TTFT_S:
            continue
        scored += 1
        if r.meets(SLO_TTFT_S, SLO_TPOT_S):
            continue
        p = pred.get(r.index)
        engine = by[p].instance if p is not None and p in by else None
        if engine is None:
            where = "no predecessor"
        elif engine == r.instance:
            where = "same engine"
        elif last.get(engine, 0.0) < r.intended_s:
            where = "engine gone"
            assert p is not None
            shared = 0
            for a, b in zip(hashes[p], hashes[r.index], strict=False):
                if a != b:
                    break
                shared += 1
            gone["gap_s"].append(r.intended_s - by[p].intended_s)
            gone["shared_blocks"].append(shared)
            gone["prompt_tokens"].append(r.input_tokens)
        else:
            where = "other engine"
        what = "TTFT" if not (r.ok and r.ttft_s <= SLO_TTFT_S) else "TPOT"
        hit = (r.cached_tokens or 0) / max(1, r.prompt_tokens or r.input_tokens)
        classes[f"{what}, {where}, hit {'<' if hit < 0.5 else '>='} 0.5"] += 1
    return {
        "attainable_scored": scored,
        "misses": sum(classes.values()),
        "classes": dict(classes.most_common()),
        "engine_gone_deciles": {k: deciles(v) for k, v in gone.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="conversation", choices=WORKLOADS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="kvroute", help="autoscaling policy spec [kvroute]")
    ap.add_argument("--static", type=int, default=31, help="the fixed pool to compare [31]")
    ap.add_argument("--rate-scale", type=float, default=2.0, help="as the suite's [2]")
    ap.add_argument("--duration", type=float, default=1200.0, help="synthetic seconds [1200]")
    ap.add_argument("--max-instances", type=int, default=48)
    args = ap.parse_args()
    if args.static < 1 or args.max_instances < args.static:
        ap.error("--static must be in [1, --max-instances]")
    truth = LatencyProfile.load("h100-llama3.1-8b")
    plan, block = make_plan(args.workload, args.seed, args.rate_scale, args.duration)
    period = PERIOD_S if args.workload in PERIODIC else 0.0
    ideal = ideal_ttfts_of(plan, block, truth)
    _, target = ceiling_and_target(plan, ideal, period)
    out: dict[str, Any] = {"workload": args.workload, "seed": args.seed, "target": round(target, 4)}
    n, hi = args.static, args.max_instances
    for name, spec, lo in (("static", None, n), (args.policy, args.policy, 1)):
        run, records = one_run(
            plan, block, truth, args.seed, n, spec, hi if spec else n, lo, target, period,
            period=period, records=True,
        )  # fmt: skip
        out[name] = {
            "attainment": run["attainment"],
            "gpu_hours": run["gpu_hours"],
            **classify(plan, records, ideal, period),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
