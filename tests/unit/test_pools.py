"""Engine pools in the routing core: per-pool membership, roles, pools named by load samples."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import NamedTuple

import pytest

from engines.base import EngineRequest, LoadSnapshot, RoutedRequest
from engines.bus.base import InProcessBus
from engines.bus.forwarder import encode_load
from engines.profile import LatencyProfile
from router.core import RouterCore
from router.pools import Pool, check_pools
from router.serve_router import KvRequestRouter
from router.settings import RouterSettings
from router.state import RouterState, register_state, unregister_state


class ReplicaId(NamedTuple):
    unique_id: str


PROFILE = LatencyProfile.load("cpu-tiny-llama")
PD = (
    Pool("prefill", "prefill", 32, PROFILE, 100),
    Pool("decode", "decode", 32, PROFILE, 200),
)


def test_membership_is_synced_per_pool() -> None:
    core = RouterCore(pools=PD)
    core.sync_instances(["p1", "p2"], "prefill")
    core.sync_instances(["d1"], "decode")
    assert core.members() == ["p1", "p2", "d1"]
    core.sync_instances(["d2"], "decode")  # the decode pool's report drops only d1
    assert core.members(["prefill"]) == ["p1", "p2"]
    assert core.members(["decode"]) == ["d2"]
    assert core.pool_of("p1") is PD[0] and core.pool_of("d2") is PD[1]
    assert core.pool_of("d1") is None
    assert core.disaggregated
    views = {v.instance_id: v for v in core.load.views(0.0)}
    assert views["p1"].kv_capacity_blocks == 100 and views["d2"].kv_capacity_blocks == 200
    with pytest.raises(ValueError, match="unknown pool 'nope'"):
        core.sync_instances(["x"], "nope")


def test_a_single_pool_core_is_what_it_was() -> None:
    core = RouterCore(RouterSettings("least_loaded", kv_capacity_blocks=7), PROFILE)
    core.sync_instances(["a", "b"])
    assert core.members() == core.members(["both"]) == ["a", "b"]
    assert not core.disaggregated and core.block_size == 16


def test_an_instance_learned_from_the_bus_goes_to_the_pool_its_sample_names() -> None:
    kv, loads = InProcessBus(), InProcessBus()
    core = RouterCore(pools=PD, kv_bus=kv, load_bus=loads)
    loads.publish(encode_load(LoadSnapshot("d9", 1.0, 0, 1, 0.1, 0.0, 0, pool="decode")))
    loads.publish(encode_load(LoadSnapshot("x9", 1.0, 0, 1, 0.1, 0.0, 0, pool="gone")))
    loads.publish(encode_load(LoadSnapshot("y9", 1.0, 0, 1, 0.1, 0.0, 0)))  # an old engine
    core.pump(1.0)
    assert core.members(["decode"]) == ["d9"]
    assert core.members(["prefill"]) == ["x9", "y9"]  # unknown or no pool: the first pool


@pytest.mark.parametrize(
    ("pools", "error"),
    [
        ((), "at least one"),
        ((Pool("a", "both", 16), Pool("a", "both", 16)), "used twice"),
        ((Pool("a", "both", 16), Pool("b", "both", 32)), "same block_size"),
        ((Pool("p", "prefill", 16),), "needs a decode"),
        ((Pool("d", "decode", 16),), "needs a prefill"),
    ],
)
def test_pools_that_cannot_serve_are_refused(pools: tuple[Pool, ...], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        check_pools(pools)
    with pytest.raises(ValueError, match="role must be"):
        Pool("x", "middle", 16)  # type: ignore[arg-type]


def test_each_pools_request_router_reports_its_own_replicas() -> None:
    """Serve calls each pool's request router with that pool's replicas; a request it must place
    itself (no target yet) first syncs the pool's replica set into the shared state."""
    state = RouterState(pools=PD)
    register_state("app-pools", state)
    try:
        for name, ids in (("prefill", ["p1", "p2"]), ("decode", ["d1", "d2"])):
            router = object.__new__(KvRequestRouter)  # Serve's constructor needs a deployment
            router.initialize_state(state_key="app-pools", pool=name)
            replicas = [SimpleNamespace(replica_id=ReplicaId(i)) for i in ids]
            router._replicas = {r.replica_id: r for r in replicas}
            routed = RoutedRequest(EngineRequest(f"r-{name}", [1, 2, 3]), "abc")
            meta = SimpleNamespace(internal_request_id=f"r-{name}")
            pending = SimpleNamespace(args=(routed,), kwargs={}, metadata=meta)
            chosen = asyncio.run(router.choose_replicas(replicas, pending))
            assert chosen[0][0].replica_id.unique_id in ids
            assert routed.target_instance in ids
        assert state.core.members(["prefill"]) == ["p1", "p2"]
        assert state.core.members(["decode"]) == ["d1", "d2"]
        assert state.pool_name("d2") == "decode" and state.pool_name(None) == "prefill"
    finally:
        unregister_state("app-pools", state)
