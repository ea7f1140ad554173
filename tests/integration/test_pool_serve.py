"""``kvroute serve``'s pool path without Ray (issue 58): with ``pool.enabled`` the master and its
metadata server answer on 127.0.0.1 while the deployment runs, their address is in the engine
config, and both are gone after it, on an error too."""

from __future__ import annotations

import os
import socket

import pytest

from deploy.commands.serve import local_pool
from deploy.config import ServeConfig
from engines.pool import PoolUnavailable, find_master_binary

try:
    find_master_binary()
except PoolUnavailable as e:  # `make mooncake` installs it; the test tier runs it
    pytest.skip(str(e), allow_module_level=True)


def _answers(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
        return True
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_serve_starts_the_pool_master_on_loopback_and_stops_it() -> None:
    cfg = ServeConfig.validated({"pool": {"enabled": True, "segment_gib": 1}})
    pids: list[int] = []
    before = _children()  # the test process may run other children (an xdist worker's Ray)
    with local_pool(cfg) as served:
        pool = served.engine.pool
        assert pool is not None and pool.segment_gib == 1
        assert pool.master_address.startswith("127.0.0.1:")
        metadata = pool.metadata_url.removeprefix("http://").removesuffix("/metadata")
        assert metadata.startswith("127.0.0.1:")
        assert _answers(pool.master_address) and _answers(metadata)
        pids = sorted(_children() - before)
        assert len(pids) == 2, pids  # mooncake_master and the metadata server
    assert not _answers(pool.master_address) and not _answers(metadata)
    assert not [p for p in pids if _alive(p)]


def test_an_error_while_serving_stops_the_master_too() -> None:
    cfg = ServeConfig.validated({"pool": {"enabled": True}})
    address = ""
    with pytest.raises(KeyboardInterrupt), local_pool(cfg) as served:
        assert served.engine.pool is not None
        address = served.engine.pool.master_address
        assert _answers(address)
        raise KeyboardInterrupt  # Ctrl-C while Ray starts
    assert address and not _answers(address)


def test_with_the_pool_off_serve_starts_nothing() -> None:
    cfg = ServeConfig()
    with local_pool(cfg) as served:
        assert served is cfg and served.engine.pool is None


def _child(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return False
    return int(text[text.rindex(")") + 2 :].split()[1]) == os.getpid() and _alive(pid)


def _children() -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit() and _child(int(p))}
