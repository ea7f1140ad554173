"""Router overhead: what the ingress + placement add over a direct engine call. Prints JSON.

    .venv/bin/python benchmarks/router_bench.py [--requests 2000] [--repeats 5]

- ``added_p50_us``: a completions request with a token-id prompt (tokenization excluded)
  through the whole FastAPI app in process (validation, hashing, admission, placement against
  a live cache map, dispatch, response) minus the same request sent to the engine over HTTP
  without a router: a minimal FastAPI endpoint that reads the body, calls the engine and
  answers (what a client pays calling an engine's own OpenAI server), through the same
  in-process client. Both on sim engines with zero step time, so the difference is router work.
  ``added_over_call_p50_us`` is the older figure: minus a bare in-process ``generate`` call
  (it also counts the HTTP client, the transport and FastAPI, which any HTTP API pays).
- ``decisions_per_s``: ``RouterState.place`` calls per second (kv_ttft) with 16 instances and
  a cache map of 200k blocks, prompts of 2,048 tokens sharing system prompts.
- ``tokenize_us``: chat-template + tokenization of a ~1,000-token conversation (reported
  separately, as the issue asks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Any

import httpx
import numpy as np
from fastapi import FastAPI, Request

from cachemap import Tier, block_hashes, salt_hash
from deploy.local import LocalStack
from engines.base import EngineRequest, SamplingParams
from engines.profile import LatencyProfile
from engines.sim.engine import SimEngine
from engines.sim.options import SimEngineOptions
from engines.tiny_model import build_tiny_model
from router.placement import PlacementRequest
from router.settings import RouterSettings
from router.state import RouterState
from router.tokenizer import PromptTokenizer

BS = 32


async def overhead(n: int, tok: PromptTokenizer, profile: LatencyProfile) -> dict[str, float]:
    engines = {
        f"e{i}": SimEngine(
            f"e{i}",
            profile,
            time_scale=0.0,
            options=SimEngineOptions(block_size=BS, vocab_size=tok.vocab_size, token_offset=10),
        )
        for i in range(2)
    }
    stack = LocalStack(
        engines, model="bench", block_size=BS, max_model_len=4096, latency=profile, tokenizer=tok
    )
    await stack.start()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(20, 400, 1024).tolist() for _ in range(16)]
    call, http, routed = [], [], []
    routed_client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=stack.app), base_url="http://bench"
    )
    direct_client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=engine_endpoint(engines["e1"])), base_url="http://e1"
    )
    async with routed_client, direct_client:
        for i in range(n):
            p = prompts[i % len(prompts)]
            body = {"model": "bench", "prompt": p, "max_tokens": 1}
            t0 = time.perf_counter()
            async for _ in engines["e0"].generate(
                EngineRequest(f"d{i}", p, SamplingParams(max_tokens=1))
            ):
                pass
            call.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            r = await direct_client.post("/v1/completions", json=body)
            http.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            t0 = time.perf_counter()
            r = await routed_client.post("/v1/completions", json=body)
            routed.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
    await stack.stop()
    c, h, r = (np.asarray(x[n // 10 :]) * 1e6 for x in (call, http, routed))
    return {
        "engine_call_p50_us": float(np.percentile(c, 50)),
        "engine_http_p50_us": float(np.percentile(h, 50)),
        "routed_p50_us": float(np.percentile(r, 50)),
        "added_p50_us": float(np.percentile(r, 50) - np.percentile(h, 50)),
        "added_p99_us": float(np.percentile(r, 99) - np.percentile(h, 99)),
        "added_over_call_p50_us": float(np.percentile(r, 50) - np.percentile(c, 50)),
    }


def engine_endpoint(engine: SimEngine) -> FastAPI:
    """An engine's HTTP endpoint with no router: read the body, generate, answer."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await request.json()
        req = EngineRequest(
            uuid.uuid4().hex, body["prompt"], SamplingParams(max_tokens=body["max_tokens"])
        )
        tokens: list[int] = []
        usage = None
        async for out in engine.generate(req):
            tokens += out.token_ids
            usage = out.usage
        assert usage is not None
        return {
            "object": "text_completion",
            "choices": [{"index": 0, "token_ids": tokens, "finish_reason": "length"}],
            "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": len(tokens)},
        }

    return app


def decisions(n: int, profile: LatencyProfile) -> float:
    rng = np.random.default_rng(1)
    state = RouterState(RouterSettings(block_size=BS, kv_capacity_blocks=20_000), profile)
    ids = [f"e{i}" for i in range(16)]
    state.sync_instances(ids)
    salt = salt_hash("bench")
    systems = [rng.integers(0, 30_000, 1024).tolist() for _ in range(32)]
    prompts = []
    for k in range(400):
        toks = systems[k % 32] + rng.integers(0, 30_000, 1024).tolist()
        h = block_hashes(toks, BS, salt)
        for inst in rng.choice(ids, 4, replace=False):
            state.cache_map.store(str(inst), Tier.GPU, h[: int(rng.integers(32, 64))])
        prompts.append(PlacementRequest(f"r{k}", len(toks), h))
    t0 = time.perf_counter()
    for i in range(n):
        state.place(prompts[i % len(prompts)])
    return n / (time.perf_counter() - t0)


def tokenize_us(tok: PromptTokenizer, n: int = 200) -> float:
    msgs = [
        {"role": "system", "content": "You are a careful assistant. " * 60},
        {"role": "user", "content": "Summarise the following. " * 40},
    ]
    t0 = time.perf_counter()
    for _ in range(n):
        tok.chat(msgs)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tok = PromptTokenizer(build_tiny_model())
    profile = LatencyProfile.load("cpu-tiny-llama")
    runs = [asyncio.run(overhead(args.requests, tok, profile)) for _ in range(args.repeats)]
    out: dict[str, object] = {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}
    out["decisions_per_s"] = round(
        statistics.median(decisions(5000, profile) for _ in range(args.repeats))
    )
    out["tokenize_us_per_1k_token_chat"] = round(
        statistics.median(tokenize_us(tok) for _ in range(args.repeats)), 1
    )
    out["repeats"] = args.repeats
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
