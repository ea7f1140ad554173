"""``kvroute loadgen`` end to end against a real HTTP server: outputs and one-line errors."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.cli import main
from loadgen.nullserver import NullServer, serve_in_thread
from loadgen.report import PLOTS

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve_in_thread(NullServer(model="tiny")) as u:
        yield u


def bailian_trace(path: Path, sessions: int = 6) -> Path:
    rows, chat, hid = [], 0, 1000
    for s in range(sessions):
        parent, ids, ts = -1, [s], s * 0.05  # every session shares nothing but its own blocks
        for turn in range(1, 4):
            length = 16 * len(ids) + 16 * 2 - 3
            ids = [*ids, hid, hid + 1]
            hid += 2
            rows.append(
                {"chat_id": chat, "parent_chat_id": parent, "timestamp": round(ts, 3),
                 "input_length": length, "output_length": 4, "type": "text", "turn": turn,
                 "hash_ids": list(ids)}
            )  # fmt: skip
            parent, chat, ts = chat, chat + 1, ts + 0.2
            ids = ids[:-1]  # the partial last block is not shared with the next turn
    rows.sort(key=lambda r: r["timestamp"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_replay_writes_json_and_report(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = bailian_trace(tmp_path / "bailian.jsonl")
    out_json, report = tmp_path / "run.json", tmp_path / "report"
    rc = main(
        ["loadgen", "--url", url, "--trace", str(trace), "--json", str(out_json),
         "--report", str(report), "--slo-ttft-ms", "10000", "--slo-itl-ms", "10000"]
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    for needle in ("achieved", "TTFT", "ITL", "E2E", "p99.9", "goodput", "cache hit rate"):
        assert needle in printed
    doc = json.loads(out_json.read_text())
    s = doc["summary"]
    assert s["requests"] == s["completed"] == 18 and s["errors"] == {}
    assert doc["meta"]["model"] == "tiny"  # discovered from GET /v1/models
    assert len(doc["records"]) == 18
    assert {r["category"] for r in doc["records"]} == {"text_1", "text_2", "text_3"}
    assert s["good_requests"] == 18
    assert 0 < s["ideal_hit_rate_blocks"] < 1
    # the null server's infinite prefix cache (16-token blocks, like the trace) sees at least
    # the trace's ideal hits: it also caches the generated tokens
    assert s["server_hit_rate"] >= s["ideal_hit_rate_tokens"] - 1e-9 > 0
    for name in ("summary.json", "requests.csv", "timeseries.csv", *PLOTS):
        assert (report / name).stat().st_size > 0
    for name in PLOTS:
        assert (report / name).read_bytes()[:8] == PNG_MAGIC
    with (report / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 18 and all(float(r["ttft_ms"]) >= 0 for r in rows)
    with (report / "timeseries.csv").open() as f:
        series = list(csv.DictReader(f))
    assert sum(int(r["completed"]) for r in series) == 18


def test_synthetic_live_sessions_chat(url: str, tmp_path: Path) -> None:
    out_json = tmp_path / "run.json"
    rc = main(
        ["loadgen", "--url", url, "--model", "tiny", "--workload", "to-c", "--rate", "40",
         "--duration", "1.5", "--think-time-s", "0.2", "--api", "chat", "--sessions", "live",
         "--max-inflight", "8", "--json", str(out_json), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    s = json.loads(out_json.read_text())["summary"]
    assert s["completed"] == s["requests"] > 20


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--workload", "to-c", "--rate", "-3"], "--rate"),
        (["--workload", "nope"], "--workload"),
        (["--workload", "to-c", "--api", "grpc"], "--api"),
        (["--workload", "to-c", "--concurrency", "0"], "--concurrency"),
        (["--workload", "to-c", "--token-offset", "-1"], "--token-offset"),
        (["--trace", "/nonexistent/trace.jsonl", "--token-offset", "-1"], "--token-offset"),
        (["--workload", "to-c", "--extra-body", "[1]"], "--extra-body"),
        ([], "--trace FILE or --workload"),
        (["--trace", "/nonexistent/trace.jsonl"], "--trace"),
        (["--workload", "to-c", "--json", "/nonexistent/dir/run.json"], "--json"),
        (["--workload", "to-c", "--report", "/etc/hostname"], "--report"),
    ],
)
def test_bad_flags_give_one_line_errors(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["loadgen", "--url", "http://127.0.0.1:9", "--model", "m", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith("kvroute loadgen: error:") and needle in err


def test_bad_trace_line_names_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}
    bad = good | {"hash_ids": [0, 1, 2]}
    trace.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    rc = main(["loadgen", "--url", "http://127.0.0.1:9", "--model", "m", "--trace", str(trace)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0
    assert f"{trace}:2:" in err and "'hash_ids'" in err


def test_skip_invalid_counts_and_runs(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [0, 1]}
    lines = [json.dumps(good), "{broken", json.dumps(good | {"timestamp": 10})]
    trace.write_text("\n".join(lines) + "\n")
    rc = main(["loadgen", "--url", url, "--trace", str(trace), "--skip-invalid", "--rate", "50"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "skipped 1 invalid trace lines" in captured.err
    assert "2 sent / 2 planned" in captured.out


def test_unreachable_server_without_model_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc = main(["loadgen", "--url", "http://127.0.0.1:9", "--workload", "random", "--duration", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "--model" in err
