"""KvRequestRouter as Serve ships it: the class is cloudpickled by value into the caller, so it
must still find the RouterState the ingress registered, and it must keep requests on the
placed replica through Serve's first retries."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from ray.serve.config import RequestRouterConfig

from engines.base import EngineRequest, RoutedRequest
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
