"""Two sim-engine replicas under Ray Serve: distinct instance ids, KV events and load samples on
the Ray bus reaching a cache map, a killed replica dropped from the map, and ``InstanceGone`` on a
clean shutdown."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ray.serve")

import ray
from ray import serve

from cachemap.hashing import BlockHasher, Tier
from cachemap.ingest import CacheMapIngestor
from cachemap.map import CacheMap
from engines.base import EngineRequest, SamplingParams
from engines.bus.liveness import EngineWatcher
from engines.bus.ray_bus import RayEventBus
from engines.config import EngineDeploymentConfig
from engines.deployment import build_engine_app, open_buses
from tests.support import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.ray]

APP = "kvroute-test-engines"
BLOCK = 32
STALE_S = 5.0
CONFIG = EngineDeploymentConfig(
    name="engine",
    engine={"kind": "sim", "served_model_name": "sim-model", "block_size": BLOCK},
    instances=2,
    resources={"num_cpus": 0.5},
    bus={"name": "kvroute-test-deploy"},
    health_check_period_s=1.0,
)


@pytest.fixture(scope="module")
def app() -> Iterator[Any]:
    """The engine app on the Ray unit's shared local Ray (tests/conftest.py)."""
    handle = serve.run(build_engine_app(CONFIG), name=APP, route_prefix=None)
    try:
        yield handle
    finally:
        serve.delete(APP)
        events, loads = open_buses(CONFIG.bus, create=False)
        for b in (events, loads):
            assert isinstance(b, RayEventBus)
            b.kill()
        serve.shutdown()


@pytest.fixture(scope="module")
def watcher(app) -> EngineWatcher:
    events, loads = open_buses(CONFIG.bus, create=False)
    assert isinstance(events, RayEventBus)
    return EngineWatcher(
        events,
        loads,
        CacheMapIngestor(CacheMap()),
        # Generous: two replicas, Ray and pytest share two cores in CI, and a replica starved of
        # CPU for a couple of seconds must not count as dead here (CI flaked at 1.5 s).
        timeout_s=STALE_S,
        request_resync=events.request_resync,
    )


def _replicas(handle: Any, n: int = 2) -> dict[str, str]:
    """instance id -> actor name, asking until ``n`` distinct replicas answered."""
    found: dict[str, str] = {}
    for _ in range(200):
        inst, actor = handle.identity.remote().result()
        found[inst] = actor
        if len(found) >= n:
            break
    return found


def _prompt(i: int, n: int = 4 * BLOCK) -> list[int]:
    return [1 + (i * 977 + j * 13) % 30_000 for j in range(n)]


def _populate(app: Any, watcher: EngineWatcher, ids: set[str], first: int) -> set[str]:
    """Send distinct prompts until every instance in ``ids`` holds one; each prompt must show up
    in the map on exactly one instance, with all its blocks. Returns the holders seen."""
    hasher = BlockHasher(CONFIG.engine.model_name, BLOCK)
    holders: set[str] = set()
    for i in range(first, first + 40):  # Serve spreads requests at random
        prompt = _prompt(i)
        outs = list(
            app.options(stream=True).generate.remote(
                EngineRequest(f"dep-{i}", prompt, SamplingParams(max_tokens=2))
            )
        )
        assert outs[-1].finished and outs[-1].usage.prompt_tokens == len(prompt)
        hashes = hasher(prompt)

        def matched(hashes: list[int] = hashes) -> bool:
            watcher.pump(time.time())
            return len(watcher.ingestor.map.match(hashes)) == 1

        assert wait_for(matched, 15.0), f"request {i}: {dict(watcher.ingestor.map.match(hashes))}"
        ((inst, m),) = watcher.ingestor.map.match(hashes).items()
        assert m.gpu_blocks == len(hashes) == 4
        holders.add(inst)
        if holders >= ids:
            break
    return holders


def test_a_request_nobody_streams_is_delivered_whole(app) -> None:
    """``generate_whole`` (a unary call, what the ingress makes for ``stream=False``): one output
    with every token, the instance and the usage; the same request streamed arrives token by
    token with the same tokens."""
    sampling = SamplingParams(max_tokens=6, seed=3, ignore_eos=True)
    stream = app.options(stream=True).generate
    streamed = list(stream.remote(EngineRequest("whole-a", _prompt(900), sampling)))
    req = EngineRequest("whole-b", _prompt(900), sampling, stream=False)
    out = app.generate_whole.remote(req).result(timeout_s=60)
    assert len(streamed) > 1
    assert out.finished and out.instance_id is not None and out.usage.completion_tokens == 6
    assert out.token_ids == [t for o in streamed for t in o.token_ids]


def test_events_from_both_replicas_land_in_the_map(app, watcher) -> None:
    ids = set(_replicas(app))
    assert len(ids) == 2
    assert _populate(app, watcher, ids, 0) == ids
    assert wait_for(lambda: (watcher.pump(time.time()), set(watcher.live()) == ids)[1], 15.0)
    assert {s.instance_id for s in watcher.loads.values()} == ids
    assert watcher.ingestor.gaps == 0


def test_resync_request_reaches_the_replica(app, watcher) -> None:
    inst = next(iter(_replicas(app)))
    before = set(watcher.ingestor.map.resident(inst, Tier.GPU))
    assert before, "the previous test left blocks on every replica"
    bus = watcher.consumer.bus
    assert isinstance(bus, RayEventBus)
    start = bus.end()
    bus.request_resync(inst)
    assert wait_for(lambda: bus.end() > start, 5.0)  # the forwarder polls about once a second
    watcher.pump(time.time())
    assert set(watcher.ingestor.map.resident(inst, Tier.GPU)) == before


def test_killed_replica_is_dropped_from_the_map(app, watcher) -> None:
    replicas = _replicas(app)
    victim, survivor = sorted(replicas)
    watcher.pump(time.time())
    assert watcher.ingestor.map.count(victim, Tier.GPU) > 0
    assert watcher.ingestor.map.count(survivor, Tier.GPU) > 0
    ray.kill(ray.get_actor(replicas[victim], namespace="serve"), no_restart=True)
    assert wait_for(lambda: victim in watcher.pump(time.time()), STALE_S + 15.0)
    assert victim not in watcher.ingestor.map.instances()
    assert victim not in watcher.live()
    assert watcher.ingestor.map.count(survivor, Tier.GPU) > 0
    # Serve replaces the replica; the new one shows up with a new instance id.
    assert wait_for(lambda: (watcher.pump(time.time()), len(watcher.live()) == 2)[1], 60.0)
    assert victim not in watcher.live()


def test_clean_shutdown_publishes_instance_gone(app, watcher) -> None:
    live = set(_replicas(app))
    assert _populate(app, watcher, live, 100) >= live
    serve.delete(APP)
    watcher.consumer.pump()  # events only: no liveness timeout involved
    assert not set(watcher.ingestor.map.instances()) & live
