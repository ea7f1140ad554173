"""Trace parsing (JSONL and CSV formats, bad lines), schedules, session links, synthetic
workloads."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadgen.synthetic import BAILIAN_TYPES, SYNTH_BLOCK_SIZE, ChatType, SynthParams, generate
from loadgen.traces import PrefixModel, TraceFormatError, TraceRequest, load_trace
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


@pytest.mark.parametrize("kind", ["to-c", "to-b", "mix", "random", "agentic", "rag"])
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


def test_to_c_chat_types_have_their_own_prompt_turns_and_think_time() -> None:
    types = (ChatType("chat", 1.0, 100, 4.0, 2.0, 50), ChatType("lookup", 1.0, 64, 1.0, 30.0, 200))
    reqs = generate("to-c", SynthParams(rate=20, duration_s=300, seed=2, chat_types=types))
    by_type = {name: [r for r in reqs if r.type == name] for name in ("chat", "lookup")}
    assert len(reqs) == sum(map(len, by_type.values()))
    assert 0.9 < len(reqs) / (20 * 300) < 1.1  # ``rate`` counts requests, over all types
    # shares are per session: equal sessions, 4 requests a "chat" session to 1 a "lookup" one
    assert 0.74 < len(by_type["chat"]) / len(reqs) < 0.86
    # a type's full system-prompt blocks head every prompt of that type; the two share none
    heads = {
        name: {r.hash_ids[: n // SYNTH_BLOCK_SIZE] for r in rs}
        for (name, rs), n in zip(by_type.items(), (100, 64), strict=True)
    }
    assert [len(h) for h in heads.values()] == [1, 1]
    assert not set(next(iter(heads["chat"]))) & set(next(iter(heads["lookup"])))
    assert all(r.input_length > 100 for r in by_type["chat"] if r.turn == 1)
    # "lookup" never continues; "chat" continues with probability 1 - 1/4, after ~2 s
    assert all(r.turn == 1 and r.parent_chat_id is None for r in by_type["lookup"])
    cont = [r for r in by_type["chat"] if r.turn > 1]
    assert 0.7 < len(cont) / len(by_type["chat"]) < 0.8
    by_chat = {r.chat_id: r for r in reqs}
    gaps = [
        r.timestamp_s - by_chat[r.parent_chat_id].timestamp_s
        for r in cont
        if r.parent_chat_id in by_chat
    ]
    assert 1.7 < float(np.mean(gaps)) < 2.3


def test_bailian_types_differ_in_continuation_and_reuse_time() -> None:
    p = SynthParams(rate=20, duration_s=600, seed=1, chat_types=BAILIAN_TYPES)
    reqs = generate("to-c", p)
    by_chat = {r.chat_id: r for r in reqs}
    cont: dict[str, float] = {}
    gap: dict[str, float] = {}
    for ct in BAILIAN_TYPES:
        rs = [r for r in reqs if r.type == ct.name]
        cont[ct.name] = sum(r.turn > 1 for r in rs) / len(rs)
        assert abs(cont[ct.name] - (1 - 1 / ct.turns_mean)) < 0.05
        pairs = [(by_chat[r.parent_chat_id], r) for r in rs if r.parent_chat_id in by_chat]
        gap[ct.name] = float(np.mean([c.timestamp_s - q.timestamp_s for q, c in pairs]))
    assert cont["search"] < cont["image"] < cont["text"] < cont["file"]
    assert max(gap["text"], gap["search"]) < min(gap["image"], gap["file"])


def test_synthetic_bad_parameters_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--to-b-fraction"):
        generate("mix", SynthParams(to_b_fraction=1.5))
    with pytest.raises(ValueError, match="--workload"):
        generate("chatty", SynthParams())
    bad = ChatType("text", 1.0, 0, 0.5, 1.0, 10)  # turns_mean < 1
    with pytest.raises(ValueError, match=r"--chat-types\[1\]\.turns-mean"):
        generate("to-c", SynthParams(chat_types=(BAILIAN_TYPES[0], bad)))
    with pytest.raises(ValueError, match="--chat-types is"):
        generate("to-c", SynthParams(chat_types=()))


AZURE = MOONCAKE.with_name("azure_llm_2023_conv.csv")


def test_agentic_sessions_share_long_prefixes_and_burst_parallel_calls() -> None:
    p = SynthParams(rate=40, duration_s=60, seed=2, agent_fanout_prob=0.5, agent_fanout_max=4)
    reqs = generate("agentic", p)
    assert all(r.type == "agent" for r in reqs)
    # a few long tool/system prefixes, Zipf-popular: every prompt opens with one of them
    firsts = Counter(r.hash_ids[0] for r in reqs)
    assert 1 < len(firsts) <= p.agent_prefixes
    counts = sorted(firsts.values(), reverse=True)
    assert counts[0] > counts[-1]
    assert min(r.input_length for r in reqs) > 2000  # several thousand tokens of prefix
    # bursts: k calls at one instant, same parent, the session context shared, each its own tail
    by_ts: dict[float, list[TraceRequest]] = {}
    for r in reqs:
        by_ts.setdefault(r.timestamp_s, []).append(r)
    bursts = [g for g in by_ts.values() if len(g) > 1]
    assert len(bursts) > 20
    for g in bursts:
        assert 2 <= len(g) <= p.agent_fanout_max
        assert len({r.parent_chat_id for r in g}) == 1 and len({r.turn for r in g}) == 1
        shortest = min(len(r.hash_ids) for r in g)
        common = next((i for i in range(shortest) if len({r.hash_ids[i] for r in g}) > 1), shortest)
        assert common > 0.8 * shortest  # the context; the sub-tasks are short
        assert len({r.hash_ids[-1] for r in g}) == len(g)
    # a step re-sends the context of the step before (a single call's prompt) and grows it
    by_chat = {r.chat_id: r for r in reqs}
    singles = {r.chat_id for g in by_ts.values() if len(g) == 1 for r in g}
    checked = 0
    for r in reqs:
        parent = by_chat.get(r.parent_chat_id)
        if parent is None or parent.chat_id not in singles:
            continue
        full = parent.input_length // SYNTH_BLOCK_SIZE
        assert r.turn == parent.turn + 1 and r.timestamp_s >= parent.timestamp_s
        assert r.input_length > parent.input_length + parent.output_length
        assert r.hash_ids[:full] == parent.hash_ids[:full]
        checked += 1
    assert checked > 50
    assert ideal_hit_rate(reqs, SYNTH_BLOCK_SIZE)[0] > 0.8


def test_rag_draws_zipf_popular_documents_and_their_order_matters() -> None:
    p = SynthParams(rate=50, duration_s=40, seed=3)
    reqs = generate("rag", p)
    assert all(r.turn == 1 and r.parent_chat_id is None and r.type == "rag" for r in reqs)
    sys_blocks = p.rag_system_tokens // SYNTH_BLOCK_SIZE
    assert len({r.hash_ids[:sys_blocks] for r in reqs}) == 1  # one system prompt for all
    lo = p.rag_system_tokens + p.rag_doc_min_tokens
    hi = p.rag_system_tokens + p.rag_docs_max * p.rag_doc_max_tokens + 4096
    assert all(lo < r.input_length <= hi for r in reqs)
    # the block after the system prompt names the first document: Zipf over a large corpus
    first_doc = Counter(r.hash_ids[sys_blocks] for r in reqs)
    assert len(first_doc) > 100
    assert first_doc.most_common(1)[0][1] > 0.05 * len(reqs)
    # two documents in either order: the prefix after the system prompt comes in two versions
    fixed = SynthParams(
        rate=50, duration_s=20, rag_documents=2, rag_docs_max=2, rag_zipf=0,
        rag_doc_min_tokens=1000, rag_doc_max_tokens=1000,
    )  # fmt: skip
    both = [r for r in generate("rag", fixed) if r.input_length > 300 + 2 * 1000]
    span = (300 + 2 * 1000) // SYNTH_BLOCK_SIZE
    assert len({r.hash_ids[sys_blocks:span] for r in both}) == 2


def test_agentic_and_rag_parameters_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--agent-fanout-prob"):
        generate("agentic", SynthParams(agent_fanout_prob=2))
    with pytest.raises(ValueError, match="--rag-doc-min-tokens"):
        generate("rag", SynthParams(rag_doc_min_tokens=5000))


AZURE_CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,55
2023-11-16 18:16:01.0000000,1500,20
"""


def test_azure_csv_keeps_times_and_counts_and_models_prefixes(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE_CSV)
    trace = load_trace(path)  # detected from the header
    assert trace.format == "azure" and trace.block_size == 16
    reqs = trace.requests
    assert [round(r.timestamp_s, 7) for r in reqs] == [0.0, 4.314579, 4.541877, 14.31941]
    assert [(r.input_length, r.output_length) for r in reqs] == [
        (374, 44), (396, 109), (879, 55), (1500, 20)
    ]  # fmt: skip
    for r in reqs:
        assert len(r.hash_ids) == math.ceil(r.input_length / 16)
    assert load_trace(path, "azure").requests == reqs
    # every request continues a conversation when it can: 879 > 396 + 109 and so on
    cont = load_trace(path, prefix_model=PrefixModel(continue_fraction=1.0, think_time_s=1.0))
    r = cont.requests
    assert r[0].parent_chat_id is None and r[1].parent_chat_id is None  # 396 <= 374 + 44
    assert r[2].parent_chat_id == r[1].chat_id and r[2].turn == 2
    assert r[2].hash_ids[: 396 // 16] == r[1].hash_ids[: 396 // 16]
    assert r[3].parent_chat_id == r[2].chat_id and r[3].turn == 3
    # none continues: each opens with one of the system prompts (one here: all share it)
    fresh = load_trace(path, prefix_model=PrefixModel(continue_fraction=0.0, system_prompts=1))
    assert all(x.parent_chat_id is None and x.turn == 1 for x in fresh.requests)
    assert len({x.hash_ids[:10] for x in fresh.requests}) == 1
    # seeded
    a = load_trace(path, prefix_model=PrefixModel(seed=1)).requests
    assert a == load_trace(path, prefix_model=PrefixModel(seed=1)).requests


def test_prefix_model_defaults_are_the_synthetic_workloads() -> None:
    assert PrefixModel() == PrefixModel.from_synth(SynthParams())


def test_burstgpt_csv_api_lines_never_continue(tmp_path: Path) -> None:
    path = tmp_path / "burst.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,100,20,120,Conversation log\n"
        "6.5,ChatGPT,300,40,340,Conversation log\n"
        "7,GPT-4,900,0,900,API log\n"
        "9,ChatGPT,1000,30,1030,API log\n"
    )
    trace = load_trace(path, prefix_model=PrefixModel(continue_fraction=1.0))
    assert trace.format == "burstgpt"
    reqs = trace.requests
    assert [r.timestamp_s for r in reqs] == [5.0, 6.5, 7.0, 9.0]  # seconds as given
    assert [r.type for r in reqs] == ["text", "text", "api", "api"]
    assert reqs[1].parent_chat_id == reqs[0].chat_id
    assert reqs[2].parent_chat_id is None and reqs[3].parent_chat_id is None


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ("2023-11-16 18:15:46.1,374,44\n2023-11-16 18:15:47.0,x,44\n", ":3: field 'ContextTokens'"),
        ("2023-11-16 18:15:46.1,374,44\n2023-11-16 18:15:47.0,0,44\n", ":3: field 'ContextTokens'"),
        ("2023-11-16 18:15:46.1,374,-1\n", ":2: field 'GeneratedTokens'"),
        ("yesterday,374,44\n", ":2: field 'TIMESTAMP'"),
        ("2023-11-16 18:15:46.1,374,44\n2023-11-16 18:15:45.0,374,44\n", ":3: field 'TIMESTAMP'"),
        ("2023-11-16 18:15:46.1,374\n", ":2: field '<line>'"),
    ],
)
def test_azure_bad_rows_name_the_line_and_column(tmp_path: Path, body: str, where: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + body)
    with pytest.raises(TraceFormatError, match=where):
        load_trace(path)
    skipped = load_trace(path, skip_invalid=True)
    assert skipped.skipped == 1


def test_csv_header_errors(tmp_path: Path) -> None:
    path = tmp_path / "other.csv"
    path.write_text("when,tokens\n1,2\n")
    with pytest.raises(TraceFormatError, match=":1: field '<header>'"):
        load_trace(path)
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.1,3\n")
    with pytest.raises(TraceFormatError, match=":1: field 'GeneratedTokens'"):
        load_trace(path, "azure")
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "1,ChatGPT,0,3,3,API log\n")  # fmt: skip
    with pytest.raises(TraceFormatError, match=":2: field 'Request tokens'"):
        load_trace(path)


@pytest.mark.skipif(not AZURE.exists(), reason="shared Azure trace not present")
def test_shared_azure_conv_trace() -> None:
    trace = load_trace(AZURE)
    assert trace.format == "azure" and len(trace.requests) == 19_366 and trace.skipped == 0
    assert 3400 < trace.duration_s < 3600
    share = sum(r.parent_chat_id is not None for r in trace.requests) / len(trace.requests)
    assert 0.3 < share < 2 / 3  # continuing needs an earlier, shorter turn
    assert 0.3 < ideal_hit_rate(trace.requests, 16)[0] < 0.6
