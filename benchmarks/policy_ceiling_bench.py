"""How far online eviction can go on the Mooncake trace: prints one JSON object.

- ``reference``: hit rates of LRU, prefix-odds (the best online policy), Belady and the
  reuse oracle (knows *whether* each block is used again, not *when*) per capacity;
- ``reuse_oracle_with_label_error``: the reuse oracle when each request's live/dead knowledge
  is inverted with probability ``label_error`` (a continuation classifier with that error);
- ``online_continuation_predictability``: how well "this request gets a next turn" can be
  predicted online from the trace alone (a per-class rate table, fit on the first half of the
  requests and tested on the second);
- ``label_error_needed_for``: the classifier error at which the reuse oracle still reaches a
  target hit rate.

Conversations are derived online from ``hash_ids``, in trace order: ``lcp`` is the leading run
of a request's ids seen in any earlier request; its parent is the latest earlier request that
used ``ids[lcp - 1]`` when ``lcp >= 2`` (none otherwise); turn = parent's turn + 1 (1 without
one); a request "continues" if a later request has it as parent; new blocks = ``len(ids) -
lcp``; previous gap = its time minus its parent's.

Run: ``.venv/bin/python benchmarks/policy_ceiling_bench.py [--trace FILE] [--seeds N]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import MOONCAKE_TRACE  # noqa: E402
from loadgen.traces import TraceRequest, load_trace  # noqa: E402
from policies import create_policy  # noqa: E402
from simulation.cachesim import infinite_hit_rate, replay, simulate  # noqa: E402

CAPACITIES = [1000, 3000, 6000, 10000]
REFERENCE_POLICIES = ["lru", "prefix-odds", "belady", "reuse-oracle"]
LABEL_ERRORS = [0.0, 0.05, 0.1, 0.15, 0.2, 0.3]
SWEEP_CAPACITIES = [3000, 6000]
TARGET_HIT_RATE, TARGET_CAPACITY = 0.245, 6000
PRIOR_WEIGHT = 10.0


def reference(reqs: Sequence[TraceRequest]) -> dict[str, dict[str, float]]:
    """``{policy: {capacity: hit rate}}``."""
    rows = simulate(reqs, REFERENCE_POLICIES, CAPACITIES)
    return {
        name: {str(r.capacity_blocks): round(r.hit_rate, 4) for r in rows if r.policy == name}
        for name in REFERENCE_POLICIES
    }


def label_error_sweep(
    reqs: Sequence[TraceRequest], seeds: int, exact: Mapping[str, float]
) -> dict[str, dict[str, float]]:
    """``{label_error: {capacity: hit rate}}``, the median over ``seeds`` seeds (one draw per
    request and seed, shared across error rates). label_error 0 needs no draw: it is ``exact``,
    the reference's reuse-oracle column."""
    out: dict[str, dict[str, float]] = {}
    for err in LABEL_ERRORS:
        row: dict[str, float] = {}
        for cap in SWEEP_CAPACITIES:
            if err == 0:
                row[str(cap)] = exact[str(cap)]
                continue
            rates = [
                replay(
                    reqs, create_policy("reuse-oracle", cap, label_error=err, seed=seed)
                ).hit_rate
                for seed in range(seeds)
            ]
            row[str(cap)] = round(statistics.median(rates), 4)
        out[str(err)] = row
    return out


def needed_label_error(sweep: dict[str, dict[str, float]]) -> dict[str, object]:
    """The largest swept label_error still at the target, and the linear interpolation between
    the last sweep point at or above the target and the first below it."""
    points = [(float(err), row[str(TARGET_CAPACITY)]) for err, row in sweep.items()]
    at_target = [err for err, rate in points if rate >= TARGET_HIT_RATE]
    interpolated: float | None = None
    for (e0, r0), (e1, r1) in itertools.pairwise(points):
        if r0 >= TARGET_HIT_RATE > r1:
            interpolated = round(e0 + (r0 - TARGET_HIT_RATE) / (r0 - r1) * (e1 - e0), 3)
            break
    return {
        "target_hit_rate": TARGET_HIT_RATE,
        "capacity_blocks": TARGET_CAPACITY,
        "largest_swept_label_error_at_target": max(at_target) if at_target else None,
        "interpolated_label_error": interpolated,
        "method": "linear interpolation of the hit rate between adjacent sweep points",
    }


@dataclass(slots=True)
class Turns:
    """Per-request conversation structure derived online from ``hash_ids``."""

    turn: np.ndarray  # 1 without a parent
    continues: np.ndarray  # bool: some later request has this one as parent
    new_blocks: np.ndarray
    output_tokens: np.ndarray
    gap_s: np.ndarray  # time since the parent; nan without one


def derive_turns(reqs: Sequence[TraceRequest]) -> Turns:
    n = len(reqs)
    last_user: dict[int, int] = {}  # block id -> latest request that used it
    turn = np.ones(n, dtype=np.int64)
    continues = np.zeros(n, dtype=bool)
    new_blocks = np.zeros(n, dtype=np.int64)
    gap_s = np.full(n, np.nan)
    for i, req in enumerate(reqs):
        ids = req.hash_ids
        lcp = 0
        while lcp < len(ids) and ids[lcp] in last_user:
            lcp += 1
        if lcp >= 2:
            parent = last_user[ids[lcp - 1]]
            turn[i] = turn[parent] + 1
            continues[parent] = True
            gap_s[i] = req.timestamp_s - reqs[parent].timestamp_s
        new_blocks[i] = len(ids) - lcp
        for h in ids:
            last_user[h] = i
    output = np.array([r.output_length for r in reqs], dtype=np.int64)
    return Turns(turn, continues, new_blocks, output, gap_s)


def _log2_floor(x: float) -> int:
    """floor(log2(x)) for x >= 1; 0 below 1 (0 and 1 share a bucket)."""
    return math.floor(math.log2(x)) if x >= 1 else 0


def classes(t: Turns) -> list[tuple[int, int, int, int]]:
    """(min(turn, 6), min(log2 output, 9) // 2, min(log2 new blocks, 7), log2 gap // 2); the
    gap bucket is -1 without a parent (gaps under 1 s share bucket 0)."""
    return [
        (
            min(int(t.turn[i]), 6),
            min(_log2_floor(float(t.output_tokens[i])), 9) // 2,
            min(_log2_floor(float(t.new_blocks[i])), 7),
            -1 if math.isnan(t.gap_s[i]) else _log2_floor(float(t.gap_s[i])) // 2,
        )
        for i in range(len(t.turn))
    ]


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of ``x``, ties sharing their average rank."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], len(xs)]
    avg = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(len(x))
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    pos = int(labels.sum())
    neg = len(labels) - pos
    ranks = average_ranks(scores)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def min_error(scores: np.ndarray, labels: np.ndarray) -> float:
    """Lowest error of "continues iff score >= threshold" over all thresholds (+inf included:
    always "no")."""
    order = np.argsort(-scores, kind="mergesort")
    s, y = scores[order], labels[order]
    last = np.r_[s[1:] != s[:-1], True]  # cut after each tie group only
    tp = np.cumsum(y)[last]
    fp = np.cumsum(~y)[last]
    pos = int(y.sum())
    errors = np.r_[pos, fp + (pos - tp)]
    return float(errors.min() / len(y))


def continuation_predictability(reqs: Sequence[TraceRequest]) -> dict[str, object]:
    t = derive_turns(reqs)
    cls = classes(t)
    y = t.continues
    half = len(reqs) // 2
    prior = float(y[:half].mean())
    counts: dict[tuple[int, int, int, int], list[int]] = {}
    for c, label in zip(cls[:half], y[:half], strict=True):
        hc = counts.setdefault(c, [0, 0])
        hc[0] += int(label)
        hc[1] += 1

    def rate(c: tuple[int, int, int, int]) -> float:
        hits, count = counts.get(c, (0, 0))
        return (hits + PRIOR_WEIGHT * prior) / (count + PRIOR_WEIGHT)

    scores = np.array([rate(c) for c in cls[half:]])
    test = y[half:]
    per_turn: dict[str, dict[str, float]] = {}
    for k in range(1, 7):
        mask = t.turn == k if k < 6 else t.turn >= 6
        per_turn[str(k) if k < 6 else "6+"] = {
            "requests": int(mask.sum()),
            "continuation_rate": round(float(y[mask].mean()), 3) if mask.any() else 0.0,
        }
    return {
        "requests": len(reqs),
        "base_rate": round(float(y.mean()), 3),
        "fit": {"requests": half, "classes": len(counts), "base_rate": round(prior, 3)},
        "test": {
            "requests": len(reqs) - half,
            "base_rate": round(float(test.mean()), 3),
            "auc": round(auc(scores, test), 3),
            "min_error": round(min_error(scores, test), 3),
            "error_always_no": round(float(test.mean()), 3),
        },
        "continuation_rate_by_turn": per_turn,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=MOONCAKE_TRACE)
    parser.add_argument(
        "--seeds", type=int, default=1, help="label-error draws per point (median reported)"
    )
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    start = time.perf_counter()
    reqs = load_trace(args.trace).requests
    table = reference(reqs)
    sweep = label_error_sweep(reqs, args.seeds, table["reuse-oracle"])
    result = {
        "trace": str(args.trace),
        "reference": {"infinite": round(infinite_hit_rate(reqs), 4), "table": table},
        "reuse_oracle_with_label_error": {"seeds": args.seeds, "hit_rates": sweep},
        "online_continuation_predictability": continuation_predictability(reqs),
        "label_error_needed_for": needed_label_error(sweep),
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
