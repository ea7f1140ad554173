"""The OpenAI endpoint over real HTTP (uvicorn) in one process: two real sim engines, their KV
events through real forwarders and an in-process bus into the router's cache map, and the
official ``openai`` client. (The Ray Serve deployment of the same app: test_serve_app.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from deploy.local import LocalStack
from engines.sim import LatencyProfile
from engines.sim.engine import SimEngine
from engines.tiny_model import build_tiny_model
from router.admission import Admission
from router.tokenizer import PromptTokenizer
from tests.support import (
    Server,
    free_port,
    instance_gauge,
    settle,
    sim_stack,
    span_exporter,
    wait_for,
)

MODEL = "tiny-sim"
KEY = "sk-test"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    stack = sim_stack(
        api_keys=frozenset({KEY}), admission=Admission(max_in_flight=64, max_queue=64)
    )
    with Server(stack, free_port()) as s:
        yield s


@pytest.fixture()
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0)


LONG = "You are a careful assistant. " * 60


def test_models_and_health(client: openai.OpenAI, server: Server) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(f"http://127.0.0.1:{server.port}/health")
    assert r.status_code == 200 and r.json()["instances"] == 2


def test_chat_completion_and_cached_tokens_on_the_same_instance(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": LONG}, {"role": "user", "content": "hello"}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8)
    assert first.choices[0].message.role == "assistant"
    assert first.usage.completion_tokens == 8 and first.choices[0].finish_reason == "length"
    settle()  # KV events reach the router's map
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32


def test_streaming_chat_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_completions_text_and_token_ids(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=5)
    assert text.usage.completion_tokens == 5 and isinstance(text.choices[0].text, str)
    ids = client.completions.create(model=MODEL, prompt=list(range(40, 140)), max_tokens=3)
    assert ids.usage.prompt_tokens == 100
    streamed = list(
        client.completions.create(model=MODEL, prompt="stream", max_tokens=4, stream=True)
    )
    assert streamed[-1].choices[0].finish_reason == "length"


def _error(
    server: Server, path: str, body: bytes | dict, headers: dict | None = None
) -> httpx.Response:
    h = {"authorization": f"Bearer {KEY}", "content-type": "application/json", **(headers or {})}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"http://127.0.0.1:{server.port}{path}", content=data, headers=h)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        (b"{not json", 400, None),
        # nested past any parser's depth (a RecursionError: was a 500), non-standard JSON
        # (NaN), a body that is not UTF-8
        (b"[" * 5000 + b"]" * 5000, 400, None),
        (b'{"model": "' + MODEL.encode() + b'", "temperature": NaN}', 400, None),
        (b'{"model": "\xff"}', 400, None),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        # PD parameters the engine cannot use (no remote to pull from): the engine's refusal
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "kv_transfer_params": {"do_remote_prefill": True},
            },
            400,
            None,
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            400,
            "max_tokens",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 9},
            400,
            "temperature",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]},
            400,
            "messages",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000},
            400,
            "max_tokens",
        ),
    ],
)
def test_client_errors_are_openai_shaped(server: Server, body, status: int, param) -> None:
    r = _error(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_body_limit_auth_and_sdk_errors(server: Server, client: openai.OpenAI) -> None:
    big = {"model": MODEL, "prompt": "x" * (5 << 20)}
    assert _error(server, "/v1/completions", big).status_code == 413

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit applies while streaming
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(6):
            yield b"x" * (1 << 20)
        yield b'"}'

    r = httpx.post(
        f"http://127.0.0.1:{server.port}/v1/completions",
        content=chunked(),
        headers={"authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(f"http://127.0.0.1:{server.port}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[10**9], max_tokens=2)
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_metrics_expose_router_state(server: Server, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=2)
    body = httpx.get(f"http://127.0.0.1:{server.port}/metrics").text
    assert "kvroute_requests_total" in body and "kvroute_cache_map_blocks" in body


def test_a_client_gone_mid_stream_frees_its_engine_as_the_load_gauges_show() -> None:
    """``kvroute_instance_running`` shows a streamed request running on its engine; when the
    client closes the connection mid-stream the engine aborts it, and the gauge is back to 0
    within 1.5 s, where the whole answer (4,000 tokens at the tiny profile's real step time,
    ``time_scale`` 1) would run for over 4 s more."""
    stack = sim_stack(time_scale=1.0, max_model_len=4096)
    with Server(stack, free_port()) as s:
        base = f"http://127.0.0.1:{s.port}"
        body = {
            "model": MODEL,
            "prompt": "a client that goes away",
            "max_tokens": 4000,
            "min_tokens": 4000,
            "stream": True,
        }
        seen = 0.0  # running requests the gauges showed while the client read its stream
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                if chunks % 50 == 1:
                    seen = sum(instance_gauge(base, "kvroute_instance_running").values())
                if seen >= 1 or chunks > 2000:
                    break  # NOTE: leaving iter_lines closes the connection: the client is gone
        assert seen == 1, f"the running request never showed ({chunks} chunks read)"

        def idle() -> bool:
            return sum(instance_gauge(base, "kvroute_instance_running").values()) == 0

        assert wait_for(idle, 1.5), "the engine kept running the request"
        waiting = instance_gauge(base, "kvroute_instance_waiting")
        assert set(waiting) == {"sim-0", "sim-1"} and sum(waiting.values()) == 0


def test_spans_join_the_callers_trace(server: Server) -> None:
    exporter = span_exporter()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = _error(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": "traced", "max_tokens": 2},
        headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
    )
    assert r.status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"kvroute.ingress", "kvroute.placement"} <= set(spans)
    assert format(spans["kvroute.ingress"].context.trace_id, "032x") == trace_id
    assert spans["kvroute.placement"].attributes["kvroute.instance"].startswith("sim-")


def test_all_engines_down_is_a_clean_503() -> None:
    tok = PromptTokenizer(build_tiny_model())
    profile = LatencyProfile.load("cpu-tiny-llama")
    engine = SimEngine("only", profile, block_size=32, vocab_size=tok.vocab_size, token_offset=10)
    stack = LocalStack(
        {"only": engine},
        model=MODEL,
        block_size=32,
        max_model_len=2048,
        latency=profile,
        tokenizer=tok,
    )
    with Server(stack, free_port()) as s:
        asyncio.run_coroutine_threadsafe(engine.stop(), s.loop).result(timeout=30)
        r = httpx.post(
            f"http://127.0.0.1:{s.port}/v1/completions",
            json={"model": MODEL, "prompt": "anyone there?", "max_tokens": 2},
        )
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_unavailable"
        assert r.headers["retry-after"] == "1"


def test_policy_hints_reach_the_engine(server: Server, monkeypatch) -> None:
    """Category, turn, the conversation's ids and the client's continuation probability reach
    the engine's CPU-tier policy, parsed by the one parser the engines use; a bad continuation
    is a 400 naming the header."""
    from policies.base import RequestInfo

    seen: list[RequestInfo | None] = []
    for engine in server.stack.engines.values():
        original = engine.generate

        def spy(request, original=original):  # type: ignore[no-untyped-def]
            seen.append(RequestInfo.from_hints(request.kv_transfer_params))
            return original(request)

        monkeypatch.setattr(engine, "generate", spy)
    base = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    headers = {"authorization": f"Bearer {KEY}", "x-kvroute-category": "search"}
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    body = {"model": MODEL, "max_tokens": 2, "user": "u-1"}
    r1 = httpx.post(base, json={**body, "messages": turn1}, headers=headers, timeout=30)
    r2 = httpx.post(
        base,
        json={**body, "messages": turn2},
        headers={**headers, "x-kvroute-continuation": "0.3"},
        timeout=30,
    )
    r3 = httpx.post(
        base, json={**body, "messages": turn2, "kvroute_continuation": 0.9}, headers=headers
    )
    assert (r1.status_code, r2.status_code, r3.status_code) == (200, 200, 200)
    first, second, third = seen
    assert first is not None and second is not None and third is not None
    assert (first.category, first.turn, first.parent_id) == ("search_1", 1, None)
    assert first.session_id is not None and first.continuation_p is None
    assert (second.category, second.turn, second.parent_id) == ("search_2", 2, first.session_id)
    assert second.continuation_p == 0.3 and third.continuation_p == 0.9
    bad = httpx.post(
        base,
        json={**body, "messages": turn1},
        headers={**headers, "x-kvroute-continuation": "often"},
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "x-kvroute-continuation"
    out_of_range = httpx.post(
        base, json={**body, "messages": turn1, "kvroute_continuation": 2}, headers=headers
    )
    assert out_of_range.status_code == 400
    assert "kvroute_continuation" in json.dumps(out_of_range.json())
    assert len(seen) == 3  # refused requests never reached an engine


def test_kv_control_api_is_off_without_an_admin_key(server: Server) -> None:
    r = httpx.post(
        f"http://127.0.0.1:{server.port}/v1/kv/lookup",
        json={"text": "hello"},
        headers={"authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_api_off"


def test_client_kv_transfer_params_pass_through_without_forged_hints(
    server: Server, monkeypatch
) -> None:
    """vLLM's kv_transfer_params reach the engine unchanged, with kvroute's hints merged in; a
    client cannot forge the hints (a pin order is the admin API's alone)."""
    seen: list[dict | None] = []
    for engine in server.stack.engines.values():
        original = engine.generate

        def spy(request, original=original):  # type: ignore[no-untyped-def]
            seen.append(request.kv_transfer_params)
            return original(request)

        monkeypatch.setattr(engine, "generate", spy)
    params = {"do_remote_decode": False, "kvroute": {"pin": True, "category": "forged"}}
    r = httpx.post(
        f"http://127.0.0.1:{server.port}/v1/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 2, "kv_transfer_params": params},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    (sent,) = seen
    assert sent is not None and sent["do_remote_decode"] is False
    assert sent["kvroute"] == {"category": "text_1", "turn": 1}
