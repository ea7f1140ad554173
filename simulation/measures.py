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
