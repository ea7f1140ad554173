"""Per-key rate limits over real HTTP (sim engines): a flood from one key is refused with 429 and
Retry-After while another key is still served; an over-long prompt is a 400, not a crash."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from deploy.local import LocalStack
from engines.profile import LatencyProfile
from engines.sim.engine import SimEngine
from engines.sim.options import SimEngineOptions
from engines.tiny_model import build_tiny_model
from router.tokenizer import PromptTokenizer
from tests.support import Server, free_port

MODEL = "tiny-sim"
NOISY, QUIET, OTHER = "sk-noisy", "sk-quiet", "sk-other"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    tok = PromptTokenizer(build_tiny_model())
    profile = LatencyProfile.load("cpu-tiny-llama")
    engine = SimEngine(
        "sim-0",
        profile,
        time_scale=0.0,
        options=SimEngineOptions(block_size=32, vocab_size=tok.vocab_size, token_offset=10),
    )
    stack = LocalStack(
        {"sim-0": engine},
        model=MODEL,
        block_size=32,
        max_model_len=2048,
        latency=profile,
        tokenizer=tok,
        api_keys=frozenset({NOISY, QUIET, OTHER}),
        rate_limit=2.0,
        rate_burst=5,
    )
    with Server(stack, free_port()) as s:
        yield s


def post(server: Server, key: str, prompt: str = "hello") -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{server.port}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def test_a_flood_from_one_key_is_limited_while_another_is_served(server: Server) -> None:
    noisy = [post(server, NOISY) for _ in range(20)]
    codes = [r.status_code for r in noisy]
    assert codes[:5] == [200] * 5  # the burst
    limited = [r for r in noisy if r.status_code == 429]
    assert len(limited) >= 10, codes
    err = limited[0].json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limited"
    assert int(limited[0].headers["retry-after"]) >= 1
    assert [post(server, QUIET).status_code for _ in range(5)] == [200] * 5


def test_an_oversized_prompt_is_a_clean_400(server: Server) -> None:
    r = post(server, OTHER, "word " * 5000)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
