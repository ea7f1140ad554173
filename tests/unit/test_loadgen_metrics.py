"""Summary statistics over hand-built records: percentiles, rates, goodput, hit rates, errors."""

from __future__ import annotations

import math

import pytest

from loadgen.metrics import error_groups, percentiles_ms, summarize, timeseries
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
    done.scheduled_s = 1.61  # as the simulator records it
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
        assert back.scheduled_s == pytest.approx(rec.scheduled_s, nan_ok=True)
        assert back.tpot_s == pytest.approx(rec.tpot_s, nan_ok=True)


def test_timeseries_last_bin_is_its_real_width_and_never_a_sliver() -> None:
    """A steady 4 req/s whose last request finishes 10 ms into a new second: the old series
    divided that one request (and its tokens) by a 10 ms bin, a 100 req/s spike that dwarfed
    the run; the sliver now joins the bin before it, and every rate is its count over the
    bin's real width."""
    records = [rec(i * 0.25, 0.05, [0.05]) for i in range(12)]  # sends 0 .. 2.75
    records[-1].done_s = 3.01  # the last one finishes just past 3 s
    rows = timeseries(records)
    assert [r["t_s"] for r in rows] == [0.0, 1.0, 2.0]
    assert [r["width_s"] for r in rows] == pytest.approx([1.0, 1.0, 1.01])
    assert [r["sent"] for r in rows] == [4, 4, 4]
    assert [r["completed"] for r in rows] == [4, 4, 4]
    assert [r["completed_per_s"] for r in rows] == pytest.approx([4.0, 4.0, 4 / 1.01])
    assert max(r["output_tokens_per_s"] for r in rows) == pytest.approx(8.0)
    # a remainder of half a bin or more stays a bin of its own, divided by its width
    records[-1].done_s = 3.6
    rows = timeseries(records)
    assert [r["width_s"] for r in rows] == pytest.approx([1.0, 1.0, 1.0, 0.6])
    assert rows[-1]["completed_per_s"] == pytest.approx(1 / 0.6)
    # a failed request's finish ends the series too
    late = RequestRecord(99, "all", None, 32, 4, 2.9, sent_s=2.9, done_s=5.8, error="timeout")
    rows = timeseries([*records, late])
    assert rows[-1]["t_s"] == 5.0 and rows[-1]["errors"] == 1
    assert sum(r["errors"] for r in rows) == 1


def test_error_groups_by_kind_and_message() -> None:
    def failed(i: int, kind: str, detail: str | None) -> RequestRecord:
        return RequestRecord(i, "all", None, 8, 4, 0.0, error=kind, error_detail=detail)

    vocab = (
        '{"error":{"message":"token id %d is outside the vocabulary (size 512)","param":"prompt"}}'
    )
    records = [
        rec(0, 0.1, [0.1]),
        *(failed(i, "http_400", vocab % (1000 + i)) for i in range(1, 5)),
        failed(5, "http_400", '{"error":{"message":"logprobs are not supported"}}'),
        failed(6, "timeout", "TimeoutError: "),
        failed(7, "http_503", "upstream down"),
        failed(8, "timeout", "TimeoutError: "),
    ]
    groups = error_groups(records)
    assert groups[0] == {
        "error": "http_400",
        "count": 4,
        "message": "token id 1001 is outside the vocabulary (size 512)",
    }
    assert [(g["error"], g["count"]) for g in groups[1:]] == [
        ("timeout", 2), ("http_400", 1), ("http_503", 1)
    ]  # fmt: skip
    assert groups[3]["message"] == "upstream down"
    assert error_groups(records, limit=2) == groups[:2]
    s = summarize(records, duration_s=1.0, requested_span_s=1.0)
    assert s["error_messages"] == groups


def test_a_record_meets_the_slo_on_ttft_and_on_tpot_where_it_has_one() -> None:
    fast = rec(0, 0.5, [0.02, 0.02])
    assert fast.meets(1.0) and fast.meets(1.0, 0.05)
    assert not fast.meets(0.4)  # its TTFT
    assert not fast.meets(1.0, 0.01)  # its TPOT
    one = rec(1, 0.5, [])  # one output token: no TPOT to miss
    assert math.isnan(one.tpot_s) and one.meets(1.0, 0.001)
    failed = RequestRecord(2, "all", None, 32, 4, intended_s=1.0, error="http_500")
    assert not failed.meets(100.0)
