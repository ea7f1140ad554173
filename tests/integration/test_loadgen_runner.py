"""The runner against a real HTTP server (the null server on its own thread and event loop):
timing fidelity, latency from intended time, prompts on the wire, sessions, errors, closed loop.

Bounds on timing are generous (a loaded 2-core machine); speed is measured by the benchmark."""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from loadgen.metrics import summarize
from loadgen.nullserver import NullServer, serve_in_thread
from loadgen.prompts import PromptSynth, count_words
from loadgen.records import RequestRecord
from loadgen.runner import RunConfig, Runner, RunResult
from loadgen.traces import TraceRequest
from loadgen.workloads import Planned, build_schedule

pytestmark = pytest.mark.integration


@pytest.fixture
def server() -> Iterator[tuple[NullServer, str]]:
    srv = NullServer(record=True)
    with serve_in_thread(srv) as url:
        yield srv, url


def run(config: RunConfig, plan: list[Planned]) -> list[RequestRecord]:
    return asyncio.run(Runner(config, plan).run()).records


def cfg(url: str, **kw: object) -> RunConfig:
    return RunConfig(url, "null", PromptSynth(16, seed=1), **kw)  # type: ignore[arg-type]


def reqs(n: int, gap_s: float, length: int = 32, out: int = 4) -> list[TraceRequest]:
    blocks = math.ceil(length / 16)
    return [
        TraceRequest(i * gap_s, length, out, tuple(range(i * 100, i * 100 + blocks)))
        for i in range(n)
    ]


def test_open_loop_follows_the_absolute_schedule(server: tuple[NullServer, str]) -> None:
    srv, url = server
    plan = build_schedule(reqs(300, 0.01))  # 100 req/s for 3 s

    async def stall() -> None:
        # a 1 s stall of the client's event loop 0.5 s into the schedule: timed from the first
        # request's arrival, not from here (a busy box starts the runner's clock up to ~0.5 s
        # later, which moved the stall off the requests the test reads)
        while not srv.arrivals:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.5)
        time.sleep(1.0)

    async def go() -> list[RequestRecord]:
        stalling = asyncio.create_task(stall())
        records = (await Runner(cfg(url), plan).run()).records
        await stalling
        return records

    records = asyncio.run(go())
    assert all(r.ok for r in records)
    lag = np.array([r.send_lag_s for r in records])
    intended = np.array([r.intended_s for r in records])
    assert lag.min() >= 0
    # requests due during the stall went late, and their lag is recorded ...
    assert np.median(lag[(intended > 0.7) & (intended < 1.3)]) > 0.3
    # ... but the schedule is absolute: later requests are back on time, not shifted by 1 s
    assert np.median(lag[intended > 2.5]) < 0.5
    s = summarize(records, duration_s=3.0, requested_span_s=plan[-1].offset_s)
    assert s["requested_rate"] == pytest.approx(100.0)
    assert s["achieved_rate"] == pytest.approx(100.0, rel=0.2)
    assert len(srv.arrivals) == 300


def test_no_request_leaves_before_its_time_on_the_clis_event_loop(
    server: tuple[NullServer, str],
) -> None:
    """uvloop (what ``kvroute loadgen`` runs on) wakes a sleep up to ~1 ms early on
    ``perf_counter``: the runner must still not send before the schedule says, or TTFT, measured
    from the intended time, comes out short (negative against a fast server)."""
    _, url = server
    records = Runner(cfg(url), build_schedule(reqs(200, 0.0037))).run_blocking().records
    assert all(r.ok for r in records)
    assert min(r.send_lag_s for r in records) >= 0
    assert min(r.ttft_s for r in records) > 0


def test_equal_timestamps_fire_together(server: tuple[NullServer, str]) -> None:
    srv, url = server
    srv.ttft_ms = 1000.0
    burst = [TraceRequest(0.2, 16, 1, (i,)) for i in range(30)]
    records = run(cfg(url), build_schedule([TraceRequest(0.0, 16, 1, (999,)), *burst]))
    assert all(r.ok for r in records)
    assert all(r.intended_s == records[1].intended_s for r in records[1:])
    # all 30 went out before the first of them was answered: together, not one after another
    assert max(r.sent_s for r in records[1:]) < min(r.done_s for r in records[1:])


def test_latency_counts_from_the_intended_time(server: tuple[NullServer, str]) -> None:
    srv, url = server
    srv.ttft_ms = 50.0
    burst = [TraceRequest(0.0, 16, 2, (i,)) for i in range(6)]
    records = run(cfg(url, max_inflight=1), build_schedule(burst))
    assert all(r.ok for r in records)
    assert sum(r.cap_delayed for r in records) == 5
    ttft = sorted(r.ttft_s for r in records)
    # request k waited for k earlier ones behind the cap: that wait is in its TTFT
    assert ttft[0] >= 0.045
    assert ttft[-1] >= 5 * 0.045
    assert max(r.send_lag_s for r in records) >= 5 * 0.045


def test_streaming_measures_ttft_and_itl(server: tuple[NullServer, str]) -> None:
    srv, url = server
    srv.ttft_ms, srv.itl_ms = 40.0, 20.0
    records = run(cfg(url), build_schedule(reqs(3, 0.05, out=6)))
    for r in records:
        assert r.ok and r.output_tokens == 6 and len(r.itl_s) == 5
        assert r.ttft_s >= 0.035
        assert 0.015 <= float(np.median(r.itl_s)) < 0.5
        assert r.e2e_s >= r.ttft_s + 5 * 0.015


def test_prompts_on_the_wire_share_exactly_their_hash_ids(server: tuple[NullServer, str]) -> None:
    srv, url = server
    trace = [
        TraceRequest(0.0, 40, 2, (1, 2, 3)),
        TraceRequest(0.01, 45, 2, (1, 2, 4)),
        TraceRequest(0.02, 33, 2, (1, 5, 6)),
    ]
    records = run(cfg(url), build_schedule(trace))
    assert all(r.ok for r in records)
    prompts = {len(a.prompt_tokens): a.prompt_tokens for a in srv.arrivals}
    a, b, c = prompts[40], prompts[45], prompts[33]
    assert a[:32] == b[:32] and a[32] != b[32]
    assert a[:16] == c[:16] and a[16] != c[16]
    # the server's prefix cache agrees: 32 then 16 cached tokens
    cached = sorted((r.input_tokens, r.cached_tokens) for r in records)
    assert cached == [(33, 16), (40, 0), (45, 32)]
    assert all(r.prompt_tokens == r.input_tokens for r in records)


def test_chat_api_sends_text_of_exact_length(server: tuple[NullServer, str]) -> None:
    srv, url = server
    records = run(cfg(url, api="chat"), build_schedule(reqs(3, 0.01, length=50)))
    assert all(r.ok and r.output_tokens == 4 for r in records)
    for arr in srv.arrivals:
        assert arr.path == "/v1/chat/completions"
        assert count_words(arr.body["messages"][0]["content"]) == 50


def _session_trace() -> list[TraceRequest]:
    return [
        TraceRequest(0.0, 40, 5, (1, 2, 3), chat_id=10, parent_chat_id=None, type="text", turn=1),
        TraceRequest(0.0, 20, 3, (8, 9), chat_id=11, parent_chat_id=None, type="text", turn=1),
        TraceRequest(0.05, 60, 5, (1, 2, 4, 5), chat_id=12, parent_chat_id=10, type="text", turn=2),
        TraceRequest(0.1, 90, 5, (1, 2, 4, 5, 6, 7), chat_id=13, parent_chat_id=12, turn=3),
    ]


def test_live_sessions_feed_the_real_reply_into_the_next_turn(
    server: tuple[NullServer, str],
) -> None:
    srv, url = server
    srv.ttft_ms = 150.0  # replies arrive after the next turn's scheduled time
    plan = build_schedule(_session_trace())
    records = run(cfg(url, api="chat", sessions="live"), plan)
    assert all(r.ok for r in records)
    by_chat = {r.chat_id: r for r in records}
    # turn 2 waited for turn 1's reply; its intended time moved to when the reply ended
    assert by_chat[12].sent_s >= by_chat[10].done_s
    assert by_chat[13].sent_s >= by_chat[12].done_s
    assert by_chat[12].intended_s == pytest.approx(by_chat[10].done_s)
    bodies = {len(a.body["messages"]): a.body["messages"] for a in srv.arrivals}
    turn2, turn3 = bodies[3], bodies[5]
    assert turn2[1]["role"] == "assistant"
    assert turn2[1]["content"] == by_chat[10].reply != ""
    assert turn3[:3] == turn2 and turn3[3]["content"] == by_chat[12].reply
    # the new user message keeps the trace's length: 60 - 40 - 5
    assert count_words(turn2[2]["content"]) == 15
    # the server's cache sees the history (prompt + reply) as a cached prefix
    assert by_chat[13].cached_tokens and by_chat[13].cached_tokens >= 48


def test_recorded_sessions_follow_the_schedule_order(server: tuple[NullServer, str]) -> None:
    srv, url = server
    plan = build_schedule(_session_trace(), time_scale=2.0)
    records = run(cfg(url), plan)
    assert all(r.ok for r in records)
    order = [len(a.prompt_tokens) for a in sorted(srv.arrivals, key=lambda a: a.time_s)]
    assert order[2:] == [60, 90]
    assert sorted(order[:2]) == [20, 40]
    by_chat = {r.chat_id: r for r in records}
    # recorded history: turn 3's prompt extends turn 2's 3 full blocks (48 tokens cached)
    assert by_chat[13].cached_tokens == 48


def test_errors_by_kind(server: tuple[NullServer, str]) -> None:
    srv, url = server
    srv.error_every = 3
    records = run(cfg(url), build_schedule(reqs(9, 0.005)))
    assert sorted(r.error or "ok" for r in records).count("http_503") == 3
    s = summarize(records, duration_s=1.0, requested_span_s=0.04)
    assert s["errors"] == {"http_503": 3} and s["completed"] == 6

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    records = run(cfg(closed), build_schedule(reqs(2, 0.0)))
    assert [r.error for r in records] == ["connect", "connect"]

    srv.error_every, srv.ttft_ms = 0, 2000.0
    records = run(cfg(url, timeout_s=0.3), build_schedule(reqs(2, 0.0)))
    assert [r.error for r in records] == ["timeout", "timeout"]


def test_non_streaming(server: tuple[NullServer, str]) -> None:
    _, url = server
    records = run(cfg(url, stream=False), build_schedule(reqs(4, 0.01, out=7)))
    assert all(r.ok and r.output_tokens == 7 and r.prompt_tokens == 32 for r in records)


def test_closed_loop_keeps_n_in_flight(server: tuple[NullServer, str]) -> None:
    srv, url = server
    srv.ttft_ms = 30.0
    records = run(cfg(url, concurrency=2), build_schedule(reqs(10, 1.0)))
    assert all(r.ok for r in records)
    events = sorted([(r.sent_s, 1) for r in records] + [(r.done_s, -1) for r in records])
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak == 2
    # no schedule: 10 requests of >= 30 ms two at a time, not 9 s of trace time
    assert max(r.done_s for r in records) < 3.0


def test_a_stopped_run_keeps_its_partial_records(server: tuple[NullServer, str]) -> None:
    srv, url = server
    srv.ttft_ms = 200.0

    async def go() -> RunResult:
        task = asyncio.create_task(Runner(cfg(url), build_schedule(reqs(100, 0.01))).run())
        # NOTE: stopped once the server has answered a few and holds others, not at a fixed
        # time: on a busy box the first answer can take longer than any fixed wait
        deadline = time.monotonic() + 30.0
        while srv.requests - srv.inflight < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the answers' last bytes reach the client
        task.cancel()  # what Ctrl-C does under asyncio.Runner
        return await task

    result = asyncio.run(go())
    assert result.interrupted
    s = summarize(result.records, duration_s=result.duration_s, requested_span_s=0.99)
    assert 0 < s["completed"] < 100
    assert s["errors"]["interrupted"] > 0 and s["errors"]["not_sent"] > 0
    assert s["completed"] + s["errors"]["interrupted"] + s["errors"]["not_sent"] == 100


def test_connection_pool_bounds_concurrent_streams(server: tuple[NullServer, str]) -> None:
    srv, url = server
    srv.ttft_ms = 100.0
    burst = [TraceRequest(0.0, 16, 1, (i,)) for i in range(6)]
    records = run(cfg(url, max_connections=2), build_schedule(burst))
    assert all(r.ok for r in records)
    assert srv.inflight_peak == 2
    # the wait for a connection is part of the latency from the intended time
    assert max(r.ttft_s for r in records) >= 3 * 0.09
