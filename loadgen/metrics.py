"""Summary statistics of a run: rates, latency percentiles, goodput, cache hit rates, errors.

All latencies are measured from each request's intended send time. ITL percentiles pool every
inter-token gap of every successful request; goodput counts successful requests whose TTFT and
mean ITL (``tpot_s``: time per output token after the first) meet the SLOs, per second of run.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from loadgen.records import RequestRecord

_DIGITS = re.compile(r"\d+")
PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0, 99.9)
# the keys of every ``percentiles_ms`` dict, in order
PERCENTILE_KEYS: tuple[str, ...] = ("mean", *(f"p{p:g}" for p in PERCENTILES), "max")


def percentiles_ms(values_s: Sequence[float] | np.ndarray) -> dict[str, float | None]:
    arr = np.asarray(values_s, dtype=np.float64)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return dict.fromkeys(PERCENTILE_KEYS, None)
    vals = [arr.mean(), *np.percentile(arr, PERCENTILES), arr.max()]
    return {k: round(float(v) * 1e3, 4) for k, v in zip(PERCENTILE_KEYS, vals, strict=True)}


def event_rate(times: np.ndarray) -> float | None:
    """Events per second over their span: (n - 1) / (last - first)."""
    if times.size < 2:
        return None
    span = float(times.max() - times.min())
    return (times.size - 1) / span if span > 0 else None


def server_hit_rate(records: Sequence[RequestRecord]) -> float | None:
    """Cached prompt tokens over prompt tokens, across the successful requests whose server
    reported usage (None without any)."""
    prompt = cached = 0
    for r in records:
        if r.ok and r.prompt_tokens and r.cached_tokens is not None:
            prompt += r.prompt_tokens
            cached += r.cached_tokens
    return cached / prompt if prompt else None


def summarize(
    records: Sequence[RequestRecord],
    *,
    duration_s: float,
    requested_span_s: float,
    slo_ttft_ms: float | None = None,
    slo_itl_ms: float | None = None,
    ideal_hit_rate: tuple[float, float] | None = None,
) -> dict[str, Any]:
    n = len(records)
    sent = [r for r in records if not math.isnan(r.sent_s)]
    ok = [r for r in records if r.ok]
    intended = np.array([r.intended_s for r in sent])
    sent_at = np.array([r.sent_s for r in sent])
    requested_rate = (n - 1) / requested_span_s if n > 1 and requested_span_s > 0 else None
    errors = Counter(r.error for r in records if r.error is not None)
    unsent = n - len(sent)
    if unsent:
        errors["not_sent"] += unsent
    examples: dict[str, str] = {}
    for r in records:
        if r.error is not None and r.error_detail and r.error not in examples:
            examples[r.error] = r.error_detail
    ttft = [r.ttft_s for r in ok]
    itl = [g for r in ok for g in r.itl_s]
    out_tokens = sum(r.output_tokens for r in ok)
    good = ok
    if slo_ttft_ms is not None:
        good = [r for r in good if r.ttft_s * 1e3 <= slo_ttft_ms]
    if slo_itl_ms is not None:
        good = [r for r in good if math.isnan(r.tpot_s) or r.tpot_s * 1e3 <= slo_itl_ms]
    with_usage = [r for r in ok if r.prompt_tokens and r.cached_tokens is not None]
    with_tier = [r for r in with_usage if r.cpu_cached_tokens is not None]
    tier_prompt = sum(r.prompt_tokens or 0 for r in with_tier)
    cpu_sum = sum(r.cpu_cached_tokens or 0 for r in with_tier)
    tier_cached = sum(r.cached_tokens or 0 for r in with_tier)
    summary: dict[str, Any] = {
        "requests": n,
        "sent": len(sent),
        "completed": len(ok),
        "failed": n - len(ok),
        "duration_s": round(duration_s, 4),
        "requested_rate": requested_rate,
        "achieved_rate": event_rate(sent_at),
        "scheduled_rate": event_rate(intended),
        "completed_rate": len(ok) / duration_s if duration_s > 0 else None,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration_s if duration_s > 0 else None,
        "ttft_ms": percentiles_ms(ttft),
        "itl_ms": percentiles_ms(itl),
        "tpot_ms": percentiles_ms([r.tpot_s for r in ok]),
        "e2e_ms": percentiles_ms([r.e2e_s for r in ok]),
        "send_lag_ms": percentiles_ms(sent_at - intended),
        "cap_delayed": sum(r.cap_delayed for r in records),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_itl_ms": slo_itl_ms,
        "good_requests": len(good),
        "goodput_rps": len(good) / duration_s if duration_s > 0 else None,
        "server_hit_rate": server_hit_rate(ok),
        "server_hit_rate_requests": len(with_usage),
        # the engine's split of those hits by tier, where it reports one (the simulator)
        "gpu_hit_rate": (tier_cached - cpu_sum) / tier_prompt if tier_prompt else None,
        "cpu_hit_rate": cpu_sum / tier_prompt if tier_prompt else None,
        "per_instance": instance_spread(ok),
        "ideal_hit_rate_blocks": ideal_hit_rate[0] if ideal_hit_rate else None,
        "ideal_hit_rate_tokens": ideal_hit_rate[1] if ideal_hit_rate else None,
        "errors": dict(sorted(errors.items())),
        "error_examples": examples,
        "error_messages": error_groups(records),
    }
    return summary


def error_message(detail: str | None) -> str:
    """The message of an error record's ``error_detail``: an OpenAI-shaped error body's
    ``error.message`` (or FastAPI's ``detail``), else the detail itself."""
    if not detail:
        return ""
    try:
        doc = json.loads(detail)
        err = doc.get("error") if isinstance(doc, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if isinstance(doc, dict) and doc.get("detail"):
            return str(doc["detail"])
    except ValueError:
        pass  # not JSON, or cut short at 300 characters
    return detail


def error_groups(records: Sequence[RequestRecord], limit: int = 5) -> list[dict[str, Any]]:
    """The failed requests grouped by error kind and message (numbers in the message do not
    split a group), most frequent first: each group's ``error``, ``count`` and first
    ``message``; at most ``limit`` groups."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        if r.error is None:
            continue
        message = error_message(r.error_detail)
        key = (r.error, _DIGITS.sub("#", message))
        group = groups.get(key)
        if group is None:
            groups[key] = {"error": r.error, "count": 1, "message": message}
        else:
            group["count"] += 1
    ranked = sorted(groups.values(), key=lambda g: -g["count"])  # stable: first seen first
    return ranked[:limit]


def instance_spread(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Requests and prompt tokens per instance, and how uneven they are (max / mean), where the
    records say which instance ran them; None otherwise."""
    counts: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    for r in records:
        if r.instance is not None:
            counts[r.instance] += 1
            tokens[r.instance] += r.input_tokens
    if not counts:
        return None
    mean_n = sum(counts.values()) / len(counts)
    mean_t = sum(tokens.values()) / len(tokens)
    return {
        "instances": len(counts),
        "requests_max_over_mean": round(max(counts.values()) / mean_n, 4),
        "requests_min_over_mean": round(min(counts.values()) / mean_n, 4),
        "prompt_tokens_max_over_mean": round(max(tokens.values()) / mean_t, 4) if mean_t else None,
        "requests": dict(sorted(counts.items())),
    }


def timeseries(records: Sequence[RequestRecord], bin_s: float = 1.0) -> list[dict[str, Any]]:
    """Per-bin counts and rates: requests sent, completed, output tokens, server-side hit rate,
    from 0 to the run's last send or finish (``end``). Every rate is the bin's count over its
    real width (``width_s``): ``bin_s``, except the last bin, which ends at ``end``; a last
    remainder under half a bin is folded into the bin before it (a bin 1 to 1.5 ``bin_s``
    wide), so a few milliseconds holding one request never read as a rate spike."""
    end = max((t for r in records for t in (r.sent_s, r.done_s) if not math.isnan(t)), default=0.0)
    bins = max(1, math.ceil(end / bin_s))
    if bins > 1 and end - (bins - 1) * bin_s < bin_s / 2:
        bins -= 1
    sent = np.zeros(bins, dtype=np.int64)
    completed = np.zeros(bins, dtype=np.int64)
    tokens = np.zeros(bins, dtype=np.int64)
    prompt = np.zeros(bins, dtype=np.int64)
    cached = np.zeros(bins, dtype=np.int64)
    errors = np.zeros(bins, dtype=np.int64)
    for r in records:
        if not math.isnan(r.sent_s):
            sent[min(bins - 1, max(0, int(r.sent_s // bin_s)))] += 1
        if math.isnan(r.done_s):
            continue
        b = min(bins - 1, max(0, int(r.done_s // bin_s)))
        if r.error is not None:
            errors[b] += 1
            continue
        completed[b] += 1
        tokens[b] += r.output_tokens
        if r.prompt_tokens and r.cached_tokens is not None:
            prompt[b] += r.prompt_tokens
            cached[b] += r.cached_tokens
    rows = []
    for i in range(bins):
        width = bin_s if i < bins - 1 else end - i * bin_s
        if width <= 0:  # a run whose every event is at 0
            width = bin_s
        rows.append(
            {
                "t_s": round(i * bin_s, 6),
                "width_s": round(width, 6),
                "sent": int(sent[i]),
                "completed": int(completed[i]),
                "sent_per_s": float(sent[i] / width),
                "completed_per_s": float(completed[i] / width),
                "output_tokens_per_s": float(tokens[i] / width),
                "errors": int(errors[i]),
                "server_hit_rate": float(cached[i] / prompt[i]) if prompt[i] else None,
            }
        )
    return rows
