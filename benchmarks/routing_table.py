"""The routing suite's results as text (``benchmarks/routing_suite.py`` prints it on stderr):
a block per workload and load, a row per router, each metric as its mean (min-max) over the
seeds."""

from __future__ import annotations

from typing import Any

import numpy as np


def _cell(s: dict[str, Any], digits: int) -> str:
    if s["mean"] is None:
        return "-"
    f = f"{{:,.{digits}f}}"
    if s["min"] == s["max"]:
        return f.format(s["mean"])
    return f"{f.format(s['mean'])} ({f.format(s['min'])}-{f.format(s['max'])})"


def table(doc: dict[str, Any]) -> str:
    """The results as text: one block per workload and load, a row per router."""
    cols = [
        ("TTFT p50", "ttft_p50_ms", 0),
        ("TTFT p99", "ttft_p99_ms", 0),
        ("excess mean", "excess_mean_ms", 0),
        ("excess p99", "excess_p99_ms", 0),
        ("TPOT p99", "tpot_p99_ms", 1),
        ("hit", "hit_rate", 3),
        ("goodput/s", "goodput_rps", 2),
        ("max/min req", "spread", 2),
    ]
    lines = []
    for w, by_load in doc["results"].items():
        ld = doc["loads"][w]
        for load, rows in by_load.items():
            scale = ld["l1_scale"] if load == "L1" else ld["l2_scale"]
            span = doc["meta"].get("arrival_span_s", {}).get(w, {}).get(load)
            lines.append(
                f"\n{w} {load} (rate scale {scale:g}; round_robin idle p50 "
                f"{ld['idle_p50_ms']:g} ms"
                + (f"; arrivals over {np.mean(span):.1f} s" if span else "")
                + ")"
            )
            cells = [["router", *(c[0] for c in cols)]]
            for r, row in rows.items():
                cells.append([r, *(_cell(row[k], d) for _, k, d in cols)])
            widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
            for c in cells:
                lines.append(
                    "  ".join(
                        x.ljust(wd) if i == 0 else x.rjust(wd)
                        for i, (x, wd) in enumerate(zip(c, widths, strict=True))
                    )
                )
    m = doc["meta"]
    lines.append(
        f"\nms; mean (min-max) over {m['seeds']} seeds; {m['requests_per_run']} requests a run, "
        f"{m['instances']} x {m['profile']}; goodput at TTFT <= {m['slo_ttft_ms']:g} ms and "
        f"TPOT <= {m['slo_tpot_ms']:g} ms; wall {m['wall_s']:g} s"
    )
    return "\n".join(lines)
