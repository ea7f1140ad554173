"""What ``kvroute loadgen`` learns from the endpoint before a run, and how it fits the workload
to it, so the defaults work against any server's defaults.

- ``discover``: ``GET /v1/models``: the model id, its context (``max_model_len``, vLLM's field)
  and its vocabulary (``vocab_size``, where the server lists it).
- ``probe_vocab``: where the vocabulary is not listed (kvroute lists it), one 1-token
  completions request with the highest token id the workload would send: a refusal that names
  the vocabulary fails the run before it starts, naming the flags to set.
- ``probe_words``: the server's prompt tokens per synthesized word and its fixed overhead (chat
  template, BOS), from two 1-token requests (text prompts: ``--api chat``, live sessions).
- ``fit_ids`` / ``fit_plan``: token ids moved into the vocabulary; prompts cut (right, so shared
  prefixes stay shared) and, where even a short prompt would not fit, ``max_tokens`` capped,
  so every request fits the context.

Plus ``parse_headers`` (``--api-key`` / ``--header``) and ``redacted_argv`` (the argv a run
records, without those values).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from loadgen.client import JSON_HEADERS, encode_json, endpoint_url
from loadgen.prompts import WORDS
from loadgen.workloads import Planned

# RFC 9110 token characters: what a header name may hold
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# chat: a synthesized prompt's tokens per word vary around the probed mean (the words are drawn
# uniformly); cut prompts to this much above it, plus a few tokens of slack
TEXT_MARGIN = 1.15
TEXT_SLACK_TOKENS = 8


@dataclass(slots=True)
class EndpointInfo:
    model: str
    max_model_len: int | None = None
    vocab_size: int | None = None


def parse_headers(raw: Sequence[str] | None, api_key: str | None) -> dict[str, str]:
    """Request headers from ``--api-key`` (``Authorization: Bearer KEY``; empty: none) and the
    ``--header 'Name: value'`` items (a later one replaces an earlier one of the same name,
    ``Authorization`` included). Raises ``ValueError`` naming ``--header`` for a malformed item."""
    out: dict[str, str] = {}
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    for item in raw or ():
        name, sep, value = item.partition(":")
        name, value = name.strip(" \t"), value.strip(" \t")
        if not sep or not _HEADER_NAME.fullmatch(name):
            raise ValueError(f"--header: expected 'Name: value', got {item!r}")
        if any(c in value for c in "\r\n\0"):
            raise ValueError(f"--header: the value of {name} holds a line break or NUL")
        for old in [k for k in out if k.lower() == name.lower()]:
            del out[old]
        out[name] = value
    return out


def redacted_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the values of ``--api-key`` and ``--header`` replaced (header names kept),
    for the run's recorded metadata."""
    out: list[str] = []
    hide = ""
    for arg in argv:
        if hide:
            out.append(_redact(arg, hide))
            hide = ""
        elif arg in ("--api-key", "--header"):
            out.append(arg)
            hide = arg
        elif arg.startswith(("--api-key=", "--header=")):
            flag, _, value = arg.partition("=")
            out.append(f"{flag}={_redact(value, flag)}")
        else:
            out.append(arg)
    return out


def _redact(value: str, flag: str) -> str:
    if flag == "--header":
        return value.partition(":")[0] + ": ***"
    return "***"


def _base(url: str) -> str:
    return endpoint_url(url, "completions").removesuffix("/completions")


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _message(status: int, body: bytes) -> str:
    """An error response's message: the OpenAI error's ``message`` where it is one."""
    text = body[:2000].decode(errors="replace")
    try:
        doc = json.loads(text)
        msg = doc["error"]["message"] if isinstance(doc.get("error"), dict) else doc["detail"]
        return f"{status} {msg}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{status} {text[:200]}".strip()


async def discover(
    url: str, model: str | None, headers: dict[str, str], timeout_s: float
) -> tuple[EndpointInfo, str | None]:
    """The served model (``model``'s entry, else the first) from ``GET /v1/models``, and a
    notice when that failed but ``model`` was given (the run goes on, unfitted). Raises
    ``ValueError`` when it failed and ``model`` is None, or when the server refuses the
    credentials."""
    models = _base(url) + "/models"
    status, body = 0, b""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.get(models, headers=headers) as resp,
        ):
            status, body = resp.status, await resp.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        problem = repr(e)
    else:
        problem = _message(status, body)
    if status in (401, 403):
        raise ValueError(f"GET {models}: {problem} (give --api-key or --header)")
    if status == 200:
        try:
            entries = json.loads(body)["data"]
            entry = next((e for e in entries if e.get("id") == model), None) or entries[0]
            return EndpointInfo(
                model or str(entry["id"]),
                _positive_int(entry.get("max_model_len")),
                _positive_int(entry.get("vocab_size")),
            ), None
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            problem = f"not a model list: {e!r}"
    if model is None:
        raise ValueError(f"--model not given and GET {models} failed: {problem}")
    return EndpointInfo(model), (
        f"GET {models} failed ({problem}): prompts are not fitted to the model's context"
    )


async def _post(
    url: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float
) -> tuple[int, Any]:
    """POST ``body``: (status, the decoded JSON on 200 (None: not JSON) or the error's
    message otherwise)."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
        session.post(url, data=encode_json(body), headers={**JSON_HEADERS, **headers}) as resp,
    ):
        raw = await resp.read()
        if resp.status != 200:
            return resp.status, _message(resp.status, raw)
        try:
            return 200, json.loads(raw)
        except ValueError:
            return 200, None


async def probe_vocab(
    url: str, model: str, top_id: int, headers: dict[str, str], timeout_s: float
) -> None:
    """Raise ``ValueError`` naming ``--vocab-size``/``--token-offset`` when the server refuses
    ``top_id`` for its vocabulary (a server that does not list it in ``/v1/models``: the run's
    every request would be a 400); nothing when it takes the id or refuses it otherwise."""
    status, answer = await _post(
        endpoint_url(url, "completions"),
        {"model": model, "prompt": [top_id], "max_tokens": 1},
        headers,
        timeout_s,
    )
    if status == 400 and "vocab" in str(answer).lower():
        raise ValueError(
            f"--vocab-size/--token-offset: the endpoint refuses token id {top_id} ({answer}); "
            "set them inside the model's vocabulary"
        )


async def probe_words(
    url: str, model: str, chat: bool, headers: dict[str, str], timeout_s: float
) -> tuple[float, float] | None:
    """(prompt tokens per synthesized word, fixed tokens per prompt) on the server, from the
    ``usage`` of two 1-token requests (every word once; one word); None where it reports no
    usage or refuses."""
    endpoint = endpoint_url(url, "chat" if chat else "completions")
    counts = []
    for text in ("".join(" " + w for w in WORDS), " " + WORDS[0]):
        body: dict[str, Any] = {"model": model, "max_tokens": 1}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        status, answer = await _post(endpoint, body, headers, timeout_s)
        if status != 200:
            return None
        n = ((answer if isinstance(answer, dict) else {}).get("usage") or {}).get("prompt_tokens")
        if not isinstance(n, int):
            return None
        counts.append(n)
    per_word = max(1.0, (counts[0] - counts[1]) / (len(WORDS) - 1))
    return per_word, max(0.0, counts[1] - per_word)


def fit_ids(
    vocab: int | None,
    offset: int | None,
    model_vocab: int,
    default_vocab: int,
    default_offset: int,
) -> tuple[int, int, str | None]:
    """``(vocab_size, token_offset, notice)`` for token ids inside ``model_vocab``: the flags
    the user left at their defaults (None) move, given ones stay; notice None when nothing
    moved. Raises ``ValueError`` naming the flags when the given ones cannot fit."""
    v = default_vocab if vocab is None else vocab
    o = default_offset if offset is None else offset
    if o + v <= model_vocab:
        return v, o, None
    if vocab is None and offset is None:
        o = min(o, model_vocab // 16)
        v = model_vocab - o
    elif vocab is None:
        v = model_vocab - o
    elif offset is None:
        o = min(o, model_vocab - v)
    if v <= 0 or o < 0 or o + v > model_vocab:
        given = " and ".join(
            f for f, x in (("--vocab-size", vocab), ("--token-offset", offset)) if x is not None
        )
        raise ValueError(
            f"{given}: token ids {o}..{o + v - 1} do not fit the model's vocabulary of "
            f"{model_vocab}"
        )
    return v, o, f"token ids {o}..{o + v - 1} (the model's vocabulary is {model_vocab})"


@dataclass(slots=True)
class Fitted:
    plan: list[Planned]
    cut: int = 0  # prompts cut
    capped: int = 0  # max_tokens capped


def fit_plan(
    plan: Sequence[Planned],
    max_model_len: int,
    block_size: int,
    words: tuple[float, float] | None = None,
) -> Fitted:
    """``plan`` with every prompt plus its ``max_tokens`` inside ``max_model_len``: a reply of
    more than a quarter of the context where the pair does not fit is capped at that quarter,
    then the prompt is cut from the right (its hash ids with it, so shared leading blocks stay
    shared). ``words``: ``probe_words``' answer for text prompts, whose lengths count words
    (None: token-id prompts, lengths are tokens)."""
    per_word, fixed = words or (1.0, 0.0)
    margin = (TEXT_MARGIN, TEXT_SLACK_TOKENS) if words else (1.0, 0)
    out = Fitted([])
    for p in plan:
        req = p.req
        out_len = max(1, req.output_length)

        def room(reply: int) -> int:
            return math.floor((max_model_len - reply - fixed - margin[1]) / (per_word * margin[0]))

        length = req.input_length
        if length > room(out_len):
            if out_len > max_model_len // 4:
                out_len = max(1, max_model_len // 4)
                out.capped += 1
            length = min(length, max(1, room(out_len)))
        if length == req.input_length and out_len == max(1, req.output_length):
            out.plan.append(p)
            continue
        if length < req.input_length:
            out.cut += 1
        hash_ids = req.hash_ids[: math.ceil(length / block_size)]
        new = replace(req, input_length=length, output_length=out_len, hash_ids=hash_ids)
        out.plan.append(replace(p, req=new))
    return out
