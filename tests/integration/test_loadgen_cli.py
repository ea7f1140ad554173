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
from tests.support import Server, free_port, sim_stack

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve_in_thread(NullServer(model="tiny")) as u:
        yield u


SIM_KEY = "loadgen-test-key"


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    """kvroute's own ingress (in process, no Ray) over two sim engines of the built-in tiny
    model, as ``kvroute serve`` runs them (512-token vocabulary, 4k context), keyed."""
    stack = sim_stack(max_model_len=4096, api_keys=frozenset({SIM_KEY}))
    with Server(stack, free_port()) as s:
        yield f"http://127.0.0.1:{s.port}"


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
        (["--workload", "to-c", "--header", "Authorization Bearer k"], "--header"),
        (["--workload", "to-c", "--header", "Bad Name: v"], "--header"),
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


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_default_to_b_run_fits_the_tiny_model(
    sim_url: str,
    api: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The default to-b workload against the defaults of ``kvroute serve``: token ids fitted into
    the tiny model's 512-token vocabulary, prompts into its context; no request refused. The key
    comes from $OPENAI_API_KEY; the fitting is said in one line."""
    monkeypatch.setenv("OPENAI_API_KEY", SIM_KEY)
    out_json = tmp_path / "run.json"
    rc = main(
        ["loadgen", "--url", sim_url, "--workload", "to-b", "--api", api, "--rate", "10",
         "--duration", "4", "--no-progress", "--json", str(out_json)]
    )  # fmt: skip
    err = capsys.readouterr().err
    doc = json.loads(out_json.read_text())
    s = doc["summary"]
    assert s["errors"] == {}, s["error_messages"]
    assert rc == 0 and s["completed"] == s["requests"] > 10
    fitted = [line for line in err.splitlines() if line.startswith("loadgen: fitted")]
    assert len(fitted) == 1
    assert ("vocabulary is 512" if api == "completions" else "context of 4096") in fitted[0]
    assert SIM_KEY not in json.dumps(doc["meta"])


def test_header_carries_the_key_and_failures_are_explained(
    sim_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--header`` sends a key; a run whose requests fail prints their status and the server's
    message, grouped, on the terminal (here: the sim engine has no logprobs)."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    rc = main(
        ["loadgen", "--url", sim_url, "--header", f"Authorization: Bearer {SIM_KEY}",
         "--workload", "random", "--rate", "20", "--duration", "0.5", "--no-progress",
         "--extra-body", '{"logprobs": 2}']
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 1
    lines = [line for line in out.splitlines() if " x http_400: " in line]
    assert len(lines) == 1 and "logprobs" in lines[0], out
    assert lines[0].split(" x ")[0].strip() == "10"


def test_keyed_endpoint_without_a_key_is_a_one_line_error(
    sim_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    rc = main(["loadgen", "--url", sim_url, "--workload", "random", "--duration", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0
    assert "401" in err and "--api-key" in err


@pytest.mark.parametrize("command", ["loadgen", "simulate", "plan"])
def test_unwritable_report_dir_fails_before_the_run(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--report`` under a file: a one-line error naming the flag, before anything runs (the
    loadgen URL answers nothing; the simulation is not started)."""
    afile = tmp_path / "file"
    afile.write_text("")
    argv = [command, "--workload", "random", "--duration", "1", "--report", str(afile / "r")]
    if command == "loadgen":
        argv += ["--url", "http://127.0.0.1:9", "--model", "m"]
    if command == "plan":
        argv += ["--slo-ttft-ms", "500"]
    rc = main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2 and err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith(f"kvroute {command}: error: --report:")
    assert captured.out == ""
