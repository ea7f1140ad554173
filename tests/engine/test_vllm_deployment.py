"""The real vLLM engine inside the Ray Serve deployment: streaming through a handle, its KV events
on the Ray bus reaching a cache map under the replica's instance id, health, and InstanceGone."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray.serve")

from ray import serve

from cachemap.hashing import BlockHasher
from cachemap.ingest import CacheMapIngestor
from cachemap.map import CacheMap
from engines.base import EngineRequest, SamplingParams
from engines.bus.liveness import EngineWatcher
from engines.bus.ray_bus import RayEventBus
from engines.config import EngineDeploymentConfig
from engines.deployment import build_engine_app, open_buses

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.ray]

APP = "kvroute-test-vllm"
CONFIG = EngineDeploymentConfig(
    engine={"kind": "vllm", "model": "tiny", "served_model_name": "tiny-llama", "block_size": 32},
    instances=1,
    resources={"num_cpus": 1},
    bus={"name": "kvroute-test-vllm"},
)


@pytest.fixture(scope="module")
def app() -> Iterator[Any]:
    """The engine app on the Ray unit's shared local Ray (tests/conftest.py)."""
    try:
        yield serve.run(build_engine_app(CONFIG), name=APP, route_prefix=None)
    finally:
        serve.delete(APP)
        for b in open_buses(CONFIG.bus, create=False):
            assert isinstance(b, RayEventBus)
            b.kill()
        serve.shutdown()


def test_vllm_replica_streams_and_publishes_events(app) -> None:
    events, loads = open_buses(CONFIG.bus, create=False)
    watcher = EngineWatcher(events, loads, CacheMapIngestor(CacheMap()))
    inst, _ = app.identity.remote().result()
    prompt = [5 + (i * 37) % 400 for i in range(160)]
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = list(app.options(stream=True).generate.remote(EngineRequest("d-1", prompt, sp)))
    assert outs[-1].finished and outs[-1].usage.completion_tokens == 3
    again = list(app.options(stream=True).generate.remote(EngineRequest("d-2", prompt, sp)))
    assert again[-1].usage.cached_tokens == 160 - 32  # the last full block is recomputed

    hashes = BlockHasher(CONFIG.engine.model_name, 32)(prompt)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        watcher.pump(time.time())
        if inst in watcher.ingestor.map.match(hashes) and inst in watcher.loads:
            break
        time.sleep(0.1)
    assert watcher.ingestor.map.match(hashes)[inst].gpu_blocks == 5
    assert watcher.loads[inst].instance_id == inst
    app.check_health.remote().result()

    serve.delete(APP)
    watcher.consumer.pump()
    assert inst not in watcher.ingestor.map.instances()
