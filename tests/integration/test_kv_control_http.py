"""The KV control API over real HTTP: two real sim engines with a CPU tier (WA), their KV events
through real forwarders into the router's cache map, the ingress under uvicorn. Lookup agrees
with the engines' ``cached_tokens``; warm makes the next request a hit; clear makes it a miss;
a pinned 2,000-token system prompt survives a flood in the CPU tier while its unpinned twin
does not."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cachemap import BlockHasher
from deploy.local import LocalStack
from engines.profile import LatencyProfile
from engines.sim.engine import SimEngine
from engines.sim.options import SimEngineOptions
from engines.tiny_model import build_tiny_model
from router.api_errors import APIError
from router.keys import fingerprint
from router.kv_control import KvControl, PinBody
from router.settings import RouterSettings
from router.tokenizer import PromptTokenizer
from tests.support import Server, free_port, settle

MODEL = "tiny-sim"
KEY, ADMIN = "sk-user", "sk-admin"
BS = 32
GPU_BLOCKS, CPU_BLOCKS = 96, 160  # a 2,000-token prompt is 63 blocks


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer(build_tiny_model())


@pytest.fixture(scope="module")
def server(tok: PromptTokenizer) -> Iterator[Server]:
    profile = LatencyProfile.load("cpu-tiny-llama")
    engines = {
        f"sim-{i}": SimEngine(
            f"sim-{i}",
            profile,
            time_scale=0.02,
            options=SimEngineOptions(
                block_size=BS,
                num_gpu_blocks=GPU_BLOCKS,
                cpu_capacity_blocks=CPU_BLOCKS,
                cpu_policy="wa",
                vocab_size=tok.vocab_size,
                token_offset=10,
                max_model_len=4096,
            ),
        )
        for i in range(2)
    }
    stack = LocalStack(
        engines,
        model=MODEL,
        block_size=BS,
        max_model_len=4096,
        latency=profile,
        tokenizer=tok,
        api_keys=frozenset({KEY}),
        admin_keys=frozenset({ADMIN}),
        metrics_admin=True,
        pins=True,
        settings=RouterSettings(max_in_flight=64, max_queue=64),
    )
    with Server(stack, free_port()) as s:
        yield s


class Api:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def kv(self, op: str, body: dict[str, Any], key: str | None = ADMIN) -> httpx.Response:
        """``op`` with ``body``; a prompt's KV is that of the client key's namespace (its
        fingerprint: ``router.keys``), as the client's requests see it."""
        headers = {"authorization": f"Bearer {key}"} if key else {}
        if op != "clear":
            body = {"namespace": fingerprint(KEY), **body}
        return httpx.post(f"{self.base}/v1/kv/{op}", json=body, headers=headers, timeout=60)

    def ok(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.kv(op, body)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    def complete(self, prompt: str, **extra: Any) -> dict[str, Any]:
        r = httpx.post(
            f"{self.base}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra},
            headers={"authorization": f"Bearer {KEY}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    def cached(self, prompt: str) -> dict[str, int]:
        rows = self.ok("lookup", {"text": prompt})["instances"]
        return {row["instance"]: row["cached_tokens"] for row in rows}

    def settle(self) -> None:
        settle()  # KV events reach the router's map


@pytest.fixture()
def api(server: Server) -> Api:
    return Api(server.port)


def text_of(tok: PromptTokenizer, seed: str, tokens: int) -> str:
    """A prompt of about ``tokens`` tokens, distinct per ``seed`` from its first block on."""
    words = []
    i = 0
    while len(tok.encode(" ".join(words))) < tokens:
        words.append(f"{seed}{i}")
        i += 1
    return " ".join(words)


def flood(api: Api, tok: PromptTokenizer, tag: str) -> None:
    """Every instance runs 12 distinct 1,200-token prompts: 450 blocks each, against 96 GPU and
    160 CPU-tier blocks."""
    both = ["sim-0", "sim-1"]
    for i in range(12):
        api.ok("warm", {"text": text_of(tok, f"flood{tag}{i}-", 1200), "instances": both})


def cached_of(out: dict[str, Any]) -> int:
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_admin_key_and_bad_bodies(api: Api) -> None:
    assert api.kv("lookup", {"text": "hi"}, key=None).status_code == 401
    assert api.kv("lookup", {"text": "hi"}, key=KEY).status_code == 401  # a user key is not admin
    both = api.kv("lookup", {"text": "hi", "token_ids": [1, 2]})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
    extra = api.kv("lookup", {"text": "hi", "bogus": 1})
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "bogus"
    unknown = api.kv("clear", {"instances": ["nope"]})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "instances"
    vocab = api.kv("lookup", {"token_ids": [10**9]})
    assert vocab.status_code == 400 and vocab.json()["error"]["param"] == "token_ids"
    # a salt the OpenAI endpoints refuse (vLLM's rule) names no cache a request could fill
    salt = api.kv("lookup", {"text": "hi", "cache_salt": "a/b"})
    assert salt.status_code == 400 and salt.json()["error"]["param"] == "cache_salt"
    # a category is state in every engine's CPU-tier policy: short names only, as for clients
    odd = api.kv("warm", {"text": "hi", "category": "x" * 200})
    assert odd.status_code == 400 and odd.json()["error"]["param"] == "category"
    spec = httpx.get(f"{api.base}/openapi.json", headers={"authorization": f"Bearer {KEY}"})
    spec = spec.json()["paths"]
    assert "requestBody" in spec["/v1/kv/pin"]["post"]
    assert "messages" in str(spec["/v1/kv/lookup"]["post"]["requestBody"])


@pytest.mark.parametrize("content_type", ["text/plain", None, "application/json; charset=latin-1"])
def test_a_body_not_sent_as_json_is_a_415_even_with_the_admin_key(
    api: Api, content_type: str | None
) -> None:
    """A KV control POST is JSON declared as such: a page in the operator's browser can send a
    text/plain (or typeless) body cross-origin without a CORS preflight; application/json
    needs one. The body is valid JSON, the key valid: only the content type is wrong."""
    headers = {"authorization": f"Bearer {ADMIN}"}
    if content_type is not None:
        headers["content-type"] = content_type
    for op, body in (("lookup", b'{"text": "hi"}'), ("clear", b"{}")):
        r = httpx.post(f"{api.base}/v1/kv/{op}", content=body, headers=headers, timeout=60)
        assert r.status_code == 415, r.text
        err = r.json()["error"]
        assert err["param"] == "content-type" and err["code"] == "unsupported_media_type"
    # the same body, declared JSON, is served
    headers["content-type"] = "application/json"
    r = httpx.post(
        f"{api.base}/v1/kv/lookup", content=b'{"text": "hi"}', headers=headers, timeout=60
    )
    assert r.status_code == 200, r.text


def test_metrics_behind_the_admin_key(api: Api) -> None:
    """``metrics_admin``: /metrics is an admin endpoint (a client key is not enough)."""
    url = f"{api.base}/metrics"
    assert httpx.get(url).status_code == 401
    user = httpx.get(url, headers={"authorization": f"Bearer {KEY}"})
    assert user.status_code == 401 and user.json()["error"]["code"] == "invalid_admin_key"
    admin = httpx.get(url, headers={"authorization": f"Bearer {ADMIN}"})
    assert admin.status_code == 200 and "kvroute_requests_total" in admin.text


def test_lookup_agrees_with_cached_tokens_and_warm_and_clear(
    api: Api, tok: PromptTokenizer
) -> None:
    api.ok("clear", {})
    prompt = text_of(tok, "w", 400)
    assert set(api.cached(prompt).values()) == {0}

    warmed = api.ok("warm", {"text": prompt, "instances": ["sim-1"]})
    assert [(r["instance"], r["ok"], r["cached_tokens"]) for r in warmed["instances"]] == [
        ("sim-1", True, 0)
    ]
    api.settle()
    seen = api.cached(prompt)
    assert seen["sim-0"] == 0 and seen["sim-1"] == (warmed["prompt_tokens"] - 1) // BS * BS
    out = api.complete(prompt)  # placed on the warmed instance, and a hit there
    assert cached_of(out) == seen["sim-1"] > 0

    # warm without instances picks the least-loaded one that lacks the prefix: sim-0
    auto = api.ok("warm", {"text": prompt, "count": 1})
    assert [r["instance"] for r in auto["instances"]] == ["sim-0"]
    api.settle()
    assert api.cached(prompt)["sim-0"] == seen["sim-1"]

    cleared = api.ok("clear", {"instances": ["sim-1"]})
    assert [(r["instance"], r["cleared"]) for r in cleared["instances"]] == [("sim-1", True)]
    api.settle()
    after = api.cached(prompt)
    assert after["sim-1"] == 0 and after["sim-0"] > 0
    api.ok("clear", {})
    api.settle()
    assert set(api.cached(prompt).values()) == {0}
    assert cached_of(api.complete(prompt)) == 0  # a miss: every instance was cleared


def test_a_pinned_system_prompt_survives_a_flood_in_the_cpu_tier(
    api: Api, tok: PromptTokenizer
) -> None:
    api.ok("clear", {})
    system, control = text_of(tok, "sys", 2000), text_of(tok, "ctl", 2000)
    pinned = api.ok("pin", {"text": system, "category": "system"})
    assert pinned["prompt_tokens"] >= 2000
    assert [r["ok"] for r in pinned["instances"]] == [True, True]
    api.ok("warm", {"text": control, "instances": ["sim-0", "sim-1"]})
    api.settle()
    flood(api, tok, "a")
    api.settle()
    held = api.ok("lookup", {"text": system})["instances"]
    lost = api.ok("lookup", {"text": control})["instances"]
    full = (pinned["prompt_tokens"] - 1) // BS * BS
    assert all(r["cached_tokens"] == full for r in held), held  # on GPU or the CPU tier
    assert all(r["cached_tokens"] < full for r in lost), lost
    assert cached_of(api.complete(system)) == full  # the next request is a hit
    assert cached_of(api.complete(control)) < full

    api.ok("unpin", {"text": system})
    flood(api, tok, "b")
    api.settle()
    gone = api.ok("lookup", {"text": system})["instances"]
    assert all(r["cached_tokens"] < full for r in gone), gone


def test_pins_are_refused_without_a_cpu_tier(server: Server) -> None:
    stack = server.stack
    control = KvControl(
        stack.state,
        stack.client,
        PromptTokenizer(build_tiny_model()),
        BlockHasher(MODEL, BS),
        4096,
        pins=False,
    )
    with pytest.raises(APIError) as e:
        asyncio.run(control.pin(PinBody(text="hello"), True))
    assert e.value.status == 409 and "cannot pin" in e.value.message
