"""KvRequestRouter as Serve ships it: the class is cloudpickled by value into the caller, so it
must still find the RouterState the ingress registered, and it must keep requests on the
placed replica through Serve's first retries."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve.config import RequestRouterConfig

from engines.base import EngineRequest, KvCommand, RoutedRequest
from router.serve_router import KvRequestRouter
from router.state import RouterState, register_state, unregister_state


def shipped_router(key: str, **kwargs: object) -> KvRequestRouter:
    cfg = RequestRouterConfig(
        request_router_class="router.serve_router:KvRequestRouter",
        request_router_kwargs={"state_key": key, **kwargs},
    )
    cls = cfg.get_request_router_class()
    router = object.__new__(cls)  # Serve's constructor needs a live deployment
    router.initialize_state(**cfg.request_router_kwargs)
    return router


def replica(uid: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid))


def pending(target: str, rid: str = "req-1") -> SimpleNamespace:
    routed = RoutedRequest(EngineRequest(rid, [1, 2, 3]), "abc", target_instance=target)
    meta = SimpleNamespace(internal_request_id=rid)
    return SimpleNamespace(args=(routed,), kwargs={}, metadata=meta)


def test_the_by_value_copy_finds_the_registered_state() -> None:
    state = RouterState()
    register_state("app-x", state)
    try:
        assert shipped_router("app-x").state is state
    finally:
        unregister_state("app-x", state)
    assert shipped_router("app-x").state is None


def test_the_placed_replica_alone_for_the_first_attempts_then_ranked() -> None:
    state = RouterState()
    register_state("app-y", state)
    try:
        router = shipped_router("app-y", sticky_attempts=2)
        a, b = replica("a"), replica("b")
        req = pending("b")
        calls = [asyncio.run(router.choose_replicas([a, b], req)) for _ in range(3)]
    finally:
        unregister_state("app-y", state)
    assert calls[0] == [[b]] and calls[1] == [[b]]
    assert calls[2] == [[b], [a]]


def test_a_kv_command_goes_to_its_target_alone_on_every_attempt() -> None:
    """An operator's order never moves to another replica; one for a replica that is not a
    candidate goes anywhere, and that replica refuses it (run_kv_command)."""
    state = RouterState()
    register_state("app-z", state)
    try:
        router = shipped_router("app-z", sticky_attempts=1)
        a, b = replica("a"), replica("b")
        meta = SimpleNamespace(internal_request_id="cmd-1")
        cmd = SimpleNamespace(args=(KvCommand("clear", "b"),), kwargs={}, metadata=meta)
        calls = [asyncio.run(router.choose_replicas([a, b], cmd)) for _ in range(3)]
        gone = SimpleNamespace(args=(KvCommand("clear", "c"),), kwargs={}, metadata=meta)
        elsewhere = asyncio.run(router.choose_replicas([a, b], gone))
    finally:
        unregister_state("app-z", state)
    assert calls == [[[b]]] * 3
    assert elsewhere == [[a, b]]


def test_an_engine_refuses_a_command_meant_for_another() -> None:
    from engines.base import EngineError, run_kv_command
    from engines.sim.engine import SimEngine

    engine = SimEngine("x", kv_events_endpoint=None)
    with pytest.raises(EngineError, match="delivered to 'x'"):
        asyncio.run(run_kv_command(engine, "x", KvCommand("clear", "y")))
    assert asyncio.run(run_kv_command(engine, "x", KvCommand("clear", "x"))) == {
        "instance": "x",
        "cleared": True,
    }
