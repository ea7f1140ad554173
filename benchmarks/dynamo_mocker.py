"""The Dynamo mocker's default timing model (aisimulate-core 0.13.0 "polynomial", the formulas
in ``benchmarks/dynamo_replay.py``'s doc) and the figures of one replay (``run_metrics``), computed
the same way from Dynamo's per-request records and from kvroute's simulator's records put in
their form. Standard library only: ``dynamo_replay.py`` imports it inside Dynamo's own virtual
environment too, where kvroute is not installed.
"""

from __future__ import annotations

import statistics
from typing import Any

# aisimulate-core 0.13.0, engine/common/perf_model.rs (the mocker's default timing model)
PREFILL_POLY = (4.209989e-07, 1.518344e-02, 1.650142e01)  # ms = a T^2 + b T + c
DECODE_POLY = (-25.74, 54.01, 5.74)  # ms = max(1, a p^2 + b p + c), p = active KV / capacity
DECODE_FLOOR_MS = 1.0


def prefill_ms(tokens: int) -> float:
    a, b, c = PREFILL_POLY
    return a * tokens * tokens + b * tokens + c if tokens > 0 else 0.0


def decode_ms(active_kv_tokens: int, capacity_tokens: int) -> float:
    a, b, c = DECODE_POLY
    p = min(active_kv_tokens / capacity_tokens, 1.0)
    return max(DECODE_FLOOR_MS, a * p * p + b * p + c)


def percentile(values: list[float], q: float) -> float | None:
    """numpy's default (linear) percentile, q in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_metrics(records: list[dict[str, Any]], spec: dict[str, Any]) -> dict[str, Any]:
    done = [r for r in records if r.get("terminal_status") == "completed"]
    ttft = [r["ttft_ms"] for r in done if r.get("ttft_ms") is not None]
    tpot = [r["itl_ms"] for r in done if r.get("itl_ms") is not None and r["output_length"] > 1]
    arrivals = [r["arrival_time_ms"] for r in records]
    span_s = (max(arrivals) - min(arrivals)) / 1e3 if len(arrivals) > 1 else 0.0
    slo_ttft, slo_tpot = spec["slo_ttft_ms"], spec["slo_tpot_ms"]
    good = sum(
        1
        for r in done
        if r.get("ttft_ms") is not None
        and r["ttft_ms"] <= slo_ttft
        and (r.get("itl_ms") is None or r["output_length"] <= 1 or r["itl_ms"] <= slo_tpot)
    )
    prompt = sum(r["input_length"] for r in done)
    reused = sum(r.get("reused_input_tokens") or 0 for r in done)
    overlap = 0
    for r in done:
        hist = r.get("routing_history") or []
        overlap += (hist[-1].get("reported_overlap_tokens") or 0) if hist else 0
    # no request waiting for another: its uncached tokens in budget-sized passes, alone
    budget = spec["max_num_batched_tokens"]
    no_wait = []
    for r in done:
        left, ms = r["input_length"] - (r.get("reused_input_tokens") or 0), 0.0
        while left > 0:
            ms += prefill_ms(min(left, budget))
            left -= budget
        no_wait.append(ms)
    per_worker: dict[int, int] = {}
    for r in done:
        w = r.get("decode_worker_idx")
        if w is not None:
            per_worker[w] = per_worker.get(w, 0) + 1
    counts = sorted(per_worker.values())
    return {
        "requests": len(records),
        "completed": len(done),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90),
        "ttft_p99_ms": percentile(ttft, 99),
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else None,
        "tpot_p50_ms": percentile(tpot, 50),
        "tpot_p99_ms": percentile(tpot, 99),
        "no_wait_p50_ms": percentile(no_wait, 50),
        "no_wait_p99_ms": percentile(no_wait, 99),
        "good_requests": good,
        "goodput_rps": good / span_s if span_s > 0 else None,
        "arrival_span_s": span_s,
        "prefix_hit_rate": reused / prompt if prompt else None,
        "router_overlap_rate": overlap / prompt if prompt else None,
        "readmissions": sum(r.get("readmission_count") or 0 for r in records),
        "requests_per_worker_min": counts[0] if counts else None,
        "requests_per_worker_max": counts[-1] if counts else None,
    }
