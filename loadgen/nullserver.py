"""A small, real OpenAI-compatible server with no model: the load generator's test and benchmark
peer. ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming SSE and plain JSON),
``GET /v1/models``, ``GET /health``.

Each request gets exactly ``max_tokens`` tokens of filler text after ``ttft_ms``, then one token
every ``itl_ms`` (with ``itl_ms == 0`` the whole stream goes out in one write). With ``cache`` on,
the server keeps an infinite prefix cache of the chained block hashes of prompt + output (word
prompts are mapped to ids by CRC32) and reports ``usage.prompt_tokens_details.cached_tokens``
as a vLLM engine with prefix caching would. ``record`` keeps each request's arrival time
(``perf_counter``) and prompt token ids for tests.

Run it alone: ``python -m loadgen.nullserver --port 8100`` (prints its URL on the first line).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from cachemap.hashing import block_hashes, salt_hash
from loadgen.client import loop_factory
from loadgen.prompts import WORDS

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(slots=True)
class Arrival:
    time_s: float  # perf_counter() at arrival
    path: str
    prompt_tokens: list[int]
    body: dict[str, Any]


@dataclass
class NullServer:
    model: str = "null"
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    block_size: int = 16
    cache: bool = True
    record: bool = False
    error_every: int = 0  # every n-th request answers 503 (0 = never)
    arrivals: list[Arrival] = field(default_factory=list)
    requests: int = 0
    inflight: int = 0
    inflight_peak: int = 0
    _cached: set[int] = field(default_factory=set)
    _salt: int | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=2**28)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, _req: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, _req: web.Request) -> web.Response:
        data = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        return web.Response(body=_encode(data), content_type="application/json")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        self.inflight += 1
        self.inflight_peak = max(self.inflight_peak, self.inflight)
        try:
            return await self._respond(request, chat)
        finally:
            self.inflight -= 1

    async def _respond(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrived = time.perf_counter()
        self.requests += 1
        try:
            body = _decode(await request.read())
            tokens = _prompt_tokens(body, chat)
            max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
            if max_tokens < 1:
                raise ValueError("max_tokens must be >= 1")
        except (msgspec.DecodeError, ValueError, TypeError, AttributeError) as e:
            return _error(400, f"invalid request: {e}")
        if self.record:
            self.arrivals.append(Arrival(arrived, request.path, tokens, body))
        if self.error_every and self.requests % self.error_every == 0:
            return _error(503, "null server: injected failure")
        out_ids = [(len(tokens) + i) % len(WORDS) for i in range(max_tokens)]
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": max_tokens,
            "total_tokens": len(tokens) + max_tokens,
            "prompt_tokens_details": {"cached_tokens": self._lookup(tokens, out_ids)},
        }
        if self.ttft_ms:
            await asyncio.sleep(self.ttft_ms / 1e3)
        texts = [" " + WORDS[i] for i in out_ids]
        if not body.get("stream"):
            if self.itl_ms:
                await asyncio.sleep(self.itl_ms * (max_tokens - 1) / 1e3)
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(texts)}
            else:
                choice["text"] = "".join(texts)
            kind = "chat.completion" if chat else "text_completion"
            data = {"id": "null", "object": kind, "created": 0, "model": self.model}
            data |= {"choices": [choice], "usage": usage}
            return web.Response(body=_encode(data), content_type="application/json")
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        events = [_event(t, chat, self.model) for t in texts]
        opts = body.get("stream_options") or {}
        tail = b""
        if opts.get("include_usage"):
            tail = b"data: " + _encode({"id": "null", "choices": [], "usage": usage}) + b"\n\n"
        tail += b"data: [DONE]\n\n"
        if not self.itl_ms:
            await resp.write(b"".join(events) + tail)
        else:
            for i, ev in enumerate(events):
                if i:
                    await asyncio.sleep(self.itl_ms / 1e3)
                await resp.write(ev)
            await resp.write(tail)
        await resp.write_eof()
        return resp

    def _lookup(self, prompt: list[int], output: list[int]) -> int:
        if not self.cache:
            return 0
        salt = self._salt if self._salt is not None else salt_hash(self.model)
        self._salt = salt
        hashes = block_hashes(prompt, self.block_size, salt)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self._cached:
            hit += 1
        # NOTE: like vLLM, the blocks of the generated tokens are cached too (next turns hit).
        self._cached.update(block_hashes(prompt + output, self.block_size, salt))
        return hit * self.block_size


def _word_ids(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) for w in text.split()]


def _prompt_tokens(body: dict[str, Any], chat: bool) -> list[int]:
    if chat:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        tokens: list[int] = []
        for m in messages:
            tokens.append(zlib.crc32(f"<|{m['role']}|>".encode()))
            tokens.extend(_word_ids(str(m.get("content") or "")))
        return tokens
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return _word_ids(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    raise ValueError("prompt must be a string or a list of token ids")


def _event(text: str, chat: bool, model: str) -> bytes:
    if chat:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": None}
        kind = "text_completion"
    doc = {"id": "null", "object": kind, "created": 0, "model": model, "choices": [choice]}
    return b"data: " + _encode(doc) + b"\n\n"


def _error(status: int, message: str) -> web.Response:
    err = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return web.Response(status=status, body=_encode(err), content_type="application/json")


async def _start(
    server: NullServer, host: str, port: int, **site_kw: Any
) -> tuple[web.AppRunner, str]:
    """Serve ``server`` on ``host:port`` (0 picks a free port); returns its runner and base URL."""
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, **site_kw)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://{host}:{port}"


@contextlib.contextmanager
def serve_in_thread(server: NullServer, host: str = "127.0.0.1") -> Iterator[str]:
    """Run ``server`` on its own event loop in a daemon thread; yields its base URL."""
    loop = asyncio.new_event_loop()
    ready: list[str] = []
    started = threading.Event()

    def target() -> None:
        asyncio.set_event_loop(loop)
        runner, url = loop.run_until_complete(_start(server, host, 0))
        ready.append(url)
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=target, name="nullserver", daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("null server did not start within 10 s")
    try:
        yield ready[0]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadgen.nullserver", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    p.add_argument("--model", default="null")
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-cache", action="store_true", help="report no cached tokens")
    args = p.parse_args(argv)
    server = NullServer(args.model, args.ttft_ms, args.itl_ms, args.block_size, not args.no_cache)

    async def serve() -> None:
        _, url = await _start(server, args.host, args.port, backlog=4096)
        print(url, flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory()) as r:
        r.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
