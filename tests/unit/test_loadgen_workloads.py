"""Trace parsing (both formats, bad lines), schedules, session links, synthetic workloads."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate
from loadgen.traces import TraceFormatError, TraceRequest, load_trace
from loadgen.workloads import arrival_offsets, build_schedule, ideal_hit_rate, link_sessions

MOONCAKE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation.jsonl"


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def bailian_rows() -> list[dict[str, Any]]:
    return [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 40,
         "output_length": 8, "type": "text", "turn": 1, "hash_ids": [1, 2, 3]},
        {"chat_id": 2, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 20,
         "output_length": 4, "type": "api", "turn": 1, "hash_ids": [7, 8]},
        {"chat_id": 3, "parent_chat_id": 1, "timestamp": 2.0, "input_length": 70,
         "output_length": 8, "type": "text", "turn": 2, "hash_ids": [1, 2, 4, 5, 6]},
    ]  # fmt: skip


def test_mooncake_and_bailian_parse(tmp_path: Path) -> None:
    m = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 1500, "input_length": 512, "output_length": 0, "hash_ids": [0]},
        ],
    )
    tm = load_trace(m)
    assert tm.format == "mooncake" and tm.block_size == 512
    assert [r.timestamp_s for r in tm.requests] == [0.0, 1.5]
    tb = load_trace(write_jsonl(tmp_path / "b.jsonl", bailian_rows()))
    assert tb.format == "bailian" and tb.block_size == 16
    third = tb.requests[2]
    assert (third.chat_id, third.parent_chat_id, third.turn, third.category) == (3, 1, 2, "text_2")
    assert tb.requests[0].parent_chat_id is None


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0]}, "hash_ids"),
        (
            {"timestamp": 0, "input_length": "6", "output_length": 5, "hash_ids": [0]},
            "input_length",
        ),
        ({"timestamp": -1, "input_length": 6, "output_length": 5, "hash_ids": [0]}, "timestamp"),
        ({"input_length": 6, "output_length": 5, "hash_ids": [0]}, "timestamp"),
        ({"timestamp": 5, "input_length": 6, "output_length": 5, "hash_ids": [0.5]}, "hash_ids"),
        ("{not json", "<line>"),
    ],
)
def test_bad_line_names_file_line_and_field(tmp_path: Path, row: Any, field: str) -> None:
    good = {"timestamp": 0, "input_length": 6, "output_length": 5, "hash_ids": [0]}
    path = write_jsonl(tmp_path / "t.jsonl", [good, row, good | {"timestamp": 9}])
    with pytest.raises(TraceFormatError) as e:
        load_trace(path, "mooncake")
    assert (e.value.line, e.value.field) == (2, field)
    assert str(path) in str(e.value) and ":2:" in str(e.value)
    trace = load_trace(path, "mooncake", skip_invalid=True)
    assert trace.skipped == 1 and len(trace.requests) == 2


def test_time_going_back_is_rejected(tmp_path: Path) -> None:
    rows = bailian_rows()
    rows[2]["timestamp"] = 0.1
    with pytest.raises(TraceFormatError, match="goes back in time") as e:
        load_trace(write_jsonl(tmp_path / "b.jsonl", rows))
    assert e.value.line == 3


def test_schedule_time_scale_duration_and_max_requests() -> None:
    reqs = [TraceRequest(t, 16, 1, (i,)) for i, t in enumerate([10.0, 10.0, 11.0, 13.0, 20.0])]
    plan = build_schedule(reqs, time_scale=0.5)
    assert [p.offset_s for p in plan] == [0.0, 0.0, 0.5, 1.5, 5.0]
    assert len(build_schedule(reqs, time_scale=0.5, duration_s=1.5)) == 3
    assert len(build_schedule(reqs, max_requests=2)) == 2
    with pytest.raises(ValueError, match="--time-scale"):
        build_schedule(reqs, time_scale=0)
    with pytest.raises(ValueError, match="--max-requests"):
        build_schedule(reqs, max_requests=0)


def test_rate_override_constant_and_poisson() -> None:
    const = arrival_offsets(101, 50.0, "constant", 0)
    assert np.allclose(np.diff(const), 0.02) and const[0] == 0
    pois = arrival_offsets(20_001, 100.0, "poisson", 1)
    gaps = np.diff(pois)
    assert abs(gaps.mean() - 0.01) < 0.0005
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # exponential: CV = 1
    assert np.array_equal(pois, arrival_offsets(20_001, 100.0, "poisson", 1))
    reqs = [TraceRequest(0.0, 16, 1, (i,)) for i in range(10)]
    plan = build_schedule(reqs, rate=5.0, arrival="constant")
    assert [p.req.hash_ids for p in plan] == [r.hash_ids for r in reqs]
    assert plan[-1].offset_s == pytest.approx(1.8)
    with pytest.raises(ValueError, match="--rate"):
        arrival_offsets(3, -1.0, "constant", 0)
    with pytest.raises(ValueError, match="--arrival"):
        arrival_offsets(3, 1.0, "bursty", 0)


def test_sessions_link_to_parent_index(tmp_path: Path) -> None:
    trace = load_trace(write_jsonl(tmp_path / "b.jsonl", bailian_rows()))
    plan = build_schedule(trace.requests)
    assert [p.parent for p in plan] == [None, None, 0]
    # a parent outside the schedule (cut by max-requests) leaves the turn unlinked
    assert [p.parent for p in link_sessions(plan[2:])] == [None]


def test_ideal_hit_rate_matches_the_traces_readme() -> None:
    if not MOONCAKE.exists():
        pytest.skip("shared Mooncake trace not present")
    trace = load_trace(MOONCAKE)
    blocks, tokens = ideal_hit_rate(trace.requests, trace.block_size)
    assert round(blocks, 3) == 0.366
    assert 0.3 < tokens < 0.45


def test_ideal_hit_rate_small() -> None:
    reqs = [TraceRequest(0, 40, 1, (1, 2, 3)), TraceRequest(1, 36, 1, (1, 2, 9))]
    blocks, tokens = ideal_hit_rate(reqs, 16)
    assert blocks == pytest.approx(2 / 6)
    assert tokens == pytest.approx(32 / 76)


@pytest.mark.parametrize("kind", ["to-c", "to-b", "mix", "random"])
def test_synthetic_workloads_are_valid_traces(kind: str) -> None:
    p = SynthParams(rate=20, duration_s=30, think_time_s=3, seed=5)
    reqs = generate(kind, p)
    assert 400 < len(reqs) < 800
    ts = [r.timestamp_s for r in reqs]
    assert ts == sorted(ts) and ts[-1] < 30
    for r in reqs:
        assert len(r.hash_ids) == math.ceil(r.input_length / SYNTH_BLOCK_SIZE)
    assert generate(kind, p) == reqs  # seeded
    if kind != "random":
        chat_ids = [r.chat_id for r in reqs]
        assert len(set(chat_ids)) == len(chat_ids)


def test_to_c_turns_extend_the_conversation() -> None:
    reqs = generate("to-c", SynthParams(rate=10, duration_s=60, think_time_s=2, turns_mean=4))
    by_chat = {r.chat_id: r for r in reqs}
    children = [r for r in reqs if r.parent_chat_id is not None]
    assert len(children) > len(reqs) / 2
    for child in children:
        if child.parent_chat_id not in by_chat:
            continue  # session began before the window
        parent = by_chat[child.parent_chat_id]
        assert child.turn == parent.turn + 1
        assert child.timestamp_s >= parent.timestamp_s
        assert child.input_length > parent.input_length + parent.output_length
        full = parent.input_length // SYNTH_BLOCK_SIZE
        assert child.hash_ids[:full] == parent.hash_ids[:full]
        assert not set(child.hash_ids[full:]) & set(parent.hash_ids)
    blocks, _ = ideal_hit_rate(reqs, SYNTH_BLOCK_SIZE)
    assert blocks > 0.4


def test_to_b_programs_share_system_prompts() -> None:
    p = SynthParams(rate=50, duration_s=20, programs=4, zipf_s=1.0)
    reqs = generate("to-b", p)
    firsts = {r.hash_ids[0] for r in reqs}
    assert len(firsts) == 4
    assert all(r.turn == 1 and r.parent_chat_id is None and r.type == "api" for r in reqs)
    counts = sorted((sum(r.hash_ids[0] == f for r in reqs) for f in firsts), reverse=True)
    assert counts[0] > counts[-1]  # Zipf popularity


def test_mix_fraction() -> None:
    reqs = generate("mix", SynthParams(rate=40, duration_s=60, to_b_fraction=0.25))
    api = sum(r.type == "api" for r in reqs) / len(reqs)
    assert 0.15 < api < 0.35


def test_synthetic_bad_parameters_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--to-b-fraction"):
        generate("mix", SynthParams(to_b_fraction=1.5))
    with pytest.raises(ValueError, match="--workload"):
        generate("chatty", SynthParams())
