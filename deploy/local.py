"""A single-process kvroute: engines, forwarders, in-process buses, router state and the
OpenAI app in one asyncio process, no Ray. The same pieces as the Serve deployment, wired
directly; used by the router-overhead benchmark and HTTP-layer tests, and fine for one box."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from fastapi import FastAPI

from cachemap.ingest import EngineEventTranslator
from engines.base import Engine, LoadSnapshot
from engines.bus.base import EventBus, InProcessBus
from engines.bus.forwarder import KvEventForwarder
from engines.profile import LatencyProfile
from router.dispatch import Dispatcher
from router.ingress import build_app
from router.ingress_config import IngressConfig
from router.local_client import LocalEngineClient
from router.pd import PdPlanner
from router.placement import Scorer
from router.pools import Pool
from router.recorder import PlacementRecorder
from router.settings import DEFAULTS, RouterSettings
from router.state import RouterState
from router.tokenizer import PromptTokenizer


class LocalStack:
    def __init__(
        self,
        engines: Mapping[str, Engine],
        *,
        model: str,
        block_size: int,
        max_model_len: int,
        latency: LatencyProfile,
        tokenizer: PromptTokenizer,
        settings: RouterSettings = DEFAULTS,
        scorer: Scorer | None = None,
        recorder: PlacementRecorder | None = None,
        buses: tuple[EventBus, EventBus] | None = None,
        forward: bool = True,
        pools: Sequence[Pool] | None = None,
        pool_of: Mapping[str, str] | None = None,
        planner: PdPlanner | None = None,
        **ingress: Any,
    ) -> None:
        """``ingress``: ``IngressConfig`` fields past model, context and block size (api_keys,
        admin_keys, pins, session_hints, rate_limit ...). ``settings``: the router's, at this
        stack's ``block_size`` (its ``event_stride`` is the forwarders' too); ``scorer``: one
        built by the caller, in place of the one they name. ``buses``: the (KV-event, load)
        buses (default: in-process ones). ``forward=False``: another stack runs these engines
        and their forwarders on ``buses``, and this one is one more router replica over them.
        ``pools``/``pool_of``/``planner``: engine pools (``router.pools``), each engine's pool
        by id (default: the first pool), and the prefill/decode planner they need."""
        settings = replace(settings, block_size=block_size)
        self.engines = dict(engines)
        self.pool_of = dict(pool_of or {})
        self.model, self.block_size, self.event_stride = model, block_size, settings.event_stride
        self.kv_bus, self.load_bus = buses or (InProcessBus(), InProcessBus())
        self.forward = forward
        self.state = RouterState(
            settings,
            latency,
            scorer=scorer,
            kv_bus=self.kv_bus,
            load_bus=self.load_bus,
            recorder=recorder,
            pools=pools,
            planner=planner,
        )
        self.client = LocalEngineClient(self.engines)
        self.dispatcher = Dispatcher(self.state, self.client)
        self.forwarders: list[KvEventForwarder] = []
        self.tokenizer = tokenizer  # the ingress's
        self.app: FastAPI = build_app(
            IngressConfig(model, max_model_len, block_size, **ingress),
            self.dispatcher,
            tokenizer,
        )

    async def start(self) -> None:
        take = getattr(self.kv_bus, "take_resync", None)  # buses that carry resync requests
        for iid, engine in self.engines.items() if self.forward else ():
            await engine.start()
            endpoint = engine.kv_events_endpoint
            if endpoint is None:
                raise ValueError(f"engine {iid}: KV events must be on")
            fwd = KvEventForwarder(
                EngineEventTranslator(iid, self.model, self.block_size, stride=self.event_stride),
                self.kv_bus,
                endpoint,
                replay_endpoint=engine.kv_events_replay_endpoint,
                load_bus=self.load_bus,
                load_fn=partial(_pooled_load, engine, self.pool_of.get(iid, "")),
                report_endpoint=engine.load_report_endpoint,
                resync_poll=partial(take, iid) if take is not None else None,
            )
            fwd.start()
            self.forwarders.append(fwd)
        pools = list(self.state.pools)  # the default pool first
        for pool in pools:
            default = pool == pools[0]
            members = [
                i for i in self.engines if self.pool_of.get(i, pool if default else "") == pool
            ]
            self.state.sync_instances(members, pool)
        self.state.start()

    async def stop(self) -> None:
        self.state.stop()
        for fwd in self.forwarders:
            fwd.stop(gone=True)
        for engine in self.engines.values() if self.forward else ():
            await engine.stop()


def _pooled_load(engine: Engine, pool: str) -> LoadSnapshot:
    """``engine``'s load sample naming its pool (as ``EngineDeployment.load`` does)."""
    snap = engine.load()
    snap.pool = pool
    return snap
