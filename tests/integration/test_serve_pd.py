"""Prefill/decode pools under real Ray Serve, as ``kvroute serve --config
deploy/serve-pd-sim.yaml`` deploys them: a prefill pool and a decode pool, each its own engine
deployment with its own KvRequestRouter, one Ray bus, driven over HTTP by the official openai
client. The decode replicas' KV events reach the ingress's map, so a conversation's next turn
is placed on the decode engine holding its prefix."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from deploy.config import ServeConfig
from tests.support import free_port, metric, serve_app

pytestmark = [pytest.mark.slow, pytest.mark.ray]

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "serve-pd-sim.yaml"
LONG = "A long shared system prompt about disaggregated serving. " * 40


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    data = yaml.safe_load(CONFIG.read_text())
    data.update(port=free_port(), app_name="kvroute-pd")
    data["bus"]["name"] = "kvroute-pd"
    for pool in data["pools"]:
        pool["resources"] = {"num_cpus": 0.25}
    cfg = ServeConfig.validated(data, source=str(CONFIG))
    with serve_app(cfg) as base:
        yield base


def test_a_long_prompt_is_split_and_its_next_turn_stays_on_the_decode_engine(served: str) -> None:
    assert httpx.get(f"{served}/health", timeout=10).json()["instances"] == 3
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="x", max_retries=0, timeout=60)
    chat = [{"role": "system", "content": LONG}, {"role": "user", "content": "Hello."}]
    first = client.chat.completions.create(model="tiny", messages=chat, max_tokens=8)
    assert first.usage.completion_tokens == 8 and first.usage.prompt_tokens > 256
    pd = metric(served, "kvroute_pd_requests")
    assert pd['{path="split"}'] == 1 and pd['{path="colocated"}'] == 0
    assert metric(served, "kvroute_pd_handed_tokens")[""] >= first.usage.prompt_tokens - 32
    time.sleep(0.5)  # the decode replica's KV events: engine -> forwarder -> Ray bus -> map
    chat += [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "And?"}]
    nxt = client.chat.completions.create(model="tiny", messages=chat, max_tokens=4)
    pd = metric(served, "kvroute_pd_requests")
    assert pd['{path="split"}'] == 1 and pd['{path="colocated"}'] == 1
    assert nxt.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32
    waiting = metric(served, "kvroute_pool_waiting")
    assert set(waiting) == {'{pool="prefill"}', '{pool="decode"}'}
