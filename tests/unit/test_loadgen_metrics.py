"""Summary statistics over hand-built records: percentiles, rates, goodput, hit rates, errors."""

from __future__ import annotations

import math

import pytest

from loadgen.metrics import percentiles_ms, summarize, timeseries
from loadgen.records import RequestRecord


def rec(i: float, ttft: float, itl: list[float], **kw: object) -> RequestRecord:
    r = RequestRecord(int(i), "all", None, 32, 4, intended_s=i)
    r.sent_s = i + 0.001
    r.first_token_s = i + ttft
    r.itl_s = itl
    r.done_s = r.first_token_s + sum(itl)
    r.output_tokens = len(itl) + 1
    r.prompt_tokens, r.cached_tokens = 32, 16
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_percentiles() -> None:
    p = percentiles_ms([i / 1000 for i in range(1, 1001)])
    assert p["p50"] == pytest.approx(500.5)
    assert p["p99"] == pytest.approx(990.01)
    assert p["max"] == 1000.0
    assert percentiles_ms([])["p50"] is None


def test_summary_rates_goodput_hits_and_errors() -> None:
    records = [rec(i * 0.1, 0.05 if i % 2 else 0.5, [0.01, 0.02]) for i in range(10)]
    records[3] = rec(0.3, 0.05, [0.2, 0.2])  # slow decode
    failed = RequestRecord(10, "all", None, 32, 4, intended_s=1.0)
    failed.sent_s, failed.done_s, failed.error = 1.001, 1.2, "http_503"
    unsent = RequestRecord(11, "all", None, 32, 4, intended_s=1.1)
    s = summarize(
        [*records, failed, unsent],
        duration_s=2.0,
        requested_span_s=1.1,
        slo_ttft_ms=100,
        slo_itl_ms=50,
        ideal_hit_rate=(0.4, 0.45),
    )
    assert s["requests"] == 12 and s["sent"] == 11 and s["completed"] == 10
    assert s["errors"] == {"http_503": 1, "not_sent": 1}
    assert s["requested_rate"] == pytest.approx(10.0)
    assert s["achieved_rate"] == pytest.approx(10.0)
    # odd i meet the TTFT SLO (5 of them); i=3 breaks the ITL SLO
    assert s["good_requests"] == 4 and s["goodput_rps"] == pytest.approx(2.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(275.0)
    assert s["send_lag_ms"]["max"] == pytest.approx(1.0)
    assert s["server_hit_rate"] == pytest.approx(0.5)
    assert s["ideal_hit_rate_tokens"] == 0.45
    assert s["output_tokens"] == 30


def test_timeseries_bins() -> None:
    records = [rec(i * 0.5, 0.1, [0.1]) for i in range(6)]
    rows = timeseries(records)  # sends at 0, 0.5, ..., 2.5; the last completes at 2.7
    assert [r["sent"] for r in rows] == [2, 2, 2]
    assert [r["completed"] for r in rows] == [2, 2, 2]
    # the last bin is 0.7 s wide
    assert [r["sent_per_s"] for r in rows] == pytest.approx([2.0, 2.0, 2 / 0.7])
    assert all(r["server_hit_rate"] == 0.5 for r in rows)
    assert math.isclose(rows[0]["output_tokens_per_s"], 4.0)


def test_record_rows_read_back_to_the_same_record() -> None:
    from loadgen.report import record_from_row, record_row

    done = RequestRecord(3, "text_2", 7, 120, 16, 1.5, sent_s=1.502, first_token_s=1.75)
    done.done_s, done.output_tokens, done.status = 2.25, 16, 200
    done.prompt_tokens, done.cached_tokens, done.itl_s = 120, 64, [0.03, 0.035]
    failed = RequestRecord(4, "all", None, 50, 8, 2.0, sent_s=2.0)
    failed.error, failed.error_detail, failed.status, failed.done_s = "http_429", "shed", 429, 2.0
    for rec in (done, failed):
        row = record_row(rec)
        row["itl_ms"] = [g * 1e3 for g in rec.itl_s]  # as loadgen's --json file keeps them
        back = record_from_row(row)
        assert record_row(back) == record_row(rec)
        assert back.ok == rec.ok
        assert back.tpot_s == pytest.approx(rec.tpot_s, nan_ok=True)
