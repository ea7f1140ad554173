"""Shared fixtures for the integration tier: real Redis servers on free loopback ports (an open
one, and one that requires an ACL user and password)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import redis_server

# The secured server's ACL user: may use kvroute's keys and nothing else.
REDIS_USER, REDIS_PASSWORD = "kvroute", "test-secret-3f9a"


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
