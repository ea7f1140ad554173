"""Placement scorers, load accounting and admission, on hand-built cluster states."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from cachemap import CacheMap, Match, Tier
from engines.base import EngineOutput, LoadSnapshot
from engines.profile import LatencyProfile
from router.admission import Admission, Rejected
from router.load import LoadTracker
from router.placement import (
    InstanceView,
    Placement,
    PlacementRequest,
    create_scorer,
    scorer_names,
)
from router.settings import RouterSettings

BS = 16


# one step takes any prompt (as good as no limit: no test prompt comes near it)
ANY_PROMPT = 1 << 30


def Linear(
    tok_s: float = 10_000.0,
    load_tok_s: float = 200_000.0,
    max_num_batched_tokens: int = ANY_PROMPT,
) -> LatencyProfile:
    """A latency profile that prefills at ``tok_s`` tokens/s whatever the context and loads
    from the CPU tier at ``load_tok_s``, with no fixed cost: a queue of ``q`` tokens and ``u``
    uncached ones take ``(q + u) / tok_s`` seconds, ``c`` CPU-tier ones ``c / load_tok_s``
    more."""
    return LatencyProfile(
        name="linear",
        model="test",
        hardware="test",
        block_size=BS,
        kv_capacity_tokens=ANY_PROMPT,
        kv_bytes_per_token=1000,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=1024,
        max_model_len=ANY_PROMPT,
        base_ms=0.0,
        prefill_token_ms=1e3 / tok_s,
        prefill_attn_ms=0.0,
        decode_seq_ms=0.0,
        decode_ctx_ms=0.0,
        cpu_load_gbps=load_tok_s * 1000 / 1e9,
    )


def view(iid: str, **kw) -> InstanceView:
    return InstanceView(iid, BS, Linear(), **kw)


def req(n_blocks: int, **kw) -> PlacementRequest:
    return PlacementRequest("r", n_blocks * BS, list(range(1, n_blocks + 1)), **kw)


def test_registry_lists_names_and_rejects_unknown() -> None:
    assert {"kv_ttft", "round_robin", "least_loaded", "session"} <= set(scorer_names())
    with pytest.raises(ValueError, match="valid: kv_ttft"):
        create_scorer("nope")


def test_kv_ttft_prefers_the_cached_instance_until_its_queue_costs_more() -> None:
    s = create_scorer("kv_ttft")
    r = req(100)  # 1,600 tokens: 160 ms cold
    match = {"a": Match(100, 100)}
    assert s.place(r, [view("a"), view("b")], match).instance_id == "a"
    # a's queue holds 2,000 tokens of prefill (200 ms) > b's cold prefill (160 ms).
    busy = [view("a", pending_prefill_tokens=2000), view("b")]
    p = s.place(r, busy, match)
    assert p.instance_id == "b"
    assert p.estimated_ttft_s == pytest.approx(0.16)


def test_kv_ttft_prices_cpu_hits_between_gpu_hits_and_misses() -> None:
    s = create_scorer("kv_ttft")
    r = req(100)
    gpu, cpu = Match(100, 100), Match(0, 100)
    est_gpu = s.estimate(r, view("a"), gpu)[0]  # type: ignore[attr-defined]
    est_cpu = s.estimate(r, view("a"), cpu)[0]  # type: ignore[attr-defined]
    est_miss = s.estimate(r, view("a"), None)[0]  # type: ignore[attr-defined]
    assert est_gpu < est_cpu < est_miss
    assert s.place(r, [view("a"), view("b")], {"a": cpu, "b": gpu}).instance_id == "b"


def test_kv_ttft_vetoes_kv_exhaustion_and_breaks_ties_by_decode_load() -> None:
    r = req(10)
    full = [view("a", gpu_kv_usage=0.99), view("b", gpu_kv_usage=0.2)]
    # off by default: a full instance holding the prefix keeps it (the engine queues it)
    assert create_scorer("kv_ttft").place(r, full, {"a": Match(10, 10)}).instance_id == "a"
    s = create_scorer("kv_ttft", kv_veto=0.95)
    assert s.place(r, full, {"a": Match(10, 10)}).instance_id == "b"
    small = [view("a", kv_capacity_blocks=100, gpu_kv_usage=0.95)]
    assert s.place(r, [*small, view("b")], {"a": Match(10, 10)}).instance_id == "b"
    # every instance vetoed: still placed
    assert s.place(r, [view("a", gpu_kv_usage=0.99)], {}).instance_id == "a"
    tie = [view("a", running=9), view("b", running=1)]
    assert s.place(r, tie, {}).instance_id == "b"


def test_unhealthy_instances_are_never_chosen() -> None:
    for name in scorer_names():
        s = create_scorer(name)
        p = s.place(req(4), [view("a", healthy=False), view("b")], {"a": Match(4, 4)})
        assert p.instance_id == "b", name


def test_round_robin_least_loaded_and_session() -> None:
    rr = create_scorer("round_robin")
    insts = [view("a"), view("b"), view("c")]
    assert [rr.place(req(1), insts, {}).instance_id for _ in range(4)] == ["a", "b", "c", "a"]
    ll = create_scorer("least_loaded")
    assert ll.place(req(1), [view("a", running=3), view("b", running=1)], {}).instance_id == "b"
    ss = create_scorer("session")
    owners = {
        k: ss.place(req(1, session_key=k), insts, {}).instance_id for k in map(str, range(300))
    }
    assert len(set(owners.values())) == 3
    again = {k: ss.place(req(1, session_key=k), insts, {}).instance_id for k in owners}
    assert again == owners
    without_c = {k: ss.place(req(1, session_key=k), insts[:2], {}).instance_id for k in owners}
    moved = [k for k in owners if owners[k] != without_c[k]]
    assert all(owners[k] == "c" for k in moved)  # only c's sessions move


def test_sglang_cache_aware_thresholds() -> None:
    s = create_scorer("sglang_cache_aware")
    insts = [view("a"), view("b")]
    first = s.place(req(10), insts, {}).instance_id
    # Same prefix, balanced load: follows its approximate tree (match 100% > 0.3).
    assert s.place(req(10), insts, {}).instance_id == first
    # A different prompt with no match: goes to the smaller tree (the other instance).
    other = PlacementRequest("x", 160, list(range(100, 110)))
    assert s.place(other, insts, {}).instance_id != first
    # Imbalanced (diff > 64 and ratio > 1.5): least loaded wins despite the match.
    for _ in range(100):
        s.place(req(10), insts, {})
    loaded = max(insts, key=lambda i: s._in_flight.get(i.instance_id, 0)).instance_id  # type: ignore[attr-defined]
    assert s.place(req(10), insts, {}).instance_id != loaded


def test_dynamo_cost_and_llmd_weighted() -> None:
    d = create_scorer("dynamo_cost")
    a = view("a", kv_capacity_blocks=1000, gpu_kv_usage=0.5)  # 500 active blocks
    b = view("b", kv_capacity_blocks=1000, gpu_kv_usage=0.0)
    r = req(100)
    # a: 0 prefill + 500 active + 100 request = 600; b: 100 + 0 + 100 = 200
    assert d.cost(r, a, Match(100, 100)) == pytest.approx(600)  # type: ignore[attr-defined]
    assert d.place(r, [a, b], {"a": Match(100, 100)}).instance_id == "b"
    # The prefill term counts the worker's queued prefill, so a hot prefix's holder stops
    # winning once its queue is long, between two load samples (usage has not moved yet).
    a_queued = view("a", kv_capacity_blocks=1000, pending_prefill_tokens=16 * 160)
    b_idle = view("b", kv_capacity_blocks=1000)
    # a: 160 queued blocks + 0 new + 0 active + 100 = 260; b: 100 new + 0 + 100 = 200
    assert d.cost(r, a_queued, Match(100, 100)) == pytest.approx(260)  # type: ignore[attr-defined]
    assert d.place(r, [a_queued, b_idle], {"a": Match(100, 100)}).instance_id == "b"
    lw = create_scorer("llmd_weighted")
    # a: 2*1.0 + 1*0.5 + 1*0 = 2.5 ; b: 0 + 1*1 + 1*1 = 2.0
    a2 = view("a", gpu_kv_usage=0.5, waiting=4)
    b2 = view("b", waiting=0)
    assert lw.place(r, [a2, b2], {"a": Match(100, 100)}).instance_id == "a"


def test_load_tracker_combines_snapshots_with_newer_local_assignments() -> None:
    lt = LoadTracker(stale_after_s=1.0)
    lt.register("a", BS, Linear())
    lt.assigned("r1", "a", 500, now=10.0)
    lt.on_snapshot(LoadSnapshot("a", 10.5, 2, 3, 0.4, 0.0, 1200))  # includes r1
    lt.assigned("r2", "a", 300, now=10.6)  # newer than the snapshot
    (v,) = lt.views(now=10.7)
    assert (v.waiting, v.running, v.pending_prefill_tokens) == (3, 3, 1500)
    assert v.gpu_kv_usage == 0.4
    lt.prefill_done("r2", 10.7)
    (v,) = lt.views(now=20.0)  # stale snapshot: local accounting only
    assert (v.waiting, v.running, v.pending_prefill_tokens) == (1, 1, 500)
    lt.mark_failed("a")
    assert not lt.views(now=20.0)[0].healthy
    lt.on_snapshot(LoadSnapshot("a", 20.0, 0, 0, 0.0, 0.0, 0))
    assert lt.views(now=20.0)[0].healthy
    lt.finished("r1")
    lt.finished("r2")
    assert lt.in_flight() == 0


def test_a_snapshot_counts_only_the_requests_its_engine_had_taken() -> None:
    """An engine that says when it last took the requests sent to it (``inputs_ts``: vLLM's
    engine core takes them between steps) does not count one sent after that, though sent
    before the snapshot's time: the router adds its own, and a peer's, on top."""
    lt = LoadTracker(stale_after_s=1.0)
    lt.register("a", BS, Linear())
    lt.assigned("r1", "a", 500, now=10.0)  # taken at the step's start, 10.01
    lt.assigned("r2", "a", 300, now=10.02)  # sent mid-step: waits in the engine's input
    lt.peer_assigned("a", 70, 10.03)
    lt.on_snapshot(LoadSnapshot("a", 10.05, 0, 1, 0.1, 0.0, 500, inputs_ts=10.01))
    assert lt.views(now=10.06)[0].pending_prefill_tokens == 500 + 300 + 70
    # an engine that does not say (a front end counting what it was sent): all in it
    lt.on_snapshot(LoadSnapshot("a", 10.07, 0, 1, 0.1, 0.0, 870))
    assert lt.views(now=10.08)[0].pending_prefill_tokens == 870


def test_load_tracker_counts_other_replicas_prompts_until_a_snapshot_does() -> None:
    """A prompt another router replica shared counts in the view (a waiting request and its
    tokens) from when it arrives until a snapshot taken after it was sent counts it itself;
    one sent before the latest snapshot is already in it and is not counted twice."""
    lt = LoadTracker(stale_after_s=1.0)
    lt.register("a", BS, Linear())
    lt.on_snapshot(LoadSnapshot("a", 10.0, 1, 2, 0.1, 0.0, 400))
    lt.peer_assigned("a", 300, 10.02)
    lt.peer_assigned("a", 50, 9.99)  # before the snapshot: in it
    lt.peer_assigned("b", 70, 10.03)  # an instance this replica does not know
    (v,) = lt.views(now=10.05)
    assert (v.waiting, v.pending_prefill_tokens) == (2, 700)
    lt.peer_assigned("a", 100, 10.01)  # late, and out of order
    assert lt.views(now=10.06)[0].pending_prefill_tokens == 800
    lt.on_snapshot(LoadSnapshot("a", 10.015, 2, 2, 0.1, 0.0, 500))  # counts the 10.01 one
    assert lt.views(now=10.07)[0].pending_prefill_tokens == 800
    lt.on_snapshot(LoadSnapshot("a", 10.1, 2, 2, 0.1, 0.0, 800))  # counts both
    (v,) = lt.views(now=10.11)
    assert (v.waiting, v.pending_prefill_tokens) == (2, 800)


def test_load_tracker_takes_out_prompts_that_had_their_first_token_since_the_snapshot() -> None:
    """An engine counts a prompt as queued until its first token; this router sees that token
    come before the engine's next sample, and reads the last one without it. Another router's
    prompt, and a prompt answered before the sample, stay as the sample says."""
    lt = LoadTracker(stale_after_s=1.0)
    lt.register("a", BS, Linear())
    lt.assigned("r1", "a", 500, now=9.0)  # long done by its pricing: no backlog
    lt.assigned("r2", "a", 300, now=9.0)
    lt.on_snapshot(LoadSnapshot("a", 10.0, 0, 2, 0.1, 0.0, 900))  # r1, r2, 100 not ours
    lt.prefill_done("r1", 10.05)
    assert lt.views(now=10.06)[0].pending_prefill_tokens == 400
    lt.on_snapshot(LoadSnapshot("a", 10.1, 0, 2, 0.1, 0.0, 400))  # taken after: r1 not in it
    assert lt.views(now=10.11)[0].pending_prefill_tokens == 400
    lt.prefill_done("r2", 10.12)
    lt.assigned("r3", "a", 200, now=10.13)  # newer than the sample: added
    assert lt.views(now=10.14)[0].pending_prefill_tokens == 300
    lt.prefill_done("r3", 10.25)
    lt.on_snapshot(LoadSnapshot("a", 10.3, 0, 3, 0.1, 0.0, 100))  # after both
    assert lt.views(now=10.31)[0].pending_prefill_tokens == 100
    lt.on_snapshot(LoadSnapshot("a", 10.4, 0, 3, 0.1, 0.0, 50))  # never below nothing
    lt.assigned("r4", "a", 80, now=10.0)
    lt.prefill_done("r4", 10.45)
    assert lt.views(now=10.46)[0].pending_prefill_tokens == 0


def test_admission_slo_and_bounded_queue() -> None:
    adm = Admission(slo_ttft_s=0.5, max_in_flight=1, max_queue=1, max_wait_s=0.2)
    adm.check_slo(0.4)
    with pytest.raises(Rejected) as e:
        adm.check_slo(2.3)
    assert e.value.retry_after_header == "2"

    async def scenario() -> list[str]:
        log: list[str] = []
        gate = asyncio.Event()

        async def worker(name: str, hold: bool) -> None:
            try:
                ticket = await adm.acquire()
            except Rejected as r:
                log.append(f"{name} rejected: {r.reason}")
                return
            try:
                log.append(f"{name} in")
                if hold:
                    await gate.wait()
            finally:
                ticket.release()
                ticket.release()  # idempotent: streams release from several exits

        t1 = asyncio.create_task(worker("a", True))
        await asyncio.sleep(0)
        t2 = asyncio.create_task(worker("b", False))  # queued
        await asyncio.sleep(0)
        t3 = asyncio.create_task(worker("c", False))  # queue full
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(t1, t2, t3)
        gate.clear()
        t4 = asyncio.create_task(worker("d", True))  # holds the slot again
        await asyncio.sleep(0)
        t5 = asyncio.create_task(worker("e", False))  # waits, times out
        await t5
        gate.set()
        await t4
        return log

    log = asyncio.run(scenario())
    assert log[:3] == ["a in", "c rejected: server is at capacity and its queue is full", "b in"]
    assert "e rejected: timed out waiting for capacity" in log
    assert adm.running == 0 and adm.queued == 0


def test_scorers_work_on_a_real_cache_map_match() -> None:
    cmap = CacheMap()
    cmap.store("b", Tier.GPU, list(range(1, 9)))
    cmap.store("a", Tier.CPU, list(range(1, 9)))
    r = req(8)
    m = cmap.match(r.block_hashes)
    assert create_scorer("kv_ttft").place(r, [view("a"), view("b")], m).instance_id == "b"


def test_ttft_calibration_learns_scale_decode_interference_and_offset() -> None:
    from router.scorers.kv_ttft import TtftCalibration

    cal = TtftCalibration(window=200, refit_every=10, min_samples=20)
    assert cal.correct(0.1, 3, 2) == pytest.approx(0.1)  # the plain profile until fitted
    for i in range(200):
        est, running, waiting = 0.02 + (i % 17) * 0.01, i % 5, i % 3
        cal.observe(est, running, waiting, 3.0 * est + 0.1 * running + 0.2 * waiting + 0.05)
    assert (cal.a, cal.b, cal.d, cal.c) == pytest.approx((3.0, 0.1, 0.2, 0.05), abs=1e-6)
    cal.observe(float("nan"), 1, 0, 0.1)  # ignored
    assert cal.samples == 200


def test_kv_ttft_learns_to_avoid_an_instance_busy_decoding() -> None:
    s = create_scorer("kv_ttft")
    r = req(100)  # 160 ms cold
    match = {"a": Match(100, 100)}
    views = [view("a", running=6), view("b")]
    assert s.place(r, views, match).instance_id == "a"  # the profile alone: the cache wins
    for i in range(64):  # every running sequence has cost 100 ms of TTFT
        running = i % 7
        d = {"profile_ttft_s": 0.01 * (i % 3), "running": running, "waiting": 0}
        p = Placement("a", 0.0, 0, d)
        s.on_first_token(p, 0.01 * (i % 3) + 0.1 * running)
    assert s.place(r, views, match).instance_id == "b"


def test_router_state_reports_first_tokens_to_the_scorer() -> None:
    from router.state import RouterState

    seen: list[tuple[str, float]] = []

    class Recording(type(create_scorer("round_robin"))):  # type: ignore[misc]
        def on_first_token(self, placement: Placement, ttft_s: float) -> None:
            seen.append((placement.instance_id, ttft_s))

    st = RouterState(RouterSettings(block_size=BS), scorer=Recording())
    p = Placement("a", 0.1, 0)
    st.assigned(req(4), p)
    st.first_token("r")
    st.first_token("r")  # a second call reports nothing
    assert len(seen) == 1 and seen[0][0] == "a" and 0 <= seen[0][1] < 1


def test_placement_log_records_every_candidate(tmp_path) -> None:
    import json

    from router.recorder import JsonlRecorder
    from router.state import RouterState

    path = tmp_path / "placements.jsonl"
    recorder = JsonlRecorder(str(path))
    st = RouterState(RouterSettings(block_size=BS), Linear(), recorder=recorder)
    st.sync_instances(["a", "b"])
    r = req(8)
    st.cache_map.store("b", Tier.GPU, r.block_hashes)
    for _ in range(2):
        st.place(r)
    recorder.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 2 and all(x["chosen"] == "b" for x in lines)
    assert lines[0]["candidates"]["b"]["cached_blocks"] == 8
    assert lines[0]["candidates"]["a"]["cached_blocks"] == 0


def test_router_core_takes_time_as_an_argument() -> None:
    """The core reads no clock: a load sample is fresh or stale by the ``now`` it is given."""
    from engines.base import LoadSnapshot
    from router.core import RouterCore
    from router.recorder import MemoryRecorder

    rec = MemoryRecorder()
    core = RouterCore(
        RouterSettings("least_loaded", block_size=BS, stale_after_s=1.0), Linear(), recorder=rec
    )
    core.sync_instances(["a", "b"])
    core.load.on_snapshot(LoadSnapshot("a", 100.0, 5, 5, 0.1, 0.0, 0))
    assert core.place(req(4), now=100.5).instance_id == "b"  # a's sample is fresh: busy
    assert core.place(req(4), now=102.0).instance_id == "a"  # stale: local accounting only
    assert [r["ts"] for r in rec.records] == [100.5, 102.0]
    p = core.place(req(4), now=103.0)
    core.assigned(req(4), p, now=103.0)
    assert core.load.views(103.0)[0].waiting + core.load.views(103.0)[1].waiting == 1


def test_load_tracker_survives_reassignment_clock_steps_and_re_registration() -> None:
    lt = LoadTracker(stale_after_s=1.0)
    lt.register("a", BS, Linear())
    lt.register("b", BS, Linear())
    lt.on_snapshot(LoadSnapshot("a", 10.0, 0, 0, 0.0, 0.0, 0))
    lt.assigned("r1", "a", 100, now=10.5)
    lt.assigned("r2", "a", 200, now=9.5)  # the clock stepped back: older than the snapshot
    lt.assigned("r3", "a", 400, now=10.6)
    a, b = lt.views(now=10.7)
    assert (a.waiting, a.pending_prefill_tokens) == (2, 500)
    lt.assigned("r1", "b", 800, now=10.7)  # assigned again elsewhere: replaces the first
    lt.prefill_done("r3", 10.7)
    a, b = lt.views(now=10.7)
    assert (a.waiting, a.running, a.pending_prefill_tokens) == (0, 0, 0)  # fresh: engine's
    assert (b.waiting, b.running, b.pending_prefill_tokens) == (1, 0, 800)  # no snapshot
    lt.remove("b")
    lt.register("b", BS, Linear())  # back again: its requests in flight still count
    assert [v.waiting for v in lt.views(now=10.7)] == [0, 1]
    a, _ = lt.views(now=20.0)  # stale: r2 waiting, r3 running
    assert (a.waiting, a.running, a.pending_prefill_tokens) == (1, 1, 200)
    for rid in ("r1", "r2", "r3", "r1"):
        lt.finished(rid)
    assert lt.in_flight() == 0
    assert [(v.waiting, v.running) for v in lt.views(now=20.0)] == [(0, 0), (0, 0)]


def test_the_slo_gate_counts_time_already_spent_in_the_queue() -> None:
    """A request that waited in admission's queue has that much less TTFT budget left."""
    from router.dispatch import Dispatcher
    from router.state import RouterState

    state = RouterState(RouterSettings(block_size=BS, slo_ttft_s=0.5), Linear())
    state.sync_instances(["a"])
    d = Dispatcher(state, client=None)  # type: ignore[arg-type]
    r = req(100)  # 160 ms cold on an idle instance
    assert d.place(r, set(), waited_s=0.2) is not None
    with pytest.raises(Rejected):
        d.place(r, set(), waited_s=0.4)


def test_a_failover_finishes_each_attempt_on_its_own_instance() -> None:
    """The engine placed first fails before any token (a real sim engine that is not running);
    the retry runs on the other. Each attempt is finished on the instance it ran on, once."""
    from engines.base import EngineRequest, RoutedRequest
    from engines.sim.engine import SimEngine
    from router.dispatch import Dispatcher
    from router.local_client import LocalEngineClient
    from router.state import RouterState

    finished: list[str] = []

    class Recording(type(create_scorer("round_robin"))):  # type: ignore[misc]
        def on_finished(self, request: PlacementRequest, instance_id: str) -> None:
            finished.append(instance_id)

    down = SimEngine("a", kv_events_endpoint=None, time_scale=0)  # never started
    up = SimEngine("b", kv_events_endpoint=None, time_scale=0)
    state = RouterState(RouterSettings(block_size=BS), Linear(), scorer=Recording())
    state.sync_instances(["a", "b"])
    d = Dispatcher(state, LocalEngineClient({"a": down, "b": up}))
    routed = RoutedRequest(EngineRequest("r", list(range(40))), "x", list(range(1, 3)))

    async def run() -> list[str]:
        await up.start()
        try:
            return [p.instance_id async for p, _ in d.stream(routed, Placement("a"))]
        finally:
            await up.stop()

    served = asyncio.run(run())
    assert set(served) == {"b"} and d.failovers == 1
    assert finished == ["a", "b"]
    assert state.load.in_flight() == 0


def test_a_request_whose_engine_dies_mid_stream_migrates() -> None:
    """Engine "a" dies after three outputs (the error Serve's handle raises when a replica
    dies); the request goes on at "b" as prompt + those tokens, for the tokens still owed: the
    client sees one stream of ``max_tokens`` tokens and usage counted against its own prompt.
    With no migrations allowed the same death is ``StreamBroken``."""
    from engines.base import EngineRequest, RoutedRequest, SamplingParams
    from engines.sim.engine import SimEngine
    from router.dispatch import Dispatcher, StreamBroken
    from router.local_client import LocalEngineClient
    from router.state import RouterState

    legs: list[EngineRequest] = []

    class Dying(LocalEngineClient):
        async def stream(self, routed: RoutedRequest):  # type: ignore[no-untyped-def, override]
            legs.append(routed.request)
            n = 0
            async for out in super().stream(routed):
                if routed.target_instance == "a" and n == 3:
                    raise ConnectionError("replica died")
                n += 1
                yield out

    async def run(max_migrations: int) -> list[EngineOutput]:
        engines = {i: SimEngine(i, kv_events_endpoint=None, time_scale=0) for i in "ab"}
        state = RouterState(RouterSettings("round_robin", block_size=BS), Linear())
        state.sync_instances(["a", "b"])
        d = Dispatcher(state, Dying(engines), max_migrations=max_migrations)
        sampling = SamplingParams(max_tokens=10, min_tokens=5, ignore_eos=True)
        routed = RoutedRequest(EngineRequest("r", list(range(40)), sampling), "x", [1, 2])
        for e in engines.values():
            await e.start()
        try:
            return [out async for _, out in d.stream(routed, Placement("a"))]
        finally:
            for e in engines.values():
                await e.stop()
            assert state.load.in_flight() == 0

    outs = asyncio.run(run(max_migrations=2))
    tokens = [t for o in outs for t in o.token_ids]
    assert len(tokens) == 10 and outs[-1].finished
    _, second = legs
    assert second.request_id == "r-leg2"
    assert second.prompt_token_ids == list(range(40)) + tokens[:3]
    assert (second.sampling.max_tokens, second.sampling.min_tokens) == (7, 2)
    usage = outs[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (40, 10)
    legs.clear()
    with pytest.raises(StreamBroken):
        asyncio.run(run(max_migrations=0))


def test_load_tracker_prices_the_step_in_flight_from_its_own_backlog() -> None:
    """A snapshot leaves out the prefill an engine is computing: what this router sent there
    and has not seen a first token of stands in for it, at the model's rate, by its own
    pricing (one after another from when each was sent), for at most one step."""
    lt = LoadTracker(stale_after_s=1.0)
    lt.register("a", BS, Linear(max_num_batched_tokens=1000))  # 10k tokens/s, 1000 a step
    lt.assigned("r1", "a", 800, now=10.0)  # 80 ms of prefill
    lt.on_snapshot(LoadSnapshot("a", 10.0, 0, 1, 0.1, 0.0, 0))  # r1 scheduled: nothing queued
    assert lt.views(now=10.02)[0].pending_prefill_tokens == 600
    assert lt.views(now=10.05)[0].pending_prefill_tokens == 300
    (v,) = lt.views(now=10.09)
    assert v.pending_prefill_tokens == 0
    assert lt.views(now=10.2)[0] is v  # behind now: the view is kept again
    lt.on_snapshot(LoadSnapshot("a", 10.15, 0, 1, 0.1, 0.0, 0))
    lt.assigned("r2", "a", 5000, now=10.2)  # 500 ms, newer than the snapshot: counted whole
    assert lt.views(now=10.2)[0].pending_prefill_tokens == 5000
    lt.on_snapshot(LoadSnapshot("a", 10.3, 0, 1, 0.1, 0.0, 2000))
    # r1 still unprefilled (80 ms from 10.0), r2 400 ms from its end: the backlog (4000 tokens)
    # raises the snapshot's 2000 by one step at most
    assert lt.views(now=10.3)[0].pending_prefill_tokens == 3000
    lt.prefill_done("r2", 10.3)  # the backlog is r1's alone again, long done
    assert lt.views(now=10.3)[0].pending_prefill_tokens == 2000
    lt.assigned("r2", "a", 5000, now=10.3)  # assigned again: replaces its old assignment
    lt.assigned("r2", "a", 5000, now=10.3)
    lt.on_snapshot(LoadSnapshot("a", 10.3, 0, 1, 0.1, 0.0, 0))
    assert lt.views(now=10.6)[0].pending_prefill_tokens == 1000  # 200 ms left, capped


def test_load_tracker_views_are_kept_while_unchanged_and_equal_a_fresh_build() -> None:
    """``views`` rebuilds only the views of instances that moved (the same object otherwise),
    and what it returns is what a tracker building every view afresh returns, through
    snapshots (some older), assignments, prefills, finishes, failures, views going stale by
    time alone, a backlog shrinking with time alone and the clock stepping back."""
    import random

    rng = random.Random(7)
    ops: list[tuple] = []

    def replay() -> LoadTracker:
        lt = LoadTracker(stale_after_s=1.0)
        for iid in "abcd":  # two price a step in flight at most (the backlog's cap)
            lt.register(iid, BS, Linear(max_num_batched_tokens=300 if iid in "ab" else ANY_PROMPT))
        for op, *args in ops:
            getattr(lt, op)(*args)
        return lt

    def fields(views: list[InstanceView]) -> list[tuple]:
        return [
            (v.instance_id, v.waiting, v.running, v.gpu_kv_usage, v.pending_prefill_tokens,
             v.healthy)
            for v in views
        ]  # fmt: skip

    live = replay()
    now, rid = 10.0, 0
    before = live.views(now)
    for _ in range(400):
        kind = rng.random()
        iid = rng.choice("abcd")
        if kind < 0.3:
            ts = now - rng.choice([0.0, 0.05, 0.5, 3.0])
            snap = LoadSnapshot(iid, ts, rng.randrange(3), rng.randrange(3), 0.1, 0.0, 100)
            ops.append(("on_snapshot", snap))
        elif kind < 0.55:
            rid += 1
            ops.append(("assigned", f"r{rid}", iid, rng.randrange(1, 5000), now))
        elif kind < 0.7:
            ops.append(("prefill_done", f"r{rng.randrange(1, rid + 2)}", now))
        elif kind < 0.85:
            ops.append(("finished", f"r{rng.randrange(1, rid + 2)}"))
        elif kind < 0.9:
            ops.append(("mark_failed", iid))
        if ops:
            getattr(live, ops[-1][0])(*ops[-1][1:])
        # (small steps walk a backlog down: its part of the report changes with time alone)
        now += rng.choice([0.0, 0.002, 0.01, 0.03, 0.3, 1.5]) if rng.random() > 0.03 else -2.0
        got = live.views(now)
        assert fields(got) == fields(replay().views(now))
        assert all(live.view(v.instance_id) is v for v in got)  # the lookup of the same views
        assert live.view("nobody") is None
        if kind >= 0.9 and rng.random() < 0.5:  # nothing happened: the same objects
            again = live.views(now)
            assert all(a is b for a, b in zip(again, got, strict=True))
        before = got
    assert before


def test_router_core_apply_registers_and_refreshes_from_the_load_bus() -> None:
    """What a pump applies: a sampled instance is registered (in sample order) and holds its
    latest sample; one registered after its sample arrived gets it at the next pump; a failed
    instance is back with its next sample, not before."""
    from engines.bus.base import InProcessBus
    from engines.bus.forwarder import encode_load
    from router.core import RouterCore

    kv, loads = InProcessBus(), InProcessBus()
    core = RouterCore(
        RouterSettings("least_loaded", block_size=BS), Linear(), kv_bus=kv, load_bus=loads
    )
    for iid in ("b", "a"):
        loads.publish(encode_load(LoadSnapshot(iid, 1.0, 1, 0, 0.0, 0.0, 0)))
    core.pump(1.0)
    assert [v.instance_id for v in core.load.views(1.0)] == ["b", "a"]
    assert [v.waiting for v in core.load.views(1.0)] == [1, 1]
    core.remove_instance("a")  # forgets its sample too
    loads.publish(encode_load(LoadSnapshot("b", 1.1, 2, 0, 0.0, 0.0, 0)))
    core.load.remove("b")  # gone from the table only: the next pump registers it again
    core.failed("b")
    core.pump(1.1)
    ((v),) = core.load.views(1.1)
    assert (v.instance_id, v.waiting, v.healthy) == ("b", 2, True)
    core.failed("b")
    assert not core.load.views(1.1)[0].healthy
    core.pump(1.15)  # no new sample: skipped until one comes (``mark_failed``'s contract)
    assert not core.load.views(1.15)[0].healthy
    loads.publish(encode_load(LoadSnapshot("b", 1.15, 2, 0, 0.0, 0.0, 0)))
    core.pump(1.16)
    assert core.load.views(1.16)[0].healthy
    core.load.remove("b")
    core.add_instance("b")  # registered after its sample arrived
    core.pump(1.2)
    assert core.load.views(1.2)[0].waiting == 2


@pytest.mark.parametrize(
    ("with_map", "vector_from", "interference"),
    [(False, None, 0.02), (True, None, 0.02), (True, 1, 0.02), (True, None, 0.0)],
)
def test_kv_ttft_among_many_instances_chooses_as_pricing_every_one(
    with_map: bool, vector_from: int | None, interference: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From ``_INDEXED_FROM`` instances on, kv_ttft prices only those that can win; through
    views that change a few at a time (others kept, as LoadTracker keeps them), rosters that
    change, unhealthy instances and calibrations, it chooses what pricing all of them chooses,
    with the same estimate, tie-breaks included (with a cache map attached: the emptiest cache
    among near-ties too, weighed in numpy for every group with ``vector_from`` 1), and the
    same toll for the work a request adds once requests meet queues (and, with
    ``interference``, the same charge for the sequences it stalls behind a queue)."""
    import random

    from router.scorers import kv_index, kv_ttft

    if vector_from is not None:
        monkeypatch.setattr(kv_index, "_VECTOR_FROM", vector_from)
    rng = random.Random(3)
    fast = create_scorer("kv_ttft", interference=interference)
    full = create_scorer("kv_ttft", interference=interference)
    cache = CacheMap()
    if with_map:
        fast.attach(cache)
        full.attach(cache)
    slow, other = Linear(), Linear(tok_s=5_000.0, load_tok_s=100.0)  # CPU hits cost there
    n = kv_ttft._INDEXED_FROM + 8

    def fresh(iid: str) -> InstanceView:
        return InstanceView(
            iid,
            BS,
            rng.choice([slow, slow, other]),
            waiting=rng.choice([0, 0, 0, 1, 2]),
            running=rng.choice([0, 1, 1, 2, 5]),
            pending_prefill_tokens=rng.choice([0, 0, 0, 64, 640]),
            healthy=rng.random() > 0.05,
            kv_capacity_blocks=rng.choice([0, 7, 64, 64]),
        )

    views = [fresh(f"i{k}") for k in range(n)]
    for step in range(300):
        for _ in range(rng.choice([0, 1, 3, n])):
            k = rng.randrange(len(views))
            views[k] = fresh(views[k].instance_id)
        if step % 50 == 49:  # an instance leaves, another joins
            views = [*views[1:], fresh(f"j{step}")]
        r = req(rng.randrange(1, 40))
        match = {
            v.instance_id: Match(g, g + rng.choice([0, 2]))
            for v in rng.sample(views, rng.choice([0, 1, 3, 12]))
            for g in [rng.choice([0, 0, 1, 2, rng.randrange(0, 30)])]
        }
        for s in (fast, full):
            assert s.calibration is not None
            s.calibration.a, s.calibration.b = (1.0, 0.0) if step < 100 else (1.3, 0.01)
            # from step 200 every request lately met a queue: the toll weighs the waiting
            # requests per healthy instance, which the index keeps as running totals
            if step >= 200:
                s.queued_share = 1.0
        if not any(v.healthy for v in views):
            continue
        if with_map and step % 7 == 0:  # some instances store a few blocks
            for v in rng.sample(views, 5):
                cache.store(v.instance_id, Tier.GPU, [rng.getrandbits(62) for _ in range(3)])
        if with_map and step % 40 == 39:  # one leaves the map, its bit freed for another
            cache.drop_instance(rng.choice(views).instance_id)
        got = fast.place(r, list(views), match)
        kv_ttft._INDEXED_FROM, saved = 10**9, kv_ttft._INDEXED_FROM
        try:
            want = full.place(r, list(views), match)
        finally:
            kv_ttft._INDEXED_FROM = saved
        assert got == want
    # the first of many equal idle instances holds a prefix that costs more to load from its
    # CPU tier than to compute: the next one wins, though it shares the first one's group
    same = [InstanceView(f"s{k}", BS, other) for k in range(n)]
    assert fast.place(req(8), same, {"s0": Match(0, 5)}).instance_id == "s1"
    # two with the same GPU run, the first with more of it on CPU: the second one wins
    got = fast.place(req(8), same, {"s0": Match(2, 7), "s1": Match(2, 2)})
    assert got.instance_id == "s1"


def test_kv_ttft_interference_charges_the_sequences_a_prefill_stalls_behind_a_queue() -> None:
    """With ``interference``, an instance whose queued prefill already fills a step is charged,
    per running sequence, the request's own engine time: its prefill lengthens the steps those
    sequences decode in. Behind a queue that fits one step nothing is charged."""
    deep = Linear(max_num_batched_tokens=100)
    busy = InstanceView("busy", BS, deep, running=50, pending_prefill_tokens=200)
    quiet = InstanceView("quiet", BS, deep, running=0, pending_prefill_tokens=300)
    r = req(8)  # 128 tokens: 12.8 ms of prefill; busy's queue is 10 ms shorter
    assert (
        create_scorer("kv_ttft", interference=0).place(r, [busy, quiet], {}).instance_id == "busy"
    )
    placed = create_scorer("kv_ttft").place(r, [busy, quiet], {})  # 0.02 by default
    # busy costs 0.02 x 50 x 12.8 ms more: quiet wins, and admission sees its plain estimate
    assert placed.instance_id == "quiet"
    assert placed.estimated_ttft_s == pytest.approx((300 + 128) / 10_000.0)
    one_step = Linear(max_num_batched_tokens=1000)
    shallow = [replace(v, latency=one_step) for v in (busy, quiet)]
    placed = create_scorer("kv_ttft").place(r, shallow, {})
    assert placed.instance_id == "busy"
    with pytest.raises(ValueError, match="interference"):
        create_scorer("kv_ttft", interference=-1)


def test_kv_ttft_spreads_cold_prefixes_over_the_emptiest_caches() -> None:
    """Between idle engines a cold prompt goes to the engine whose cache holds least (by the
    cache map the core attaches), not to the first in view order: the cluster's whole cache
    fills instead of the first engines' evicting."""
    from router.core import RouterCore

    core = RouterCore(RouterSettings(block_size=BS), Linear())
    for iid in ("a", "b", "c"):
        core.add_instance(iid)
    placed = []
    for k in range(6):
        r = PlacementRequest(f"r{k}", 4 * BS, [1000 * k + j for j in range(4)])
        p = core.place(r, 0.0)
        placed.append(p.instance_id)
        core.cache_map.store(p.instance_id, Tier.GPU, list(r.block_hashes))
    assert sorted(placed[:3]) == ["a", "b", "c"]
    assert sorted(placed[3:]) == ["a", "b", "c"]
    # a near-tie with a cached prefix (its one block saves 1.6 ms, under tie_s) stays with the
    # cache, though that engine's cache is the fullest
    core.cache_map.store("c", Tier.GPU, [9001])
    short = PlacementRequest("s", 4 * BS, [9001, 9002, 9003, 9004])
    assert core.place(short, 0.0).instance_id == "c"
    # without it (spread_cold off), every cold prompt lands on the first engine
    core.scorer = create_scorer("kv_ttft", spread_cold=False)
    r = PlacementRequest("x", 4 * BS, [7, 8, 9, 10])
    assert core.place(r, 0.0).instance_id == "a"


def test_kv_ttft_stays_with_its_cache_when_going_cold_saves_little() -> None:
    """With ``affinity_s`` (off by default), within it of the best estimate the longest cached
    prefix wins: a few ms saved by going cold are not worth a second copy of the prefix; past
    it, the estimate."""
    s = create_scorer("kv_ttft", calibrate=False, affinity_s=0.02)
    r = req(20)
    # a's 2 cached blocks save 3.2 ms, its queue costs 10: b (cold) is 6.8 ms faster
    busy = view("a", pending_prefill_tokens=100)
    got = s.place(r, [busy, view("b")], {"a": Match(2, 2)})
    assert got.instance_id == "a"
    far = view("a", pending_prefill_tokens=20_000)  # a queue far past the slack
    assert s.place(r, [far, view("b")], {"a": Match(2, 2)}).instance_id == "b"
    off = create_scorer("kv_ttft", calibrate=False)
    assert off.place(r, [busy, view("b")], {"a": Match(2, 2)}).instance_id == "b"


def test_kv_ttft_charges_the_work_it_adds_once_requests_cannot_avoid_queues() -> None:
    """``externality``: each instance's estimate is charged the engine time the request takes
    there, times the waiting requests per instance, as far as recent requests could not avoid
    a queue. While they can, a busy cache holder loses to an idle cold engine on the estimate
    alone; once every engine has had requests waiting, the prefix hit's saved work wins, and
    when queue-free engines come back the toll fades again."""
    s = create_scorer("kv_ttft", calibrate=False)
    r = req(100)  # 1,600 tokens: 160 ms cold; 1.6 ms on a's cache (it recomputes one block)
    match = {"a": Match(100, 100)}
    # a holds the prefix behind 200 ms of queue (2 requests); b is cold with 1 request waiting
    # but nothing queued yet (its prefill starts now)
    state = [view("a", pending_prefill_tokens=2000, waiting=2), view("b", waiting=1)]
    assert s.place(r, state, match).instance_id == "b"
    # a burst: for 64 placements every engine's best option already had requests waiting
    for k in range(64):
        busy = [view(f"x{j}", waiting=2, pending_prefill_tokens=100) for j in range(3)]
        s.place(req(4 + k % 3), busy, {})
    assert s.queued_share > 0.6
    got = s.place(r, state, match)
    assert got.instance_id == "a"
    assert got.estimated_ttft_s == pytest.approx(0.2016)  # the estimate itself, toll aside
    assert create_scorer("kv_ttft", externality=0.0).place(r, state, match).instance_id == "b"
    # queue-free engines again: the share decays, and the request goes cold to b
    for _ in range(300):
        s.place(req(4), [view("y0"), view("y1")], {})
    assert s.queued_share < 0.01
    assert s.place(r, state, match).instance_id == "b"
    with pytest.raises(ValueError, match="externality"):
        create_scorer("kv_ttft", externality=-1.0)


def test_placement_records_pickle_compiled_or_not() -> None:
    """The router's records survive pickle and a copy (a frozen dataclass compiled by
    ``deploy.native`` refuses pickle's default restore, hence their ``__reduce__``)."""
    import copy
    import pickle

    leg = Placement("p0", 0.05, 3)
    records = [
        PlacementRequest("r1", 40, [1, 2, 3], max_tokens=8, session_key="s", category="api"),
        Placement("d0", 0.2, 1, {"why": "test"}, prefill=leg, transfer_tokens=48),
        InstanceView("e0", BS, Linear(), kv_capacity_blocks=10, waiting=2, running=1),
    ]
    for r in records:
        assert pickle.loads(pickle.dumps(r)) == r
        assert copy.deepcopy(r) == r


def test_kv_ttft_replicas_share_out_near_equal_candidates_only_when_asked() -> None:
    """Router replicas placing at once from one view all pick the best (they herd); with
    ``replica_spread`` each takes its own among the candidates about as good."""
    from router.scorers.kv_ttft import KvTtftScorer

    views = [view(f"e{i}") for i in range(8)]
    req = PlacementRequest("r", 4000, list(range(4000 // BS)))

    def picks(spread: bool) -> set[str]:
        out = set()
        for i in range(4):
            s = KvTtftScorer(replica_spread=spread, calibrate=False)
            s.as_replica(i, 4)
            out.add(s.place(req, views, {}).instance_id)
        return out

    assert len(picks(False)) == 1
    assert len(picks(True)) == 4
    with pytest.raises(ValueError, match="replica index"):
        KvTtftScorer().as_replica(4, 4)
