"""Ray Serve's own PrefixCacheAffinityRouter selected on the same engine deployment (the peer
kvroute is benchmarked against): requests flow, and a repeated prompt finds its cache."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import ray
from ray import serve

from deploy.app import build_serve_app
from deploy.config import ServeConfig
from engines.deployment import open_buses
from tests.support import free_port

pytestmark = [pytest.mark.slow]
pytest.importorskip("pyarrow")


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    port = free_port()
    cfg = ServeConfig.validated(
        {
            "port": port,
            "app_name": "kvroute-rayrouter",
            "engines": {
                "instances": 2,
                "engine": {"kind": "sim", "served_model_name": "sim-tiny", "block_size": 32},
                "resources": {"num_cpus": 0.5},
                "bus": {"name": "kvroute-rayrouter"},
            },
            "router": {"scorer": "ray_prefix"},
        }
    )
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_serve_app(cfg), name=cfg.app_name, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/health").json().get("instances", 0) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    try:
        yield url
    finally:
        serve.delete(cfg.app_name)
        for bus in open_buses(cfg.engines.bus, create=False):
            bus.kill()  # type: ignore[attr-defined]
        serve.shutdown()
        if started:
            ray.shutdown()


def test_ray_prefix_router_serves_and_keeps_affinity(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)
    prompt = "The same long shared prefix for Ray's prefix-affinity router. " * 30
    first = client.completions.create(model="sim-tiny", prompt=prompt + "one", max_tokens=3)
    assert first.usage.completion_tokens == 3
    second = client.completions.create(model="sim-tiny", prompt=prompt + "two", max_tokens=3)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
