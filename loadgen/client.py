"""One OpenAI-compatible request over aiohttp, streamed, with client-side timing; plus the
endpoint URL and event-loop helpers the runner and the CLI share.

``send`` fills a ``RequestRecord`` in place: send time, first-token time, inter-token gaps, end
time, token counts and ``usage`` (incl. ``prompt_tokens_details.cached_tokens``), or an error
kind: ``http_<status>``, ``timeout``, ``connect``, ``disconnect``, ``bad_response``,
``stream_error`` (an error event inside the stream),
``interrupted`` (the run was stopped) or the exception's class name.
"""

from __future__ import annotations

import asyncio
import math
from time import perf_counter
from typing import Any

import aiohttp
import msgspec
from yarl import URL

from loadgen.records import RequestRecord

_decode = msgspec.json.Decoder().decode
encode_json = msgspec.json.Encoder().encode
JSON_HEADERS = {"Content-Type": "application/json"}


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return "disconnect"
    if isinstance(exc, msgspec.DecodeError | KeyError | TypeError | IndexError):
        return "bad_response"
    return type(exc).__name__


def _event_text(event: Any, chat: bool) -> str:
    choices = event.get("choices")
    if not choices:
        return ""
    c = choices[0]
    if chat:
        delta = c.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return c.get("text") or ""


def _take_usage(rec: RequestRecord, usage: dict[str, Any]) -> None:
    rec.prompt_tokens = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details") or {}
    rec.cached_tokens = details.get("cached_tokens")
    if usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])


async def send(
    session: aiohttp.ClientSession,
    url: str | URL,
    data: bytes,
    rec: RequestRecord,
    t0: float,
    *,
    stream: bool,
    chat: bool,
    keep_reply: bool = False,
) -> None:
    """POST the JSON ``data`` to ``url`` and record timing into ``rec`` (times relative to
    ``t0``, ``sent_s`` taken just before the request goes out)."""
    rec.sent_s = perf_counter() - t0
    parts: list[str] = []
    try:
        async with session.post(url, data=data, headers=JSON_HEADERS) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error_detail = (await resp.read())[:300].decode(errors="replace")
                rec.error = f"http_{resp.status}"
                rec.done_s = perf_counter() - t0
                return
            if not stream:
                doc = _decode(await resp.read())
                now = perf_counter() - t0
                parts.append(_message_text(doc) if chat else _event_text(doc, False))
                rec.first_token_s = rec.done_s = now
                if doc.get("usage"):
                    _take_usage(rec, doc["usage"])
            else:
                await _read_stream(resp, rec, t0, chat, parts)
                rec.done_s = perf_counter() - t0
    except Exception as exc:  # errors by kind, never a crash of the run
        rec.error = _error_kind(exc)
        rec.error_detail = f"{type(exc).__name__}: {exc}"[:300]
        rec.done_s = perf_counter() - t0
        return
    except asyncio.CancelledError:
        rec.error = "interrupted"
        rec.done_s = perf_counter() - t0
        raise
    if keep_reply:
        rec.reply = "".join(parts)


def _message_text(data: Any) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    return (choices[0].get("message") or {}).get("content") or ""


async def _read_stream(
    resp: aiohttp.ClientResponse, rec: RequestRecord, t0: float, chat: bool, parts: list[str]
) -> None:
    buf = b""
    events = 0
    last = math.nan
    async for chunk in resp.content.iter_any():
        now = perf_counter() - t0
        buf += chunk
        if b"\n" not in chunk:
            continue
        lines = buf.split(b"\n")
        buf = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            event = _decode(payload)
            if event.get("error"):
                rec.error = "stream_error"  # e.g. vLLM's mid-stream error event
            if event.get("usage"):
                _take_usage(rec, event["usage"])
            text = _event_text(event, chat)
            if not text:
                continue
            parts.append(text)
            events += 1
            if events == 1:
                rec.first_token_s = now
            else:
                rec.itl_s.append(now - last)
            last = now
    if rec.output_tokens == 0:
        rec.output_tokens = events
    if events == 0:
        rec.first_token_s = perf_counter() - t0


def endpoint_url(base: str, api: str) -> str:
    base = base.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {base!r}")
    for suffix in ("/chat/completions", "/completions"):
        base = base.removesuffix(suffix)
    if not base.endswith("/v1"):
        base += "/v1"
    return base + ("/chat/completions" if api == "chat" else "/completions")


def loop_factory() -> Any:
    """uvloop's event loop factory when installed, else None (asyncio's default loop)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def raise_fd_limit() -> None:
    """Raise the soft open-files limit to the hard limit (many concurrent streams)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass
