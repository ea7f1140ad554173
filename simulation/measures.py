"""What a simulated run's records measure against its targets: the share of requests that met
the SLOs (``slo_attainment``) and each request's TTFT over its ideal (``excess_ttfts``).
``kvroute simulate`` reports both, and the benchmarks score their runs with them."""

from __future__ import annotations

import math
from typing import Any


def slo_attainment(records: Any, slo_ttft_s: float, slo_tpot_s: float | None) -> float:
    """The fraction of all requests completed with TTFT <= ``slo_ttft_s`` and mean TPOT <=
    ``slo_tpot_s`` (refused and unfinished requests miss; one output token has no TPOT)."""
    met = [r.meets(slo_ttft_s, slo_tpot_s) for r in records]
    return sum(met) / len(met) if met else math.nan


def excess_ttfts(records: Any, ideal_s: list[float]) -> list[float]:
    """Each completed request's TTFT over its ideal (``simulation.settings.ideal_ttfts``, indexed
    as the plan), in seconds; refused and unfinished requests have none."""
    return [
        r.ttft_s - ideal_s[r.index] for r in records if r.ok and not math.isnan(ideal_s[r.index])
    ]


def flapping(
    targets: list[tuple[float, int, str]],
    cold_start_s: float,
    duration_s: float,
    period_s: float = 0.0,
) -> dict[str, Any]:
    """How an autoscaled run's target moved (``targets``: the run's ``(time, target, why)``
    changes, the first its start; ``duration_s``: the run's length): ``direction_changes`` (an
    up after a down or a down after an up), per hour, the most in any 60 minutes
    (``max_in_an_hour``), per cycle where the day has one (``period_s``), and
    ``quick_reversals``: scale-downs less than one ``cold_start_s`` after the scale-up they
    reverse (the engines it started still starting)."""
    flips: list[float] = []
    quick, last_up, prev_n, prev_way = 0, -math.inf, None, 0
    for t, n, _ in targets:
        if prev_n is not None and n != prev_n:
            way = 1 if n > prev_n else -1
            if prev_way and way != prev_way:
                flips.append(t)
            if way < 0 and t - last_up < cold_start_s:
                quick += 1
            if way > 0:
                last_up = t
            prev_way = way
        prev_n = n
    most, j = 0, 0
    for i, t in enumerate(flips):
        while flips[j] <= t - 3600:
            j += 1
        most = max(most, i - j + 1)
    out: dict[str, Any] = {
        "direction_changes": len(flips),
        "per_hour": round(len(flips) / max(duration_s / 3600, 1e-9), 2),
        "max_in_an_hour": most,
        "quick_reversals": quick,
    }
    if period_s > 0:
        out["per_cycle"] = round(len(flips) / max(duration_s / period_s, 1.0), 2)
    return out
