"""Guards that run inside Ray Serve's HTTP proxy process, ahead of anything Serve does with a
request: installed through Serve's ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` hook, which the
proxy actor calls once when it starts (``ray.serve._private.http_util.configure_http_middlewares``)
and whose Starlette middlewares it wraps around its own ASGI app, outside Serve's
``RequestIdMiddleware``.

- ``HeaderGuard`` (an ASGI middleware): Serve's proxy decodes ``x-request-id``, the session-id
  header, ``serve_multiplexed_model_id`` and a few others as UTF-8 itself
  (``HTTPProxy.setup_request_context_and_handle``), so one byte >= 0x80 there was a plain-text
  500 before the app saw the request, and a client's ``x-request-id`` (any printable text up to
  uvicorn's header limit) became the request id in Serve's logs. The guard answers such a request
  with an OpenAI-shaped 400 naming the header; ``x-request-id`` must be 1-128 characters of
  ``[A-Za-z0-9._:-]``.
- ``GuardedHttpToolsProtocol`` (uvicorn's httptools protocol, made uvicorn's ``auto``): uvicorn
  bounds only the idle time between requests (``timeout_keep_alive``); a client that sends part
  of its headers, or part of its body, and stalls held the connection for ever. Headers must be
  complete within ``KVROUTE_HTTP_HEADER_TIMEOUT_S`` (default 10 s) of the connection or of the
  request's first byte, and a body within ``KVROUTE_HTTP_BODY_TIMEOUT_S`` (default 60 s) of its
  headers; past that the client gets a 408 (when no response has started) and the connection is
  closed, which the app sees as a disconnect.

Every process of a Ray cluster reads the hook from its environment when it starts: it is in
``deploy.config.RAY_SERVE_ENV``, which ``kvroute serve`` puts there before it starts a local Ray
and every ``ray start`` of the cluster files carries. Imports only the standard library and,
when the proxy calls it, Starlette and uvicorn (no kvroute router code in the proxy process).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "deploy.proxy_guard:proxy_middlewares"
HEADER_TIMEOUT_ENV = "KVROUTE_HTTP_HEADER_TIMEOUT_S"
BODY_TIMEOUT_ENV = "KVROUTE_HTTP_BODY_TIMEOUT_S"
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0

REQUEST_ID_HEADER = b"x-request-id"
REQUEST_ID_MAX = 128
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,%d}" % REQUEST_ID_MAX)
# headers Serve's proxy decodes as UTF-8 (besides the request id and the session id header, whose
# name is Ray's ``RAY_SERVE_SESSION_ID_HEADER_KEY``), compared with ``-`` read as ``_``
_DECODED_BY_SERVE = frozenset(
    {
        "serve_multiplexed_model_id",
        "traceparent",
        "x_request_timeout_seconds",
        "x_request_disconnect_disabled",
    }
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger(__name__)


def timeout_from_env(name: str, default: float) -> float:
    """A positive number of seconds from ``$name`` (``default`` when unset; 0 or less: none)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${name}: expected seconds, got {raw!r}") from None
    return value if value > 0 else float("inf")


def _session_header() -> str:
    try:
        from ray.serve._private.constants import SERVE_SESSION_ID
    except ImportError:  # not in a Serve proxy: Ray's default
        return "x_session_id"
    return str(SERVE_SESSION_ID).lower().replace("-", "_")


def header_problem(headers: list[tuple[bytes, bytes]], session_header: str) -> tuple[str, str]:
    """The first header Serve's proxy could not take, as (its name, why); ("", "") when none."""
    for raw_name, value in headers:
        name = raw_name.decode("latin-1").lower()
        if name == "x-request-id":
            if _REQUEST_ID.fullmatch(value) is None:
                return name, (
                    f"must be 1-{REQUEST_ID_MAX} characters of letters, digits and '._:-'"
                )
            continue
        key = name.replace("-", "_")
        if key == session_header or key in _DECODED_BY_SERVE:
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                return name, "must be UTF-8 text"
    return "", ""


def error_body(header: str, why: str) -> bytes:
    return json.dumps(
        {
            "error": {
                "message": f"header {header}: {why}",
                "type": "invalid_request_error",
                "param": header,
                "code": "invalid_header",
            }
        }
    ).encode()


class HeaderGuard:
    """Answers a request whose Serve-read headers Serve's proxy would fail on (or log as they
    came) with an OpenAI-shaped 400, before the proxy sees it; see the module docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.session_header = _session_header()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header, why = header_problem(scope["headers"], self.session_header)
            if header:
                body = error_body(header, why)
                await send(
                    {
                        "type": "http.response.start",
                        "status": 400,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


_TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


def _timeout_response(what: str) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"the client sent its {what} too slowly",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        }
    ).encode()
    return _TIMEOUT_408 % (len(body), body)


def guarded_protocol_class() -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with deadlines for a request's headers and body (see the
    module docstring). Built on demand: only the proxy process imports uvicorn's protocols."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    header_s = timeout_from_env(HEADER_TIMEOUT_ENV, DEFAULT_HEADER_TIMEOUT_S)
    body_s = timeout_from_env(BODY_TIMEOUT_ENV, DEFAULT_BODY_TIMEOUT_S)

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None

        def _arm(self, seconds: float, what: str) -> None:
            self._disarm()
            if seconds != float("inf"):
                self._deadline = self.loop.call_later(seconds, self._expired, what)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self, what: str) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                return  # closed, or upgraded to a WebSocket (its own protocol now)
            if self.flow.read_paused:  # the app is not reading: not the client's delay
                self._arm(1.0, what)
                return
            cycle = self.cycle
            idle = cycle is None or cycle.response_complete
            if idle or not cycle.response_started:
                self.transport.write(_timeout_response(what))
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the app's receive() now reads a disconnect
                cycle.message_event.set()
            self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm(header_s, "headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._deadline is None:  # a connection's first request: armed since it opened
                self._arm(header_s, "headers")

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm(body_s, "body")

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()

    return GuardedHttpToolsProtocol


def install_protocol() -> bool:
    """Make the guarded protocol uvicorn's ``auto`` HTTP protocol in this process (Serve builds
    its ``uvicorn.Config`` with the default, ``auto``, which uvicorn resolves when the server
    starts). False, and nothing changed, without httptools (uvicorn's h11 protocol)."""
    try:
        import httptools  # noqa: F401
        from uvicorn import config
    except ImportError:
        logger.warning("kvroute proxy guard: no httptools, slow clients are not timed out")
        return False
    globals()["GuardedHttpToolsProtocol"] = guarded_protocol_class()
    config.HTTP_PROTOCOLS["auto"] = f"{__name__}:GuardedHttpToolsProtocol"
    return True


def proxy_middlewares() -> list[Any]:
    """Serve's proxy callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``): installs the
    timeouts and returns the header guard, as Starlette ``Middleware``."""
    from starlette.middleware import Middleware

    install_protocol()
    return [Middleware(HeaderGuard)]
