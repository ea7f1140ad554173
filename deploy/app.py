"""Composition root: the Serve application of ``kvroute serve`` (ingress + engine pools).

Each engine pool is a Serve deployment carrying the request router (kvroute's
``KvRequestRouter``, told its pool; or Ray's ``PrefixCacheAffinityRouter`` as a peer, one pool
only); each ingress replica runs the OpenAI API, keeps its own cache map fed by the
deployment's event bus, and shares it with the request routers in its process.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application, Deployment

from deploy.autoscaling import (
    DecisionPoller,
    kill_decision_log,
    open_decision_log,
    policy_kwargs,
    serve_autoscaling_config,
)
from deploy.config import (
    RAY_PREFIX_ROUTER,
    ServeConfig,
    admin_keys,
    api_keys,
    placement_recorder,
)
from engines import gc_tuning
from engines.deployment import build_engine_app, open_buses
from engines.pool.link import PoolLink
from engines.tiny_model import resolve_model
from router.dispatch import Dispatcher
from router.ingress import build_app
from router.ingress_config import IngressConfig
from router.pd import PdPlanner, TransferModel
from router.pools import Pool
from router.serve_client import ServeEngineClient
from router.settings import RouterSettings
from router.state import RouterState, register_state, unregister_state
from router.tokenizer import PromptTokenizer
from router.tracing import setup_tracing

log = logging.getLogger(__name__)


def _tokenizer_path(cfg: ServeConfig) -> str:
    return cfg.tokenizer or str(resolve_model(cfg.engine.model))


def pd_planner(cfg: ServeConfig, settings: RouterSettings) -> PdPlanner | None:
    """The planner of a deployment with prefill or decode pools (None: colocated only); the
    KV it prices per token is the decode pool's model's."""
    pools = cfg.engine_pools
    if all(p.role == "both" for p in pools):
        return None
    decode = next(p for p in pools if p.role != "prefill")
    r = cfg.router
    transfer = TransferModel(
        cfg.pool_profile(decode).kv_bytes_per_token,
        r.pd_transfer_gbps,
        r.pd_transfer_latency_ms / 1e3,
    )
    return settings.pd_planner(transfer)


def router_pools(cfg: ServeConfig) -> list[Pool]:
    """What the router knows of each engine pool: role, block size, cost model, capacity."""
    out = []
    for p in cfg.engine_pools:
        profile = cfg.pool_profile(p)
        ecfg = p.engine
        capacity = ecfg.kv_blocks or profile.kv_capacity_tokens // ecfg.block_size
        out.append(Pool(p.name, p.role, ecfg.block_size, profile, capacity))
    return out


@serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress()
class IngressDeployment:
    def __init__(self, engines: dict[str, Any], config: dict[str, Any]) -> None:
        """``engines``: each pool's deployment handle, by pool name."""
        gc_tuning.tune_for_serving()
        self.cfg = cfg = ServeConfig.model_validate(config)
        setup_tracing()
        kv_bus, load_bus = open_buses(cfg.deployment_bus)
        pre_place = cfg.router.scorer != RAY_PREFIX_ROUTER
        settings = cfg.router_settings()
        scorer = settings.create_scorer()
        ctx = serve.get_replica_context()
        # which ingress replica this is, of how many (kv_ttft's ``replica_spread`` reads it)
        replicas = max(ctx.world_size or 1, 1)
        scorer.as_replica(getattr(ctx.rank, "rank", 0) % replicas, replicas)
        self.state = RouterState(
            settings,
            scorer=scorer,
            pools=router_pools(cfg),
            planner=pd_planner(cfg, settings),
            kv_bus=kv_bus,
            load_bus=load_bus,
            recorder=placement_recorder(cfg.router),
            kv_pool=PoolLink(cfg.pool.link_gbps, cfg.pool.link_latency_ms)
            if cfg.pool.enabled
            else None,
        )
        register_state(cfg.app_name, self.state)
        self.state.start()
        self.tokenizer = PromptTokenizer(_tokenizer_path(cfg))
        client = ServeEngineClient(engines, self.state.pool_name)
        self.dispatcher = Dispatcher(self.state, client, pre_place=pre_place)
        self.decisions = DecisionPoller(cfg.app_name).start() if cfg.autoscaling else None

    def __serve_build_asgi_app__(self) -> Any:
        ecfg = self.cfg.engine
        return build_app(
            IngressConfig(
                model=ecfg.model_name,
                max_model_len=ecfg.max_model_len,
                block_size=ecfg.block_size,
                api_keys=api_keys(self.cfg.router),
                admin_keys=admin_keys(self.cfg.router),
                metrics_admin=self.cfg.router.metrics_admin,
                open_service_routes=self.cfg.router.open_service_routes,
                client_aborts=(TaskCancelledError,),
                router_id=serve.get_replica_context().replica_id.unique_id,
                rate_limit=self.cfg.router.rate_limit_rps,
                rate_burst=self.cfg.router.rate_limit_burst,
                pins=any(p.engine.cpu_tier is not None for p in self.cfg.engine_pools),
                engine_kind=ecfg.kind,
                max_body_bytes=self.cfg.router.max_body_bytes,
                autoscale=self.decisions,
            ),
            self.dispatcher,
            self.tokenizer,
        )

    def __del__(self) -> None:
        if self.decisions is not None:
            self.decisions.stop()
        unregister_state(self.cfg.app_name, self.state)
        self.state.stop()


def build_serve_app(cfg: ServeConfig) -> Application:
    engines = {}
    for pool in cfg.engine_pools:
        if cfg.router.scorer == RAY_PREFIX_ROUTER:
            rr = RequestRouterConfig(
                # NOTE: Ray types RequestRouterConfig.__init__(**kwargs: dict[str, Any])
                request_router_class="ray.serve.llm.request_router:PrefixCacheAffinityRouter"  # type: ignore[arg-type]
            )
        else:
            rr = RequestRouterConfig(
                request_router_class="router.serve_router:KvRequestRouter",  # type: ignore[arg-type]
                request_router_kwargs={"state_key": cfg.app_name, "pool": pool.name},
            )
        scaling = cfg.autoscaling.get(pool.name)
        if scaling is None:
            engines[pool.name] = build_engine_app(pool, request_router_config=rr)
            continue
        ecfg = pool.engine
        limits = {
            "max_num_batched_tokens": ecfg.max_num_batched_tokens,
            "long_prefill_token_threshold": ecfg.long_prefill_token_threshold,
        }
        profile = cfg.pool_profile_name(pool)
        kwargs = policy_kwargs(cfg.app_name, pool.name, scaling, profile, limits)
        engines[pool.name] = build_engine_app(
            pool,
            request_router_config=rr,
            autoscaling_config=serve_autoscaling_config(scaling, pool.instances, kwargs),
            graceful_shutdown_timeout_s=scaling.drain_timeout_s,
        )
    if cfg.autoscaling:
        open_decision_log(cfg.app_name)  # the policies write it, the ingress replicas read it
    router = cfg.router
    # NOTE: mypy does not apply class decorators: the class is the Deployment
    # @serve.deployment made of it
    deployment = cast(Deployment, IngressDeployment)
    return deployment.options(
        num_replicas=router.replicas,
        health_check_period_s=router.health_check_period_s,
        # NOTE: Serve's default is 5 requests per replica; past them the proxy queues and backs
        # off where admission cannot see: 32 concurrent clients got 16 req/s where 8 got 138.
        # The replica takes what admission may hold (running + waiting) and answers the rest
        # with its own 429s.
        max_ongoing_requests=router.max_in_flight + router.max_queue,
    ).bind(engines, cfg.to_dict())


def wait_until_ready(base_url: str, instances: int, timeout_s: float = 300.0) -> None:
    """Block until the ingress at ``base_url`` is ready (``/ready`` answers 200: its buses are
    read) with ``instances`` engines routable (healthy, their load samples arrived), or raise
    ``TimeoutError``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = httpx.get(f"{base_url}/ready", timeout=10)
            if r.status_code == 200 and r.json().get("routable_instances", 0) >= instances:
                return
        except (httpx.HTTPError, ValueError):
            pass  # the proxy may not route to the app yet (and answers it in plain text)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url}: {instances} engines did not report in {timeout_s} s")
        time.sleep(0.2)


def delete_app(cfg: ServeConfig) -> None:
    """Delete the Serve app, its autoscaling decision log and the event-bus hubs its engines
    published to."""
    serve.delete(cfg.app_name)
    if cfg.autoscaling:
        kill_decision_log(cfg.app_name)
    for bus in open_buses(cfg.deployment_bus, create=False):
        kill = getattr(bus, "kill", None)  # Ray-actor hubs; Redis streams outlive the app
        if kill is not None:
            kill()
