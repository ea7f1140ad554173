"""The trace-driven simulator: counting semantics, the shared trace's reference figures, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy.cli import main
from loadgen.synthetic import synthetic_bailian
from loadgen.traces import TraceRequest, load_trace
from policies import RequestInfo, create_policy
from policies.lru import LRUPolicy
from simulation.cachesim import infinite_hit_rate, replay, simulate

SHARED = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation.jsonl"
needs_trace = pytest.mark.skipif(not SHARED.is_file(), reason="shared Mooncake trace not present")


def _req(t: float, ids: list[int]) -> TraceRequest:
    return TraceRequest(t, 512 * len(ids), 1, tuple(ids))


def test_hits_are_the_leading_run_over_all_blocks() -> None:
    reqs = [_req(0, [1, 2, 3]), _req(1, [1, 9, 3]), _req(2, [1, 9, 3, 4])]
    # request 2: 1 hits, 9 misses (3 is cached but after the miss); request 3: 1, 9, 3 hit.
    assert infinite_hit_rate(reqs) == pytest.approx(4 / 10)
    result = replay(reqs, LRUPolicy(100))
    assert (result.hit_blocks, result.total_blocks, result.evictions) == (4, 10, 0)


def test_capacity_and_eviction_count() -> None:
    reqs = [_req(0, [1, 2]), _req(1, [3, 4]), _req(2, [1, 2])]
    result = replay(reqs, LRUPolicy(2))
    assert result.hit_blocks == 0 and result.evictions == 4
    result = replay(reqs, LRUPolicy(4))
    assert result.hit_blocks == 2 and result.evictions == 0


def test_lru_ranks_a_finished_request_tail_first() -> None:
    # After [1, 2, 3] the tail 3 is the oldest; storing 4 evicts 3, so [1, 2] still hits.
    reqs = [_req(0, [1, 2, 3]), _req(1, [4]), _req(2, [1, 2, 3])]
    result = replay(reqs, LRUPolicy(3))
    assert result.hit_blocks == 2


class _Recorder(LRUPolicy):
    """A real LRU that also records what the cache told it."""

    name = "recorder"

    def _reset(self) -> None:
        super()._reset()
        self.log: list[tuple[str, object]] = []

    def insert(self, key, now_s, parent=None, offset=0):  # type: ignore[no-untyped-def]
        self.log.append(("insert", (key, parent, offset)))
        super().insert(key, now_s, parent, offset)

    def end_request(self, request, keys, reused, now_s):  # type: ignore[no-untyped-def]
        self.log.append(("end", (request.index, list(keys), list(reused))))
        super().end_request(request, keys, reused, now_s)


def test_store_pass_and_end_request_follow_the_offload_lifecycle() -> None:
    rec = _Recorder(10)
    replay([_req(0, [1, 2]), _req(1, [1, 2, 3])], rec)
    assert rec.log == [
        ("insert", (1, None, 0)),
        ("insert", (2, 1, 1)),
        ("end", (0, [1, 2], [])),
        ("insert", (3, 2, 2)),
        ("end", (1, [1, 2, 3], [1, 2])),
    ]


def test_a_policy_that_loses_track_is_caught() -> None:
    class Leaky(LRUPolicy):
        def evict(self, n, protected=frozenset()):  # type: ignore[no-untyped-def]
            victims = super().evict(n, protected)
            if victims:
                self._order[victims[0]] = None  # still tracked after being evicted
            return victims

    with pytest.raises(RuntimeError, match="tracks"):
        replay([_req(0, [1, 2, 3])], Leaky(1))


@pytest.fixture(scope="module")
def shared_trace() -> list[TraceRequest]:
    return load_trace(SHARED).requests


def _figures(reqs: list[TraceRequest], policy: str) -> list[float]:
    return [round(r.hit_rate, 3) for r in simulate(reqs, [policy], [1000, 3000, 6000, 10000])]


@needs_trace
def test_lru_reproduces_the_shared_traces_reference_figures(
    shared_trace: list[TraceRequest],
) -> None:
    """The trace README's LRU column, to the third decimal."""
    assert round(infinite_hit_rate(shared_trace), 3) == 0.366
    assert _figures(shared_trace, "lru") == [0.045, 0.065, 0.139, 0.211]


@needs_trace
@pytest.mark.slow
def test_belady_reproduces_the_shared_traces_reference_figures(
    shared_trace: list[TraceRequest],
) -> None:
    """The README's Belady column (about 5 s: the oracle's heap is slower than LRU)."""
    assert _figures(shared_trace, "belady") == [0.179, 0.290, 0.352, 0.366]


@needs_trace
@pytest.mark.slow
def test_reuse_oracle_lies_between_the_best_online_policy_and_belady(
    shared_trace: list[TraceRequest],
) -> None:
    """Knowing only whether a block is reused beats every online policy but not Belady."""
    rates = {
        r.policy: r.hit_rate
        for r in simulate(shared_trace, ["prefix-odds", "reuse-oracle", "belady"], [6000])
    }
    assert rates["prefix-odds"] < rates["reuse-oracle"] < rates["belady"]


def test_synthetic_bailian_round_trips_through_the_loader(tmp_path: Path) -> None:
    reqs = synthetic_bailian(sessions=50, seed=3)
    path = tmp_path / "bailian.jsonl"
    with path.open("w") as f:
        for r in reqs:
            rec = {
                "chat_id": r.chat_id,
                "parent_chat_id": -1 if r.parent_chat_id is None else r.parent_chat_id,
                "timestamp": r.timestamp_s,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "type": r.type,
                "turn": r.turn,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(rec) + "\n")
    trace = load_trace(path)
    assert trace.format == "bailian" and trace.requests == reqs
    assert {r.category for r in reqs} >= {"text_1", "text_2"}
    # Turn k+1 extends turn k's prompt: the parent's full blocks are a prefix of the child's
    # (its partial last block changes once the reply is appended). A window of a running
    # workload: some parents began before it.
    by_id = {r.chat_id: r for r in reqs}
    pairs = [(by_id[r.parent_chat_id], r) for r in reqs if r.parent_chat_id in by_id]
    assert pairs
    for parent, child in pairs:
        full = parent.input_length // 16
        assert child.turn == parent.turn + 1 and child.type == parent.type
        assert child.input_length > parent.input_length + parent.output_length
        assert child.hash_ids[:full] == parent.hash_ids[:full]


def test_request_info_carries_the_category() -> None:
    reqs = synthetic_bailian(sessions=20, seed=1)
    seen: list[RequestInfo] = []

    class Spy(LRUPolicy):
        def begin_request(self, request, now_s):  # type: ignore[no-untyped-def]
            seen.append(request)

    replay(reqs, Spy(100))
    assert [i.category for i in seen] == [r.category for r in reqs]
    assert [i.index for i in seen] == list(range(len(reqs)))


def test_wa_beats_lru_on_a_multi_turn_bailian_workload() -> None:
    reqs = synthetic_bailian(sessions=600, seed=0)
    lru = replay(reqs, create_policy("lru", 1000)).hit_rate
    wa = replay(reqs, create_policy("wa", 1000)).hit_rate
    assert wa > lru + 0.005


# --- the CLI ---------------------------------------------------------------


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _mooncake(tmp_path: Path) -> Path:
    lines = [
        json.dumps({"timestamp": t * 10, "input_length": 1024, "output_length": 5, "hash_ids": h})
        for t, h in enumerate([[1, 2], [1, 3], [1, 2], [4, 5]])
    ]
    return _write(tmp_path, lines)


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _mooncake(tmp_path)
    rc = main(
        [
            "cachesim",
            "--trace",
            str(path),
            "--policy",
            "lru,belady",
            "--capacity-blocks",
            "2,3",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["infinite_hit_rate"] == pytest.approx(3 / 8)
    assert [(r["policy"], r["capacity_blocks"]) for r in out["results"]] == [
        ("lru", 2),
        ("lru", 3),
        ("belady", 2),
        ("belady", 3),
    ]
    assert set(out["results"][0]) == {
        "policy",
        "capacity_blocks",
        "hit_rate",
        "evictions",
        "seconds",
    }
    lru3 = out["results"][1]
    assert lru3["hit_rate"] == pytest.approx(3 / 8) and lru3["evictions"] == 2


def test_cli_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cachesim", "--trace", str(_mooncake(tmp_path)), "--capacity-blocks", "3"]) == 0
    out = capsys.readouterr().out
    assert "lru" in out and "0.375" in out and "infinite" in out


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--trace", "/nonexistent/x.jsonl", "--capacity-blocks", "10"], "--trace"),
        (["--policy", "lru,bogus", "--capacity-blocks", "10"], "--policy"),
        (["--capacity-blocks", "10,abc"], "--capacity-blocks"),
        (["--capacity-blocks", "0"], "--capacity-blocks"),
        (["--format", "csv", "--capacity-blocks", "1"], "--format"),
    ],
)
def test_cli_bad_input_is_one_line_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], field: str
) -> None:
    if "--trace" not in argv:
        argv = ["--trace", str(_mooncake(tmp_path)), *argv]
    assert main(["cachesim", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err and "Traceback" not in err


def test_cli_malformed_line_names_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(
        tmp_path,
        [
            json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}),
            json.dumps({"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": "x"}),
        ],
    )
    assert main(["cachesim", "--trace", str(path), "--capacity-blocks", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path}:2" in err and "hash_ids" in err
    assert main(["cachesim", "--trace", str(path), "--capacity-blocks", "4", "--skip-invalid"]) == 0


def _naive_lru_hits(reqs: list[TraceRequest], capacity: int) -> int:
    """The documented counting, written out with a list: lookup, store misses head to tail
    evicting the least recent after each, then rank the request's blocks tail first."""
    order: list[int] = []  # least recent first
    hits = 0
    for req in reqs:
        k = 0
        while k < len(req.hash_ids) and req.hash_ids[k] in order:
            k += 1
        hits += k
        for h in req.hash_ids:
            if h not in order:
                order.append(h)
                if len(order) > capacity:
                    order.pop(0)
        for h in reversed(req.hash_ids):
            if h in order:
                order.remove(h)
                order.append(h)
    return hits


@settings(max_examples=150, deadline=None)
@given(
    prompts=st.lists(
        st.lists(st.integers(0, 12), min_size=1, max_size=6, unique=True), max_size=40
    ),
    capacity=st.integers(1, 10),
)
def test_lru_replay_matches_a_naive_reference(prompts: list[list[int]], capacity: int) -> None:
    reqs = [_req(float(i), p) for i, p in enumerate(prompts)]
    result = replay(reqs, LRUPolicy(capacity))
    assert result.hit_blocks == _naive_lru_hits(reqs, capacity)
    assert result.total_blocks == sum(len(p) for p in prompts)
