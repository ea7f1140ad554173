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
from engines.profile import LatencyProfile
from engines.sim.engine import SimEngine
from engines.sim.options import SimEngineOptions
from engines.tiny_model import build_tiny_model
from router.settings import RouterSettings
from router.tokenizer import PromptTokenizer
from tests.support import (
    FORGED_TRANSFER_PARAMS,
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
        api_keys=frozenset({KEY}), settings=RouterSettings(max_in_flight=64, max_queue=64)
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
        # transfer parameters are the router's alone: a client's is a 400 naming the key
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "kv_transfer_params": {"do_remote_prefill": True},
            },
            400,
            "kv_transfer_params.do_remote_prefill",
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
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(f"http://127.0.0.1:{server.port}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(
        f"http://127.0.0.1:{server.port}/v1/models", headers={"authorization": f"Bearer {KEY}"}
    )
    entry = r.json()["data"][0]  # what a client fits its prompts to
    assert entry["max_model_len"] > 0 and entry["vocab_size"] > 256
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[10**9], max_tokens=2)
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_metrics_expose_router_state(server: Server, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=2)
    url = f"http://127.0.0.1:{server.port}/metrics"
    body = httpx.get(url, headers={"authorization": f"Bearer {KEY}"}).text
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
    engine = SimEngine(
        "only",
        profile,
        options=SimEngineOptions(block_size=32, vocab_size=tok.vocab_size, token_offset=10),
    )
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
    assert first.session_id is not None and first.continuation is None
    assert (second.category, second.turn, second.parent_id) == ("search_2", 2, first.session_id)
    assert second.continuation == 0.3 and third.continuation == 0.9
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


def test_client_transfer_params_are_refused_before_any_engine(server: Server, monkeypatch) -> None:
    """The issue's request (a decode engine sent to pull KV from a host the client chose, with
    a made-up cached-token count: on sim engines a 200 reporting 999999 cached tokens) and a
    forged pin order in kvroute's own hints are 400s naming the key, and reach no engine."""
    seen: list[dict | None] = []
    for engine in server.stack.engines.values():
        original = engine.generate

        def spy(request, original=original):  # type: ignore[no-untyped-def]
            seen.append(request.kv_transfer_params)
            return original(request)

        monkeypatch.setattr(engine, "generate", spy)
    forged = FORGED_TRANSFER_PARAMS
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = _error(server, "/v1/chat/completions", {**chat, "kv_transfer_params": forged})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "kv_transfer_params.do_remote_prefill"
    pin = {"kvroute": {"pin": True, "category": "forged"}}
    r = _error(
        server, "/v1/completions", {"model": MODEL, "prompt": "x", "kv_transfer_params": pin}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params.kvroute"
    assert seen == []
    ok = _error(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                            "kv_transfer_params": {}})  # fmt: skip
    assert ok.status_code == 200, ok.text
    (sent,) = seen  # the router's hints alone
    assert sent == {"kvroute": {"category": "text_1"}}  # turn 1, the default, is left out


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
     "multipart/form-data; boundary=x", "application/json; charset=latin-1", "application/jsonx"],
)  # fmt: skip
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_post_bodies_must_be_declared_json(server: Server, path: str, content_type) -> None:
    """What a web page can POST cross-origin without a CORS preflight (text/plain, forms, a
    typeless body) is a 415 naming the type, on the OpenAI endpoints and the KV control API."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "text": "x"}
    headers = {"authorization": f"Bearer {KEY}"}
    if content_type is not None:
        headers["content-type"] = content_type
    r = httpx.post(f"http://127.0.0.1:{server.port}{path}", content=json.dumps(body).encode(),
                   headers=headers)  # fmt: skip
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_media_type" and err["param"] == "content-type"
    assert (
        repr(content_type) in err["message"]
        if content_type
        else "no content-type" in err["message"]
    )


def test_json_with_a_utf8_charset_passes(server: Server) -> None:
    for ct in (
        "application/json",
        "Application/JSON; charset=utf-8",
        'application/json;charset="UTF-8"',
    ):
        r = httpx.post(
            f"http://127.0.0.1:{server.port}/v1/completions",
            content=json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode(),
            headers={"authorization": f"Bearer {KEY}", "content-type": ct},
            timeout=30,
        )
        assert r.status_code == 200, (ct, r.text)


def test_a_batch_of_prompts_gets_choices_per_prompt_and_summed_usage(
    client: openai.OpenAI, server: Server
) -> None:
    """vLLM's list of prompts: prompt k's choice i is choice k * n + i, usage is the sum; the
    same streamed, with one usage chunk at the end."""
    one = [client.completions.create(model=MODEL, prompt=p, max_tokens=3, n=2, seed=4)
           for p in ("first prompt", "the second one")]  # fmt: skip
    both = client.completions.create(
        model=MODEL, prompt=["first prompt", "the second one"], max_tokens=3, n=2, seed=4
    )
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [c.text for r in one for c in r.choices]
    assert both.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in one)
    assert both.usage.completion_tokens == 12
    ids = client.completions.create(model=MODEL, prompt=[[40, 41, 42], [50, 51]], max_tokens=2)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=["a", "b", "c"], max_tokens=3, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    done = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert done == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    bad = _error(server, "/v1/completions", {"model": MODEL, "prompt": ["ok", [10**9]]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def test_request_categories_are_short_names_of_a_bounded_set(monkeypatch) -> None:
    """A category is state in every engine's CPU-tier policy: a malformed one is a 400 naming
    the header, and a new one past ``max_categories`` is carried as ``other`` (the documented
    and known ones keep working: the hostile-client suite has the flood)."""
    stack = sim_stack(max_categories=6)  # the 5 reserved (documented + "other") and one more
    sent: list[str] = []
    for engine in stack.engines.values():
        original = engine.generate

        def spy(request, original=original):  # type: ignore[no-untyped-def]
            sent.append(request.kv_transfer_params["kvroute"]["category"])
            return original(request)

        monkeypatch.setattr(engine, "generate", spy)
    with Server(stack, free_port()) as s:
        url = f"http://127.0.0.1:{s.port}/v1/completions"
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}

        def post(category: str) -> httpx.Response:
            return httpx.post(url, json=body, headers={"x-kvroute-category": category}, timeout=30)

        assert post("search").status_code == 200
        bad = post("a" * 200)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-kvroute-category"
        for category in ("mine", "yours", "image", "mine"):  # "yours" is past the bound
            assert post(category).status_code == 200
    assert sent == ["search_1", "mine_1", "other_1", "image_1", "mine_1"]


def test_ready_waits_for_a_routable_engine_heard_on_the_bus() -> None:
    """/health is liveness (200 at once); /ready is 503 while no engine's load sample has come
    over the bus, 200 once one has, and 503 again when they stop (the engines gone silent)."""
    engines = sim_stack().engines
    quiet = sim_stack(forward=False)  # this router's engines publish nothing yet
    quiet_buses = (quiet.kv_bus, quiet.load_bus)
    with Server(quiet, free_port()) as s:
        base = f"http://127.0.0.1:{s.port}"
        assert httpx.get(f"{base}/health").status_code == 200
        r = httpx.get(f"{base}/ready")
        assert r.status_code == 503 and r.json()["bus"] == "silent", r.text
        publisher = LocalStack(
            engines,
            model=MODEL,
            block_size=quiet.block_size,
            max_model_len=2048,
            latency=LatencyProfile.load("cpu-tiny-llama"),
            tokenizer=PromptTokenizer(build_tiny_model()),
            buses=quiet_buses,
        )
        with Server(publisher, free_port()):  # its forwarders publish on the same buses
            assert wait_for(lambda: httpx.get(f"{base}/ready").status_code == 200, timeout_s=20)
            body = httpx.get(f"{base}/ready").json()
            assert body["routable_instances"] == 2 and body["bus"] == "connected"
        assert wait_for(lambda: httpx.get(f"{base}/ready").status_code == 503, timeout_s=20)


def test_a_coarser_event_stride_still_routes_repeated_prompts_to_their_cache() -> None:
    """``event_stride`` 4: the forwarders put every fourth block on the bus, the map holds a
    quarter of the entries, and the router still sends each repeated prompt where it is
    cached (three prompts over two engines: each repeat a hit), matching in whole runs of four
    blocks."""
    stack = sim_stack(block_size=16, settings=RouterSettings(event_stride=4))
    with Server(stack, free_port()) as s:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="x")
        cmap = stack.state.cache_map
        for i in range(3):
            prompt = f"{i} {LONG}"
            first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
            blocks = first.usage.prompt_tokens // 16
            want = (i + 1) * (blocks // 4)
            assert wait_for(lambda want=want: cmap.stats().residency >= want)
            again = client.completions.create(model=MODEL, prompt=f"{prompt} Again?", max_tokens=4)
            assert again.usage.prompt_tokens_details.cached_tokens >= (blocks // 4 * 4 - 4) * 16
        # a quarter of the prompts' full blocks (and of the outputs') are entries
        assert cmap.stats().residency <= 6 * (blocks + 1) // 4 + 6
