"""The hostile-client suite (issue 61), over real HTTP against one router replica in one process
(two sim engines; the Serve proxy's findings: test_serve_proxy.py). Each test is one finding of
the issue's list and fails on the code before the fix:

1. preparing a prompt never blocks the event loop, and what the body's size alone proves too
   long is refused before the tokenizer runs;
2. no client can fill the category table and lock out the documented categories;
3. the rate limit is keyed on the authenticated key, not the header's spelling;
4. tenants sharing a server do not read each other's cache (cached_tokens, placement);
7. admission counts engine requests (prompts x ``n``), not HTTP requests;
9. /metrics and /openapi.json need a key when keys are set; a key given twice in one JSON
   object is a 400.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from router.settings import RouterSettings
from tests.support import Server, free_port, metric, settle, sim_stack

MODEL = "tiny-sim"
VICTIM, ATTACKER = "sk-victim", "sk-attacker"


def _post(
    base: str, body: dict[str, Any], key: str | None = None, path: str = "/v1/completions", **h: str
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        f"{base}{path}", json={"model": MODEL, **body}, headers={**headers, **h}, timeout=60
    )


@pytest.fixture(scope="module")
def tenants() -> Iterator[str]:
    """Two client keys without ``cache_salt`` (the issue's set-up), 4k context."""
    stack = sim_stack(max_model_len=4096, api_keys=frozenset({VICTIM, ATTACKER}))
    with Server(stack, free_port()) as s:
        yield f"http://127.0.0.1:{s.port}"


def test_1_a_huge_prompt_is_tokenized_off_the_event_loop_or_refused_before(monkeypatch) -> None:
    """A prompt near the body limit that asks to be truncated is tokenized in a worker thread,
    never on the event loop; one that cannot fit the context by its characters alone is refused
    (400 ``context_length_exceeded``) with no tokenizer run at all; a normal one is answered."""
    stack = sim_stack(max_model_len=4096)
    calls: list[tuple[int, str]] = []
    tokenizer = stack.tokenizer
    original = tokenizer.encode

    def spy(text: str, add_special_tokens: bool = False) -> list[int]:
        calls.append((len(text), threading.current_thread().name))
        return original(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", spy)
    words = ("lorem ipsum dolor sit amet " * 150_000)[:3_900_000]
    with Server(stack, free_port()) as s:
        base = f"http://127.0.0.1:{s.port}"
        refused = _post(base, {"prompt": words, "max_tokens": 1})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        assert calls == []  # refused by its size alone
        kept = _post(base, {"prompt": words, "max_tokens": 1, "truncate_prompt_tokens": 1000})
        assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 1000
        assert _post(base, {"prompt": "hello", "max_tokens": 1}).status_code == 200
    (big, where), (small, inline) = calls
    assert big == len(words) and where.startswith("kvroute-prepare-large"), where
    assert small == 5 and not inline.startswith("kvroute-prepare")  # a small one stays inline


def test_1_a_chat_of_100k_messages_is_refused_before_it_is_parsed(monkeypatch) -> None:
    """A chat whose messages alone need more tokens than the context (each adds the template's
    tokens) is a 400 before validation, templating and tokenization."""
    stack = sim_stack(max_model_len=4096)
    tokenizer = stack.tokenizer
    rendered: list[int] = []
    monkeypatch.setattr(tokenizer, "chat", lambda m: rendered.append(len(m)) or [1])
    with Server(stack, free_port()) as s:
        base = f"http://127.0.0.1:{s.port}"
        messages = [{"role": "user", "content": "hi"}] * 100_000
        r = _post(base, {"messages": messages}, path="/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "100000 messages" in r.json()["error"]["message"] and rendered == []


def test_2_junk_categories_never_lock_out_the_documented_ones(tenants: str) -> None:
    """100 made-up categories (past the table's 64) are all served; the documented ones still
    are, and no answer names another client's category."""
    for i in range(100):
        r = _post(
            tenants,
            {"prompt": "hi", "max_tokens": 1},
            ATTACKER,
            **{"x-kvroute-category": f"junk{i}"},
        )
        assert r.status_code == 200, r.text
    for category in ("search", "image", "file", "text", "brand-new"):
        r = _post(
            tenants, {"prompt": "hi", "max_tokens": 1}, VICTIM, **{"x-kvroute-category": category}
        )
        assert r.status_code == 200 and "junk" not in r.text, r.text
    assert (
        metric(tenants, "kvroute_category_overflow", {"authorization": f"Bearer {VICTIM}"})[""]
        >= 36
    )


def test_2_chats_of_ever_more_turns_share_one_label_past_the_bound(monkeypatch) -> None:
    """The engines' policies learn per category and turn (``text_2``): chats of 70, 100 and 300
    user messages all carry ``text_64``, while the hints' ``turn`` stays exact."""
    from policies.hints import RequestInfo

    stack = sim_stack(max_model_len=8192)
    sent: list[tuple[str, int]] = []
    for engine in stack.engines.values():
        original = engine.generate

        def spy(request, original=original):  # type: ignore[no-untyped-def]
            info = RequestInfo.from_hints(request.kv_transfer_params)
            sent.append((info.category, info.turn))
            return original(request)

        monkeypatch.setattr(engine, "generate", spy)
    with Server(stack, free_port()) as s:
        base = f"http://127.0.0.1:{s.port}"
        for turns in (3, 70, 100, 300):
            messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
            body = {"messages": messages * (turns - 1) + messages[:1], "max_tokens": 1}
            r = _post(base, body, path="/v1/chat/completions")
            assert r.status_code == 200, r.text
    assert sent == [("text_3", 3), ("text_64", 70), ("text_64", 100), ("text_64", 300)]


def test_3_the_rate_limit_is_keyed_on_the_key_not_the_header_spelling() -> None:
    """``rate 1/s, burst 2``: 64 spellings of ``Bearer`` for one key get the key's budget (its
    burst of 2, and one more per second the requests took), not 64."""
    stack = sim_stack(api_keys=frozenset({VICTIM}), rate_limit=1.0, rate_burst=2)
    with Server(stack, free_port()) as s:
        base = f"http://127.0.0.1:{s.port}"
        codes = []
        start = time.monotonic()
        for i in range(64):
            scheme = "".join(c.upper() if i >> k & 1 else c for k, c in enumerate("bearer"))
            r = httpx.post(
                f"{base}/v1/completions",
                json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                headers={"authorization": f"{scheme} {VICTIM}"},
                timeout=30,
            )
            codes.append(r.status_code)
        budget = 2 + math.ceil(time.monotonic() - start)
    assert set(codes) == {200, 429} and codes.count(200) <= budget, (budget, codes)


def test_4_a_tenant_reads_no_cached_tokens_of_anothers_prefix(tenants: str) -> None:
    """The issue's guessing demo: the victim caches ``public + secret + more``; the attacker,
    with the public part cached in its own namespace, guesses the secret: every guess, the right
    one included, reads the same ``cached_tokens``, while the victim's repeat reads it all."""
    public = "The quarterly report for the board, confidential. " * 30

    def prompt(digits: str) -> str:
        return f"{public} account {digits} and the remaining text of the memo " * 3

    def cached(key: str, text: str) -> int:
        r = _post(tenants, {"prompt": text, "max_tokens": 1}, key)
        assert r.status_code == 200, r.text
        settle()  # its KV events reach the map
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    cached(VICTIM, prompt("4821"))
    own = cached(VICTIM, prompt("4821"))
    cached(ATTACKER, prompt("xxxx"))  # the public part, in the attacker's namespace
    guesses = {g: cached(ATTACKER, prompt(g)) for g in ("1234", "4821", "0000", "9999")}
    assert len(set(guesses.values())) == 1, guesses
    assert guesses["4821"] < own - 64, (guesses, own)


def test_4_keys_an_operator_puts_in_one_namespace_share_it() -> None:
    """``key_namespaces``: two keys named into one namespace read each other's prefix."""
    from router.keys import ApiKeys

    keys = ApiKeys([f"team-a {VICTIM}", f"team-b {ATTACKER}"], {"shared": ["team-a", "team-b"]})
    stack = sim_stack(api_keys=keys)
    with Server(stack, free_port()) as s:
        base = f"http://127.0.0.1:{s.port}"
        text = "A long shared system prompt for the whole team. " * 40
        assert _post(base, {"prompt": text, "max_tokens": 1}, VICTIM).status_code == 200
        settle()
        r = _post(base, {"prompt": text, "max_tokens": 1}, ATTACKER).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_7_admission_counts_engine_requests_not_http_requests() -> None:
    """4 prompts x ``n`` 4 hold 16 admission slots while they run (``kvroute_admission_running``),
    and a 16-slot server queues the next request behind them."""
    stack = sim_stack(time_scale=1.0, settings=RouterSettings(max_in_flight=16, max_queue=8))
    with Server(stack, free_port()) as s:
        base = f"http://127.0.0.1:{s.port}"

        async def run() -> tuple[float, float]:
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": MODEL, "prompt": ["a", "b", "c", "d"], "n": 4, "max_tokens": 200}
                batch = asyncio.create_task(client.post(f"{base}/v1/completions", json=body))
                running = 0.0
                for _ in range(200):
                    await asyncio.sleep(0.02)
                    running = (await asyncio.to_thread(metric, base, "kvroute_admission_running"))[
                        ""
                    ]
                    if running:
                        break
                queued = (await asyncio.to_thread(metric, base, "kvroute_admission_queued"))[""]
                one = {"model": MODEL, "prompt": "e", "max_tokens": 1}
                other = asyncio.create_task(client.post(f"{base}/v1/completions", json=one))
                await asyncio.sleep(0.2)
                waiting = (await asyncio.to_thread(metric, base, "kvroute_admission_queued"))[""]
                assert (await batch).status_code == 200 and (await other).status_code == 200
                return running, waiting - queued

        running, waiting = asyncio.run(run())
    assert running == 16 and waiting == 1


def test_9_metrics_and_openapi_need_a_key_when_keys_are_set(tenants: str) -> None:
    for path in ("/metrics", "/openapi.json"):
        assert httpx.get(f"{tenants}{path}").status_code == 401
        ok = httpx.get(f"{tenants}{path}", headers={"authorization": f"Bearer {VICTIM}"})
        assert ok.status_code == 200
    opened = sim_stack(api_keys=frozenset({VICTIM}), open_service_routes=True)
    with Server(opened, free_port()) as s:
        assert httpx.get(f"http://127.0.0.1:{s.port}/metrics").status_code == 200


def test_9_a_key_given_twice_and_a_non_ascii_bearer_are_clean_4xx(tenants: str) -> None:
    """``{"max_tokens": 1, "max_tokens": 5000}``: a 400 naming the key (parsers that keep the
    first and the last read two different requests); a bearer token with bytes >= 0x80: 401."""
    raw = b'{"model": "tiny-sim", "prompt": "hi", "max_tokens": 1, "max_tokens": 5000}'
    r = httpx.post(
        f"{tenants}/v1/completions",
        content=raw,
        headers={"content-type": "application/json", "authorization": f"Bearer {VICTIM}"},
    )
    assert r.status_code == 400 and "'max_tokens' appears twice" in r.json()["error"]["message"]
    odd = httpx.get(f"{tenants}/v1/models", headers=[(b"authorization", b"Bearer caf\xe9")])
    assert odd.status_code == 401, odd.text
