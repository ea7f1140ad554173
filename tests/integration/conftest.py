"""Shared fixtures for the integration tier: real Redis servers on free loopback ports (an open
one, and one that requires an ACL user and password)."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support import free_port

# The secured server's ACL user: may use kvroute's keys and nothing else.
REDIS_USER, REDIS_PASSWORD = "kvroute", "test-secret-3f9a"


@contextmanager
def redis_server(
    workdir: Path,
    *extra: str,
    username: str | None = None,
    password: str | None = None,
    port: int | None = None,
) -> Iterator[str]:
    """A redis-server on ``port`` (default: a free loopback port; ``extra``: more server
    arguments); yields its URL (without credentials) once it answers ``username``/``password``,
    and stops it afterwards."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: `make test` installs it (apt-get)")
    port = port or free_port()
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(
        [*args, "--dir", str(workdir), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port, username=username, password=password)
    deadline = time.monotonic() + 20
    try:
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("redis-server did not start")
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="session")
def secured_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Auth on: the default user is off; ``REDIS_USER`` may touch ``kvroute*`` keys only."""
    acl = [
        "--user",
        "default",
        "off",
        "--user",
        REDIS_USER,
        "on",
        f">{REDIS_PASSWORD}",
        "~kvroute*",
        "+@all",
    ]
    with redis_server(
        tmp_path_factory.mktemp("redis-acl"), *acl, username=REDIS_USER, password=REDIS_PASSWORD
    ) as url:
        yield url
