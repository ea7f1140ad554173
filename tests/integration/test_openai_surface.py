"""The OpenAI parameter surface over real HTTP (uvicorn) with two real sim engines: stop strings
cut the text at the ingress (finish_reason "stop", the engine request aborted), stop tokens and
seeds are honoured, ``n`` fans out, unknown fields and what a sim engine cannot produce are 400s
naming the field, the official client's parameters pass, the request bodies are documented in
the OpenAPI schema, and schemathesis finds no server error and no schema violation, on the OpenAI
endpoints and on the KV control API (with the admin key, over engines with a CPU tier)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engines.sim.request import Status
from router.settings import RouterSettings
from tests.support import Server, free_port, sim_stack

MODEL = "tiny-sim"
ADMIN = "sk-admin"  # the KV control API's admin key (IngressConfig.admin_keys)
MSGS = [{"role": "user", "content": "tell me a story"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    stack = sim_stack(
        time_scale=0.02,
        settings=RouterSettings(max_in_flight=64, max_queue=256),
        # a CPU tier that honours pins, so that /v1/kv/pin and /unpin can answer 200
        engine={"cpu_capacity_blocks": 64, "cpu_policy": "wa"},
        pins=True,
        admin_keys=frozenset({ADMIN}),
    )
    with Server(stack, free_port()) as s:
        yield s


@pytest.fixture()
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{server.port}{path}", json=body, timeout=60)


def _chat(server: Server, **fields: Any) -> httpx.Response:
    return _post(server, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, **fields})


def _sse(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", f"http://127.0.0.1:{server.port}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _stop_string(text: str) -> str:
    """A stop string that occurs in ``text`` past its start, and first where it is taken from."""
    for start in range(4, len(text) - 3):
        stop = text[start : start + 3]
        if stop.strip() and text.find(stop) == start:
            return stop
    raise AssertionError(f"no usable stop string in {text!r}")


def _spy_aborts(server: Server, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of the requests the sim engines abort while they run (not after their end),
    the engines slowed down (about 6 ms a token) so that a request ends long after a stop
    string in its first tokens."""
    aborted: list[str] = []
    for engine in server.stack.engines.values():
        monkeypatch.setattr(engine, "time_scale", 5.0)
        abort = engine._abort  # type: ignore[attr-defined]

        def spy(req: Any, abort: Any = abort) -> None:
            if req.status != Status.FINISHED:
                aborted.append(req.request_id)
            abort(req)

        monkeypatch.setattr(engine, "_abort", spy)
    return aborted


def _aborted(aborted: list[str], request_id: str) -> bool:
    deadline = time.monotonic() + 2  # closing the engine's stream may take a loop turn or two
    while request_id not in aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    return request_id in aborted


def test_stop_strings_cut_the_text_and_abort_the_engine_request(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = _chat(server, max_tokens=40, seed=11).json()["choices"][0]["message"]["content"]
    stop = _stop_string(full)
    aborted = _spy_aborts(server, monkeypatch)
    cut = _chat(server, max_tokens=40, seed=11, stop=[stop, "never-seen-string"])
    assert cut.status_code == 200, cut.text
    body = cut.json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == full[: full.find(stop)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert body["usage"]["completion_tokens"] < 40
    # the engine request was aborted, not left to run to 40 (its id is the response's, n=1)
    assert _aborted(aborted, body["id"]), aborted
    kept = _chat(server, max_tokens=40, seed=11, stop=stop, include_stop_str_in_output=True)
    assert kept.json()["choices"][0]["message"]["content"] == full[: full.find(stop) + len(stop)]
    # streamed: the same text (a possible stop prefix is held back until it cannot match)
    chunks = _sse(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": MSGS,
            "max_tokens": 40,
            "seed": 11,
            "stop": stop,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert _aborted(aborted, chunks[0]["id"]), aborted  # streamed too
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == full[: full.find(stop)]
    finals = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [(f["finish_reason"], f["stop_reason"]) for f in finals] == [("stop", stop)]
    assert chunks[-1]["usage"]["completion_tokens"] == body["usage"]["completion_tokens"]


def test_stop_strings_on_text_completions(server: Server, client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="once", max_tokens=30, seed=5)
    stop = _stop_string(full.choices[0].text)
    cut = client.completions.create(model=MODEL, prompt="once", max_tokens=30, seed=5, stop=stop)
    assert cut.choices[0].text == full.choices[0].text[: full.choices[0].text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_stop_token_ids_end_with_stop_and_leave_the_token_out(server: Server) -> None:
    r = _post(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": "abc", "max_tokens": 12, "seed": 2, "return_token_ids": True},
    ).json()
    ids = r["choices"][0]["token_ids"]
    assert r["prompt_token_ids"] and len(ids) == 12
    stop_id = ids[5]
    first = ids.index(stop_id)
    s = _post(
        server,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "abc",
            "max_tokens": 12,
            "seed": 2,
            "stop_token_ids": [stop_id],
            "return_token_ids": True,
        },
    ).json()["choices"][0]
    assert (s["finish_reason"], s["stop_reason"], s["token_ids"]) == (
        "stop",
        stop_id,
        ids[: first + 1],
    )
    assert r["choices"][0]["text"].startswith(s["text"])


def test_seeds_reproduce_and_n_fans_out(server: Server, client: openai.OpenAI) -> None:
    a = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, seed=9, n=3)
    b = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, seed=9, n=3)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]  # seed + i per choice
    assert len(set(texts)) == 3
    assert a.usage.completion_tokens == 24 and a.usage.prompt_tokens == b.usage.prompt_tokens
    one = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, seed=10)
    assert one.choices[0].message.content == texts[1]  # choice i runs with seed + i, as in vLLM
    unseeded = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, n=2)
    assert unseeded.choices[0].message.content != unseeded.choices[1].message.content
    stream = client.completions.create(
        model=MODEL,
        prompt="go",
        max_tokens=5,
        n=2,
        stream=True,
        seed=1,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    done = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert done == [0, 1] and chunks[-1].usage.completion_tokens == 10
    r = _chat(server, n=17)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logit_bias": {"12": 5}}, "logit_bias"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages.0.extra"),
    ],
)
def test_what_is_not_honoured_is_a_400_naming_it(server: Server, fields: dict, param: str) -> None:
    r = _chat(server, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[-1] in err["message"]


def test_the_official_clients_parameters_pass(server: Server, client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief", "name": "rules"}, *MSGS],
        max_completion_tokens=6,
        temperature=0.5,
        top_p=0.9,
        presence_penalty=0.2,
        frequency_penalty=0.1,
        seed=3,
        stop=["@@@@"],
        n=2,
        user="u-1",
        response_format={"type": "text"},
        tool_choice="none",
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "request_id": "my-id",
            "session_id": "s-1",
        },
    )
    assert chat.id == "chatcmpl-my-id" and len(chat.choices) == 2
    assert all(c.finish_reason == "length" for c in chat.choices)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=2, extra_body={"not_a_field": True}
        )
    assert e.value.body["param"] == "not_a_field"  # type: ignore[index]
    text = client.completions.create(
        model=MODEL,
        prompt="hi",
        max_tokens=4,
        temperature=0.3,
        top_p=0.8,
        seed=1,
        stop="\n\n",
        presence_penalty=0.1,
        frequency_penalty=0.1,
        user="u",
        n=1,
    )
    assert text.choices[0].finish_reason == "length"


def test_request_bodies_are_in_the_openapi_document(server: Server) -> None:
    doc = httpx.get(f"http://127.0.0.1:{server.port}/openapi.json").json()
    for path, field in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
        op = doc["paths"][path]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert field in schema["required"] and "stop" in schema["properties"]
        assert {"200", "400", "404", "429", "503"} <= set(op["responses"])


# the operations each schemathesis run covers
SURFACES = {
    "openai": r"^/(v1/(chat/)?completions|v1/models|health|ready|metrics)$",
    "kv": r"^/v1/kv/(lookup|pin|unpin|warm|clear)$",
}
COMPLETIONS = ("POST /v1/chat/completions", "POST /v1/completions")


@pytest.mark.parametrize("surface", list(SURFACES))
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_server_error_and_no_schema_violation(
    server: Server, mode: str, surface: str
) -> None:
    """Every schemathesis check (status codes, content types, headers and bodies against the
    document, negative data rejected, auth enforced ...) on the OpenAI endpoints and the GET
    ones, and on the KV control API, with generated schema-valid (positive) and schema-invalid
    (negative) bodies, bounded to 60 cases a run. Every request carries the admin key, so the
    KV operations run (``ignored_auth`` probes each one without it and with a wrong key: 401).

    ``positive_data_acceptance`` is left out on the completion endpoints only: a schema-valid
    body can still be refused there, and must be (an unknown model is a 404, a prompt over the
    context a 400, a field the sim engine cannot honour a 400). Positive bodies name the served
    model, so that they reach an engine, the KV bodies' token ids are taken into the
    vocabulary (the served model's, which the document cannot state), and a completion body
    that sets no length gets ``max_tokens`` 16: the default, the rest of the context, costs
    seconds of generation per case and has a test of its own
    (``test_without_a_length_a_completion_fills_the_context``)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import CHECKS, load_all_checks
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    load_all_checks()
    base = f"http://127.0.0.1:{server.port}"
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json").include(
        path_regex=SURFACES[surface]
    )
    vocab = httpx.get(f"{base}/v1/models").json()["data"][0]["vocab_size"]
    generation = getattr(schemathesis.GenerationMode, mode.upper())
    failures: list[str] = []
    statuses: dict[tuple[str, int], int] = {}

    @settings(
        max_examples=60,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=schema.as_strategy(generation))
    def run(case: Any) -> None:
        label = case.operation.label
        body = case.body if isinstance(case.body, dict) else {}
        if mode == "positive" and "model" in body:
            body["model"] = MODEL
        if (
            mode == "positive"
            and label in COMPLETIONS
            and body.get("max_tokens") is None
            and body.get("max_completion_tokens") is None
        ):
            body["max_tokens"] = 16
        if mode == "positive" and isinstance(body.get("token_ids"), list):
            body["token_ids"] = [t % vocab for t in body["token_ids"]]
        checks = [
            c
            for c in CHECKS.get_all()
            if c is not positive_data_acceptance or label not in COMPLETIONS
        ]
        try:
            response = case.call_and_validate(
                base_url=base,
                checks=checks,
                headers={"Authorization": f"Bearer {ADMIN}"},  # as the probes spell it
                timeout=60,
            )
        except (AssertionError, BaseExceptionGroup) as e:  # collect them all, fail at the end
            failures.append(f"{label}: {e}")
            return
        key = (label, response.status_code)
        statuses[key] = statuses.get(key, 0) + 1

    run()
    assert not failures, "\n\n".join(failures[:5])
    assert not any(code >= 500 for _, code in statuses), statuses
    assert sum(statuses.values()) >= 50, statuses
    ok = {label for label, code in statuses if code == 200}
    if mode == "positive" and surface == "openai":
        assert sum(n for (_, code), n in statuses.items() if code == 200) >= 10, statuses
    if mode == "positive" and surface == "kv":  # each operation ran, not only refusals
        assert {f"POST /v1/kv/{op}" for op in ("lookup", "pin", "unpin", "warm", "clear")} <= ok
        assert not any(code in (401, 403) for _, code in statuses), statuses


@pytest.mark.parametrize("surface", list(SURFACES))
def test_schemathesis_coverage_phase_finds_nothing(
    server: Server, surface: str, tmp_path: Path
) -> None:
    """Schemathesis's coverage phase (its CLI, every check): each field's boundary values and
    each way a request can break the document (a missing or wrong-typed field, an undeclared
    method: 405 with Allow, no body or content type ...), on every operation of ``surface``.
    ``positive_data_acceptance`` is left out on the completion endpoints, as above (here their
    positive bodies do not even name the served model: most are 404s, which schemathesis warns
    of; a warning is not a failure)."""
    pytest.importorskip("schemathesis")
    checks = ["--checks", "all"]
    if surface == "openai":
        checks += ["--exclude-checks", "positive_data_acceptance"]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "run",
            f"http://127.0.0.1:{server.port}/openapi.json",
            "--phases",
            "coverage",
            *checks,
            "--include-path-regex",
            SURFACES[surface],
            "--header",
            f"Authorization: Bearer {ADMIN}",
            "--seed",
            "1",
            "--no-color",
        ],
        cwd=tmp_path,  # where it keeps its state (.hypothesis, .schemathesis)
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    # every case passed (its warnings, the completions' 404s for a generated model, are not
    # failures)
    counts = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
    assert counts and counts[1] == counts[2] and int(counts[1]) >= 100, run.stdout[-6000:]


def test_without_a_length_a_completion_fills_the_context(server: Server) -> None:
    """No ``max_tokens`` (nor ``max_completion_tokens``): the reply may run to the end of the
    context, as vLLM's does; the sim engine, which never samples an end of text, does."""
    r = _chat(server)
    assert r.status_code == 200, r.text
    body = r.json()
    usage = body["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 2048  # sim_stack's context
    assert body["choices"][0]["finish_reason"] == "length"


def test_truncate_prompt_tokens_and_continuous_usage(server: Server) -> None:
    ids = list(range(40, 140))
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "return_token_ids": True}
    left = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 10}).json()
    assert left["prompt_token_ids"] == ids[-10:] and left["usage"]["prompt_tokens"] == 10
    right = _post(
        server,
        "/v1/completions",
        {**body, "truncate_prompt_tokens": 10, "truncation_side": "right"},
    ).json()
    assert right["prompt_token_ids"] == ids[:10]
    too_long = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 5000})
    assert too_long.json()["error"]["param"] == "truncate_prompt_tokens"
    chunks = _sse(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": "go", "max_tokens": 4, "stream": True,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )  # fmt: skip
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 4 and chunks[-1]["choices"] == []
