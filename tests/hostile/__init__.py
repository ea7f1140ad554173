"""The hostile-client suite (issue 61): what a client can send to break or starve the router.
The shared Ray its Ray modules run on starts with ``deploy.config.RAY_SERVE_ENV``
(tests/conftest.py), as ``kvroute serve`` starts one: Serve's proxy runs with kvroute's guard
(``deploy.proxy_guard``)."""

from __future__ import annotations

import socket
import time
from typing import Any


def hostile_config(port: int, name: str) -> dict[str, Any]:
    """A small ``kvroute serve`` deployment (one sim engine, one ingress replica, an API key)
    on 127.0.0.1:``port``, for ``ServeConfig.validated``."""
    return {
        "port": port,
        "app_name": name,
        "engines": {
            "instances": 1,
            "engine": {"kind": "sim", "served_model_name": "sim-tiny", "block_size": 32},
            "resources": {"num_cpus": 0.5},
            "bus": {"name": name},
        },
        "router": {"api_keys": ["sk-hostile"], "replicas": 1},
    }


def raw_exchange(port: int, data: bytes, timeout_s: float = 30.0) -> tuple[bytes, float]:
    """Send ``data`` on a fresh connection to 127.0.0.1:``port`` and read until the server
    closes it: (all it sent, seconds until it closed); ``b""`` and ``timeout_s`` when it
    neither answered nor closed in ``timeout_s``."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        if data:
            s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            return out, timeout_s
        except ConnectionResetError:
            pass
    return out, time.monotonic() - start


def status_of(response: bytes) -> int:
    """The status code of a raw HTTP/1.1 response (0: none)."""
    line = response.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 and line[1].isdigit() else 0
