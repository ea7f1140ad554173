"""Run outputs: ``--json FILE`` (summary + per-request records), ``--report DIR`` (CSV files and
PNG plots) and the summary table on the terminal."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.metrics import PERCENTILE_KEYS, timeseries
from loadgen.records import RequestRecord

PLOTS: tuple[str, ...] = (
    "ttft_cdf.png",
    "itl_cdf.png",
    "throughput.png",
    "hit_rate.png",
    "send_lag.png",
)


def _ms(x: float) -> float | None:
    return None if math.isnan(x) else round(x * 1e3, 4)


def _s(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 6)


def record_row(r: RequestRecord) -> dict[str, Any]:
    return {
        "index": r.index,
        "category": r.category,
        "chat_id": r.chat_id,
        "input_tokens": r.input_tokens,
        "max_tokens": r.max_tokens,
        "intended_s": _s(r.intended_s),
        "sent_s": _s(r.sent_s),
        "scheduled_s": _s(r.scheduled_s),
        "first_token_s": _s(r.first_token_s),
        "done_s": _s(r.done_s),
        "ttft_ms": _ms(r.ttft_s) if r.ok else None,
        "e2e_ms": _ms(r.e2e_s) if r.ok else None,
        "itl_mean_ms": _ms(r.tpot_s),
        "send_lag_ms": _ms(r.send_lag_s),
        "output_tokens": r.output_tokens,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "status": r.status,
        "error": r.error,
        "cap_delayed": r.cap_delayed,
        "error_detail": r.error_detail,
        "instance": r.instance,
        "cpu_cached_tokens": r.cpu_cached_tokens,
        "preemptions": r.preemptions,
    }


def record_from_row(row: dict[str, Any]) -> RequestRecord:
    """A record back from ``record_row``'s dict (a ``--json`` file's ``records``); per-token
    gaps come back where the row kept them (``itl_ms``)."""

    def s(key: str) -> float:
        v = row.get(key)
        return math.nan if v is None else float(v)

    return RequestRecord(
        row["index"],
        row["category"],
        row["chat_id"],
        row["input_tokens"],
        row["max_tokens"],
        s("intended_s"),
        sent_s=s("sent_s"),
        scheduled_s=s("scheduled_s"),
        first_token_s=s("first_token_s"),
        done_s=s("done_s"),
        output_tokens=row.get("output_tokens") or 0,
        prompt_tokens=row.get("prompt_tokens"),
        cached_tokens=row.get("cached_tokens"),
        itl_s=[g / 1e3 for g in row.get("itl_ms") or ()],
        error=row.get("error"),
        error_detail=row.get("error_detail"),
        status=row.get("status") or 0,
        cap_delayed=bool(row.get("cap_delayed")),
        instance=row.get("instance"),
        cpu_cached_tokens=row.get("cpu_cached_tokens"),
        preemptions=row.get("preemptions") or 0,
    )


# the columns of requests.csv: record_row's keys (also for a run with no records)
RECORD_FIELDS: tuple[str, ...] = tuple(record_row(RequestRecord(0, "", None, 0, 0, 0.0)))


def write_json(
    path: str | Path,
    summary: dict[str, Any],
    records: Sequence[RequestRecord],
    meta: dict[str, Any],
) -> None:
    rows = []
    for r in records:
        row = record_row(r)
        row["itl_ms"] = [round(g * 1e3, 4) for g in r.itl_s]
        rows.append(row)
    doc = {"meta": meta, "summary": summary, "records": rows}
    Path(path).write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")


def write_report(
    directory: str | Path,
    summary: dict[str, Any],
    records: Sequence[RequestRecord],
    meta: dict[str, Any],
) -> list[Path]:
    """Write summary.json, requests.csv, timeseries.csv and the PNG plots; returns the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "summary.json", out / "requests.csv", out / "timeseries.csv"]
    written[0].write_text(json.dumps({"meta": meta, "summary": summary}, indent=1) + "\n")
    _write_csv(written[1], [record_row(r) for r in records], RECORD_FIELDS)
    series = timeseries(records)
    _write_csv(written[2], series, tuple(series[0]) if series else ("t_s",))
    written += _plots(out, records, series, summary)
    return written


def _write_csv(path: Path, rows: list[dict[str, Any]], fields: Sequence[str]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fields))
        w.writeheader()
        w.writerows(rows)


def _cdf(ax: Any, values_ms: np.ndarray, label: str) -> None:
    if values_ms.size:
        xs = np.sort(values_ms)
        ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=label)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)


def _plots(
    out: Path,
    records: Sequence[RequestRecord],
    series: list[dict[str, Any]],
    summary: dict[str, Any],
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.ok]
    sent = [r for r in records if not math.isnan(r.sent_s)]
    # each bin's rate at the bin's middle (the last bin may be up to 1.5 bins wide)
    t = np.array([row["t_s"] + row["width_s"] / 2 for row in series])
    paths = [out / name for name in PLOTS]

    def save(
        fig: Any, path: Path, title: str, x: str, y: str | None = None, legend: str | None = None
    ) -> None:
        """Label the plot's first axes (``legend``: where its legend goes), grid it, write it."""
        ax = fig.axes[0]
        ax.set_xlabel(x)
        if y is not None:
            ax.set_ylabel(y)
        if legend is not None:
            ax.legend(loc=legend)
        ax.grid(alpha=0.3)
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    _cdf(ax, np.array([r.ttft_s * 1e3 for r in ok]), "TTFT")
    if summary.get("slo_ttft_ms"):
        ax.axvline(summary["slo_ttft_ms"], color="red", ls="--", label="SLO")
    save(fig, paths[0], "Time to first token, CDF", "TTFT from intended send (ms)")

    fig, ax = plt.subplots(figsize=(7, 4))
    _cdf(ax, np.array([g * 1e3 for r in ok for g in r.itl_s]), "ITL")
    if summary.get("slo_itl_ms"):
        ax.axvline(summary["slo_itl_ms"], color="red", ls="--", label="SLO")
    save(fig, paths[1], "Inter-token latency, CDF", "inter-token latency (ms)")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(t, [row["sent_per_s"] for row in series], label="sent req/s")
    ax.plot(t, [row["completed_per_s"] for row in series], label="completed req/s")
    ax2 = ax.twinx()
    ax2.plot(t, [row["output_tokens_per_s"] for row in series], color="gray", alpha=0.6)
    ax2.set_ylabel("output tokens/s")
    save(fig, paths[2], "Throughput over time", "time (s)", "requests/s", "upper left")

    fig, ax = plt.subplots(figsize=(7, 4))
    hr = [row["server_hit_rate"] for row in series]
    ax.plot(t, [np.nan if h is None else h for h in hr], label="server (usage.cached_tokens)")
    if summary.get("ideal_hit_rate_tokens") is not None:
        ax.axhline(summary["ideal_hit_rate_tokens"], color="green", ls="--", label="trace ideal")
    ax.set_ylim(0, 1.01)
    save(
        fig, paths[3], "Cache hit rate over time", "time (s)", "prompt tokens cached", "lower right"
    )

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r.intended_s for r in sent], [r.send_lag_s * 1e3 for r in sent], ".", ms=2)
    save(fig, paths[4], "Send lag (actual - intended)", "intended send time (s)", "send lag (ms)")
    return paths


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}"


def print_summary(summary: dict[str, Any], file: Any = None) -> None:
    """The terminal table (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file, width=100)
    s = summary
    head = Table(show_header=False, box=None, pad_edge=False)
    head.add_row("requests", f"{s['sent']:,} sent / {s['requests']:,} planned")
    head.add_row("completed / failed", f"{s['completed']:,} / {s['failed']:,}")
    head.add_row(
        "rate req/s",
        f"{_fmt(s['achieved_rate'], 2)} achieved vs {_fmt(s['requested_rate'], 2)} requested",
    )
    head.add_row(
        "throughput",
        f"{_fmt(s['completed_rate'], 2)} req/s, {_fmt(s['output_tokens_per_s'], 0)} output tok/s",
    )
    slo = [
        f"TTFT <= {s['slo_ttft_ms']} ms" if s["slo_ttft_ms"] is not None else "",
        f"ITL <= {s['slo_itl_ms']} ms" if s["slo_itl_ms"] is not None else "",
    ]
    slo_text = ", ".join(x for x in slo if x) or "no SLO"
    head.add_row("goodput", f"{_fmt(s['goodput_rps'], 2)} req/s ({slo_text})")
    hit = s["server_hit_rate"]
    ideal = s["ideal_hit_rate_tokens"]
    head.add_row(
        "cache hit rate",
        f"server {_fmt(hit and hit * 100)}%  vs  trace ideal "
        f"{_fmt(ideal and ideal * 100)}% (infinite cache)",
    )
    if s["cap_delayed"]:
        head.add_row("in-flight cap", f"delayed {s['cap_delayed']:,} sends")
    errs = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"
    head.add_row("errors", errs)
    console.print(head)
    for group in s.get("error_messages") or ():
        # NOTE: why requests failed, on the terminal (requests.csv has every one); markup off,
        # a server's message may hold brackets
        message = group["message"].replace("\n", " ")[:200] or "(no message)"
        console.print(
            f"  {group['count']:,} x {group['error']}: {message}", markup=False, highlight=False
        )
    table = Table(title=None)
    table.add_column("ms")
    for col in PERCENTILE_KEYS:
        table.add_column(col, justify="right")
    for name, key in (
        ("TTFT", "ttft_ms"),
        ("ITL", "itl_ms"),
        ("E2E", "e2e_ms"),
        ("send lag", "send_lag_ms"),
    ):
        table.add_row(name, *(_fmt(s[key][c], 2) for c in PERCENTILE_KEYS))
    console.print(table)
