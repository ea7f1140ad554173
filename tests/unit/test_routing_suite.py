"""``benchmarks/routing_suite.py`` on a tiny configuration: loads found by the rule, every router
x workload x load cell filled over the seeds, and the loads reused from a previous output."""

from __future__ import annotations

import json
from types import ModuleType

import pytest

from tests.support import load_benchmark


@pytest.fixture(scope="module")
def suite() -> ModuleType:
    return load_benchmark("routing_suite")


TINY = [
    "--workloads", "to-b,rag", "--routers", "round_robin,kv_ttft", "--seeds", "2",
    "--requests", "40", "--bisect-requests", "30", "--bisect-steps", "1", "--instances", "2",
    "--jobs", "1",
]  # fmt: skip


def test_suite_runs_tiny_and_reuses_its_loads(suite, tmp_path, capsys):
    out = tmp_path / "suite.json"
    assert suite.main([*TINY, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert json.loads(out.read_text()) == doc
    assert "to-b L1" in captured.err and "kv_ttft" in captured.err  # the table
    for w in ("to-b", "rag"):
        ld = doc["loads"][w]
        assert ld["idle_p50_ms"] > 0 and ld["probes"]
        assert ld["l2_scale"] == pytest.approx(1.5 * ld["l1_scale"], rel=1e-3)
        lo, hi = ld["bracket"]
        assert lo <= ld["l1_scale"] <= hi
        for load in ("L1", "L2"):
            for r in ("round_robin", "kv_ttft"):
                cell = doc["results"][w][load][r]
                assert set(suite.METRICS) <= set(cell)
                for m in ("ttft_p50_ms", "ttft_p99_ms", "excess_mean_ms", "hit_rate"):
                    s = cell[m]
                    assert len(s["seeds"]) == 2 and s["min"] <= s["mean"] <= s["max"]
                assert cell["completed"] == [40, 40]
                assert cell["ttft_p50_ms"]["mean"] <= cell["ttft_p99_ms"]["mean"]
    # a second run with --loads searches nothing and keeps the loads; its engines report the
    # queued prefill still to schedule, not kvroute's vLLM engine's count (the default)
    assert (
        suite.main([*TINY, "--loads", str(out), "--engine", "queued_until_first_token=false"]) == 0
    )
    captured = capsys.readouterr()
    again = json.loads(captured.out)
    assert again["loads"] == doc["loads"]
    assert again["meta"]["engine"] == {"queued_until_first_token": False}
    assert doc["meta"]["engine"] == {}
    assert "searching" not in captured.err and "16 simulations" in captured.err


def test_a_trace_file_is_a_workload(suite, tmp_path, capsys):
    """A Mooncake-layout trace the suite does not know, by path: its load searched by the rule
    and every cell filled, keyed by the resolved path."""
    trace = tmp_path / "held_out.jsonl"
    lines = []
    for i in range(60):  # 6 conversations of 10 turns, each turn one more block of history
        conv, turn = i % 6, i // 6
        ids = [1000 * conv + k for k in range(turn + 2)]
        lines.append(
            json.dumps(
                {"timestamp": 250 * i, "input_length": 512 * len(ids) - 100,
                 "output_length": 20, "hash_ids": ids}
            )
        )  # fmt: skip
    trace.write_text("\n".join(lines) + "\n")
    args = [*TINY[2:], "--workloads", f"to-b,{trace}"]
    assert suite.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    key = str(trace.resolve())
    assert set(doc["results"]) == {"to-b", key}
    assert doc["loads"][key]["l1_scale"] > 0
    for load in ("L1", "L2"):
        cell = doc["results"][key][load]["kv_ttft"]
        assert cell["completed"] == [40, 40]
        assert cell["hit_rate"]["mean"] > 0  # the later turns find their history


def test_suite_flags_name_the_bad_value(suite, capsys, tmp_path):
    assert suite.main(["--workloads", "to-b,chat"]) == 2
    assert "--workloads: unknown chat" in capsys.readouterr().err
    assert suite.main(["--workloads", "/nonexistent/t.jsonl"]) == 2
    assert "--workloads: no trace file '/nonexistent/t.jsonl'" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert suite.main(["--workloads", str(bad)]) == 2
    assert f"--workloads: cannot read trace {str(bad)!r}" in capsys.readouterr().err
    assert suite.main(["--routers", "nope"]) == 2
    assert "--router nope: router: unknown scorer 'nope'" in capsys.readouterr().err
    assert suite.main(["--loads", "/nonexistent/x.json"]) == 2
    assert "--loads: cannot read" in capsys.readouterr().err
    for option, message in (
        ("gpu_blocks=3", "--engine: unknown option 'gpu_blocks'"),
        ("queued_until_first_token=yes", "--engine: queued_until_first_token must be true or"),
        ("queued_until_first_token", "--engine: expected KEY=VALUE"),
    ):
        assert suite.main(["--engine", option]) == 2
        assert message in capsys.readouterr().err
