"""Issue 61, finding 6: a client that drops its stream is a client abort, not a server error.
Under Ray Serve the cancellation reached the ingress's catch-all handler, which logged "internal
error" with a traceback and counted ``kvroute_errors_total{status="500"}`` (300 dropped streams
counted 100). The real app under real Serve; streams dropped before and after their first
token."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from deploy.config import ServeConfig
from engines.ports import free_port
from tests.hostile import hostile_config
from tests.support import metric, serve_app, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.ray]

KEY = "sk-hostile"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    cfg = hostile_config(free_port(), "kvroute-hostile-aborts")
    cfg["engines"]["engine"]["sim_options"] = {"time_scale": 1.0}  # streams last to be dropped
    with serve_app(ServeConfig.validated(cfg)) as url:
        yield url


async def _drop(client: httpx.AsyncClient, base: str, i: int, after_first: bool) -> None:
    body = {
        "model": "sim-tiny",
        "prompt": f"drop {i} " * 50,
        "max_tokens": 400,
        "stream": True,
    }
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH) as r:
            if after_first:
                async for _ in r.aiter_bytes():
                    break
    except (httpx.TimeoutException, httpx.RemoteProtocolError):
        pass


def test_dropped_streams_are_counted_as_client_aborts_not_500s(base: str) -> None:
    async def run() -> None:
        # before the first token (the 200 not sent yet) and after it
        timeout = httpx.Timeout(30, read=0.05)
        async with httpx.AsyncClient(timeout=timeout) as client:
            await asyncio.gather(*(_drop(client, base, i, False) for i in range(100)))
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*(_drop(client, base, i, True) for i in range(100, 300)))

    asyncio.run(run())

    def settled() -> bool:  # every dropped stream's engine request aborted
        return sum(metric(base, "kvroute_instance_running", AUTH).values()) == 0

    assert wait_for(settled, timeout_s=60)
    errors = metric(base, "kvroute_errors_total", AUTH)
    assert errors.get('{status="500"}', 0) == 0, errors
    assert errors.get('{status="stream"}', 0) == 0, errors
    assert errors.get('{status="499"}', 0) > 0, errors
    ok = httpx.post(
        f"{base}/v1/completions",
        json={"model": "sim-tiny", "prompt": "still fine", "max_tokens": 2},
        headers=AUTH,
        timeout=30,
    )
    assert ok.status_code == 200
