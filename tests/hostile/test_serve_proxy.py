"""Issue 61, finding 5 and the request id of finding 9: headers that Ray Serve's proxy decodes
itself. A byte >= 0x80 in ``x-request-id`` or ``x-session-id`` was a plain-text 500 before
authentication, on every path (``HTTPProxy.setup_request_context_and_handle`` decodes them as
UTF-8), and any printable ``x-request-id`` up to 8 KB became the request id in Serve's logs. The
guard in Serve's proxy (``deploy.proxy_guard``) answers both with an OpenAI-shaped 400 naming the
header; the real app under real Serve, over raw sockets (a byte >= 0x80 must go out as it is)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from deploy.config import ServeConfig
from engines.ports import free_port
from tests.hostile import hostile_config, raw_exchange, status_of
from tests.support import serve_app

pytestmark = [pytest.mark.slow, pytest.mark.ray]

KEY = b"sk-hostile"


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    cfg = ServeConfig.validated(hostile_config(free_port(), "kvroute-hostile-proxy"))
    with serve_app(cfg):
        yield cfg.port


def get(port: int, path: str, *headers: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    lines = [b"GET " + path.encode() + b" HTTP/1.1", b"host: 127.0.0.1", *headers]
    out, _ = raw_exchange(port, b"\r\n".join([*lines, b"connection: close", b"", b""]))
    head, _, body = out.partition(b"\r\n\r\n")
    fields = dict(
        (k.strip().lower(), v.strip())
        for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:])
    )
    return status_of(out), fields, body


def assert_header_refused(status: int, body: bytes, header: str) -> None:
    assert status == 400, (status, body)
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == header
    assert error["code"] == "invalid_header"
    assert header in error["message"]


@pytest.mark.parametrize("path", ["/health", "/v1/models"])
@pytest.mark.parametrize("header", ["x-request-id", "x-session-id"])
def test_a_byte_over_0x7f_is_a_400_naming_the_header(port: int, path: str, header: str) -> None:
    status, _, body = get(port, path, header.encode() + b": caf\xe9")
    assert_header_refused(status, body, header)
    # before authentication, as the 500 was: a key changes nothing
    status, _, body = get(
        port, path, header.encode() + b": caf\xe9", b"authorization: Bearer " + KEY
    )
    assert_header_refused(status, body, header)


@pytest.mark.parametrize(
    "value",
    [b"a" * 129, b"a" * 8000, b"<script>alert(1)</script>", b"id with spaces", b"caf\xc3\xa9"],
)
def test_a_request_id_is_short_plain_text(port: int, value: bytes) -> None:
    status, _, body = get(port, "/health", b"x-request-id: " + value)
    assert_header_refused(status, body, "x-request-id")


def test_a_good_request_id_passes_and_comes_back(port: int) -> None:
    rid = b"Ab0._:-" + b"z" * 121  # 128 characters, every kind allowed
    status, headers, _ = get(port, "/health", b"x-request-id: " + rid)
    assert status == 200
    assert headers[b"x-request-id"] == rid
    status, _, body = get(
        port, "/v1/models", b"x-request-id: req-1", b"authorization: Bearer " + KEY
    )
    assert status == 200, body
    assert json.loads(body)["data"][0]["id"] == "sim-tiny"
    # a UTF-8 session id is fine for Serve: the guard lets it through to authentication
    status, _, _ = get(port, "/v1/models", "x-session-id: café".encode())
    assert status == 401
