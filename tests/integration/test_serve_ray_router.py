"""Ray Serve's own PrefixCacheAffinityRouter selected on the same engine deployment (the peer
kvroute is benchmarked against): requests flow, and a repeated prompt finds its cache."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from deploy.config import ServeConfig
from tests.support import free_port, serve_app

pytestmark = [pytest.mark.slow, pytest.mark.ray]
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
    with serve_app(cfg) as url:
        yield url


def test_ray_prefix_router_serves_and_keeps_affinity(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)
    # With two replicas one repeated prompt lands on its first replica half the time by luck;
    # six distinct prefixes, each sent twice, all hit only if the router keeps affinity
    # (1 in 64 by chance).
    for i in range(6):
        prompt = f"Prefix {i}: a long shared prefix for Ray's prefix-affinity router. " * 30
        first = client.completions.create(model="sim-tiny", prompt=prompt + "one", max_tokens=3)
        assert first.usage.completion_tokens == 3
        again = client.completions.create(model="sim-tiny", prompt=prompt + "two", max_tokens=3)
        assert again.usage.prompt_tokens_details.cached_tokens > 0, f"prefix {i} lost affinity"
