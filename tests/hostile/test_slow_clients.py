"""Issue 61, finding 9: a client that sends part of its headers or body and stalls held its
connection (and the proxy's state for it) for ever: uvicorn, under Ray Serve's proxy, bounds only
the idle time between requests. The guarded protocol (``deploy.proxy_guard``) gives headers and
bodies deadlines: the client gets a 408 and the connection is closed.

First the protocol itself under uvicorn with 1-2 s deadlines (no Ray), then the real app under
real Serve, whose proxy must be running it (the default 10 s header deadline)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from deploy.config import ServeConfig
from deploy.proxy_guard import (
    BODY_TIMEOUT_ENV,
    DEFAULT_HEADER_TIMEOUT_S,
    HEADER_TIMEOUT_ENV,
    guarded_protocol_class,
)
from engines.environ import scoped_environ
from engines.ports import free_port
from tests.hostile import hostile_config, raw_exchange, status_of
from tests.support import serve_app

pytestmark = [pytest.mark.slow, pytest.mark.ray]

HEADER_S, BODY_S = 1.0, 2.0
SLACK_S = 1.5  # a loaded 2-core runner's lateness, on top of a deadline
POST = (
    b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n"
)


async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body, then answers with its size; ``/slow`` streams for 3 s first."""
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    if scope["path"] == "/slow":
        for _ in range(6):
            await send({"type": "http.response.body", "body": b".", "more_body": True})
            await asyncio.sleep(0.5)
    await send({"type": "http.response.body", "body": str(size).encode()})


@pytest.fixture(scope="module")
def guarded_port() -> Iterator[int]:
    with scoped_environ({HEADER_TIMEOUT_ENV: str(HEADER_S), BODY_TIMEOUT_ENV: str(BODY_S)}):
        protocol = guarded_protocol_class()
    port = free_port()
    config = uvicorn.Config(
        echo, host="127.0.0.1", port=port, http=protocol, lifespan="off", log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def assert_timed_out(out: bytes, seconds: float, bound: float) -> None:
    assert status_of(out) == 408, out
    assert b'"code": "request_timeout"' in out
    assert bound - 0.2 <= seconds <= bound + SLACK_S, seconds


@pytest.mark.parametrize(
    "sent",
    [b"", b"GET /echo HTTP/1.1\r\nhost: x\r\nx-slow: ", b"GET /ec"],
    ids=["nothing", "half-a-header", "half-a-request-line"],
)
def test_stalled_headers_time_out(guarded_port: int, sent: bytes) -> None:
    out, seconds = raw_exchange(guarded_port, sent, timeout_s=10)
    assert_timed_out(out, seconds, HEADER_S)


def test_a_stalled_body_times_out(guarded_port: int) -> None:
    out, seconds = raw_exchange(guarded_port, POST + b'\r\n{"prompt": "', timeout_s=10)
    assert_timed_out(out, seconds, BODY_S)


def test_a_trickled_body_times_out_too(guarded_port: int) -> None:
    """The body's deadline is for all of it: a byte every 0.3 s does not keep it open."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", guarded_port), timeout=10) as s:
        s.sendall(POST + b"\r\n")
        out = b""
        try:
            for _ in range(40):
                s.sendall(b" ")
                time.sleep(0.3)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
    assert status_of(out) == 408, out
    assert time.monotonic() - start <= BODY_S + SLACK_S + 0.6


def test_the_next_request_on_a_connection_has_a_header_deadline(guarded_port: int) -> None:
    """After a full exchange, a second request that stalls mid-header is closed too (uvicorn's
    keep-alive timer stops at the first byte of it)."""
    first = b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n"
    out, seconds = raw_exchange(guarded_port, first + b"GET /echo HTTP/1.1\r\nhost", timeout_s=10)
    assert out.startswith(b"HTTP/1.1 200"), out
    assert out.count(b"HTTP/1.1 ") == 2 and b"408 Request Timeout" in out, out
    assert HEADER_S - 0.2 <= seconds <= HEADER_S + SLACK_S


def test_prompt_clients_and_long_answers_are_not_cut(guarded_port: int) -> None:
    body = b'{"prompt": "' + b"x" * 86 + b'"}'
    assert len(body) == 100
    out, _ = raw_exchange(guarded_port, POST + b"connection: close\r\n\r\n" + body)
    assert status_of(out) == 200 and b"\r\n100\r\n" in out, out  # chunked
    # a 3 s streamed answer outlives both deadlines: they bound what the client sends
    slow = b"GET /slow HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    out, seconds = raw_exchange(guarded_port, slow, timeout_s=10)
    assert status_of(out) == 200 and out.count(b"\r\n.\r\n") == 6, out
    assert out.endswith(b"\r\n0\r\n\r\n"), out  # the whole answer
    assert seconds >= 2.5


@pytest.fixture(scope="module")
def serve_port() -> Iterator[int]:
    cfg = ServeConfig.validated(hostile_config(free_port(), "kvroute-hostile-slow"))
    with serve_app(cfg):
        yield cfg.port


def test_serve_proxy_times_out_stalled_headers(serve_port: int) -> None:
    """Serve's proxy runs the guarded protocol (``kvroute serve``'s environment): a half-sent
    request to the real app is answered 408 and closed at the default deadline."""
    sent = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bear"
    out, seconds = raw_exchange(serve_port, sent, timeout_s=DEFAULT_HEADER_TIMEOUT_S + 10)
    assert_timed_out(out, seconds, DEFAULT_HEADER_TIMEOUT_S)
