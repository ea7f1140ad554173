"""``kvroute serve`` configuration (pydantic; YAML files validated against it, see
``deploy/*.yaml``). Every error names the field and the valid range."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from deploy.pool_config import PoolConfig
from deploy.proxy_guard import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from engines.base import DEFAULT_TRANSFER_GBPS, DEFAULT_TRANSFER_LATENCY_MS
from engines.config import (
    BusConfig,
    EngineConfig,
    EngineDeploymentConfig,
    PoolEndpoint,
    StrictModel,
)
from engines.profile import DEFAULT_PROFILE, LatencyProfile
from router.autoscale import (
    DEFAULT_COLD_START_S,
    DEFAULT_INTERVAL_S,
    POLICIES,
    Slo,
    create_policy,
)
from router.keys import ApiKeys
from router.placement import create_scorer, scorer_names
from router.pools import Pool, check_pools
from router.recorder import JsonlRecorder
from router.settings import DEFAULTS, RouterSettings

RAY_PREFIX_ROUTER = "ray_prefix"  # Ray Serve's own PrefixCacheAffinityRouter, as a peer
ADMIN_KEY_ENV = "KVROUTE_ADMIN_KEY"
API_KEYS_ENV = "KVROUTE_API_KEYS"

# Ray Serve's throughput mode (Ray >= 2.55): replica-to-replica calls over gRPC instead of actor
# tasks, and user code and the handle's router on the replica's own event loop; the ingress hop
# to the engines is the gain (benchmarks/ingress_bench.py: kvroute 1.3x the req/s of Serve's
# defaults). Direct ingress (replicas serving HTTP themselves) is meant for HAProxy in front;
# with Serve's own proxy it gained nothing here and holds a replica open while it drains.
# Every process of the cluster reads these when it starts, so they go on ``ray start``
# (deploy/cluster*.yaml) or into the environment of the driver that starts a local Ray.
RAY_SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    # Serve's proxy reads it when it starts: kvroute's header checks and client deadlines
    PROXY_CALLBACK_ENV: PROXY_CALLBACK,
}


def apply_ray_serve_env() -> dict[str, str]:
    """Put ``RAY_SERVE_ENV`` into this process's environment where the operator set nothing
    (call it before ``ray`` is imported and a local Ray started); returns what is in force."""
    for key, value in RAY_SERVE_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in RAY_SERVE_ENV}


class RouterConfig(StrictModel):
    scorer: str = Field(
        DEFAULTS.scorer, description=f"placement: one of the scorers or {RAY_PREFIX_ROUTER!r}"
    )
    scorer_options: dict[str, Any] = Field(default_factory=dict)
    profile: str | None = Field(
        None,
        description="latency profile for TTFT estimates (name or JSON path); "
        "default: the sim engine's profile, or the shipped CPU profile",
    )
    slo_ttft_ms: float | None = Field(None, gt=0, description="reject (429) above this estimate")
    max_in_flight: int = Field(DEFAULTS.max_in_flight, ge=1)
    max_queue: int = Field(DEFAULTS.max_queue, ge=0)
    max_wait_s: float = Field(DEFAULTS.max_wait_s, gt=0)
    inflight_prompts: bool = Field(
        DEFAULTS.inflight_prompts,
        description="count the prompts this router sent that no KV event shows yet as cached "
        "where they went, on engines where more prefill waits than one step computes "
        "(router.inflight): on the routing suite it lowers the heavier load's TTFT on "
        "agentic, RAG-like and conversation traffic and leaves the lighter load's as it was",
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description="client API keys; prefer api_key_file or $KVROUTE_API_KEYS (comma-"
        "separated) in production, which count too: a config file is not a secret store",
    )
    api_key_file: str | None = Field(
        None,
        description="a file of client API keys, one per line: '<id> <secret>', or a bare "
        "'<secret>' (its id is its fingerprint); the id names the client in rate limits, and "
        "each key reads and writes its own cache namespace (key_namespaces)",
    )
    key_namespaces: dict[str, list[str]] = Field(
        default_factory=dict,
        description="cache namespaces shared by several API keys: namespace name -> key ids; "
        "every other key's KV is visible to it alone (a salt from its id, never its secret)",
    )
    open_service_routes: bool = Field(
        False,
        description="/metrics and /openapi.json answer without a key when API keys are set "
        "(they name the engines and their load); metrics_admin still applies",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="serve an address other than loopback (host) without client API keys: "
        "anyone who reaches it may use the engines; without it such a config is refused",
    )
    rate_limit_rps: float | None = Field(
        None, gt=0, description="requests/s per API key (per address without keys); None: none"
    )
    rate_limit_burst: int = Field(20, ge=1, description="requests a client may send at once")
    admin_key_file: str | None = Field(
        None,
        description="a file holding the KV control API's admin key(s), one per line; the keys "
        f"in ${ADMIN_KEY_ENV} (comma-separated) count too; neither: the API is off",
    )
    metrics_admin: bool = Field(
        False, description="/metrics answers only the admin keys (401 without, 403 with none set)"
    )
    bus_poll_s: float = Field(
        DEFAULTS.bus_poll_s,
        gt=0,
        le=1,
        description="the ingress reads KV events and load samples this often",
    )
    replicas: int = Field(1, ge=1, le=256, description="ingress replicas")
    health_check_period_s: float = Field(
        5.0,
        gt=0,
        description="Serve checks each ingress replica this often (a dead one is "
        "replaced after the check that finds it)",
    )
    max_body_bytes: int = Field(4 << 20, ge=1024)
    pd_transfer_gbps: float = Field(
        DEFAULT_TRANSFER_GBPS,
        gt=0,
        description="prefill/decode pools: KV hand-over bandwidth the router prices, GB/s",
    )
    pd_transfer_latency_ms: float = Field(
        DEFAULT_TRANSFER_LATENCY_MS,
        ge=0,
        description="prefill/decode pools: fixed cost of one KV hand-over, ms",
    )
    pd_max_local_prefill_tokens: int = Field(
        DEFAULTS.pd_max_local_prefill_tokens,
        ge=0,
        description="prefill/decode pools: a request with at most this many uncached prompt "
        "tokens runs whole on a decode engine when the TTFT estimate favours it (0: never)",
    )
    pd_overload_factor: float | None = Field(
        DEFAULTS.pd_overload_factor,
        ge=1,
        description="prefill/decode pools: a request whose split is priced above this many "
        "times its colocated TTFT estimate runs whole on a decode engine (None: never)",
    )
    placement_log: str | None = Field(
        None,
        description="append every placement (candidates, load, cached blocks, choice) as a JSON "
        "line to this file; default: $KVROUTE_PLACEMENT_LOG in the ingress's environment",
    )

    @field_validator("scorer")
    @classmethod
    def _known(cls, v: str) -> str:
        valid = list(dict.fromkeys([*scorer_names(), RAY_PREFIX_ROUTER]))
        if v not in valid and ":" not in v:
            raise ValueError(f"unknown scorer {v!r}; valid: {', '.join(valid)}")
        return v

    @model_validator(mode="after")
    def _options_fit(self) -> RouterConfig:
        if self.scorer_options:
            if self.scorer == RAY_PREFIX_ROUTER:
                raise ValueError(f"scorer_options: {RAY_PREFIX_ROUTER!r} takes none")
            try:
                create_scorer(self.scorer, **self.scorer_options)
            except (TypeError, ValueError) as e:
                raise ValueError(f"scorer_options: not accepted by {self.scorer!r}: {e}") from e
        return self


def _keys(env: str, path: str | None, field: str) -> list[str]:
    keys = [k.strip() for k in os.environ.get(env, "").split(",")]
    if path:
        try:
            keys += [k.strip() for k in Path(path).read_text().splitlines()]
        except OSError as e:
            raise ValueError(f"router.{field}: cannot read it: {e}") from None
    return [k for k in keys if k]


def admin_keys(cfg: RouterConfig) -> frozenset[str]:
    """The admin keys from ``cfg.admin_key_file`` and ``$KVROUTE_ADMIN_KEY``, read where the
    ingress runs (never a YAML value: a config file is not a secret store)."""
    return frozenset(_keys(ADMIN_KEY_ENV, cfg.admin_key_file, "admin_key_file"))


def api_keys(cfg: RouterConfig) -> ApiKeys:
    """The client API keys: ``cfg.api_keys``, ``cfg.api_key_file`` and ``$KVROUTE_API_KEYS``
    (none: the API is open), each ``<secret>`` or ``<id> <secret>``, in the cache namespaces
    ``cfg.key_namespaces`` names (``router.keys``)."""
    entries = [*cfg.api_keys, *_keys(API_KEYS_ENV, cfg.api_key_file, "api_key_file")]
    try:
        return ApiKeys(entries, cfg.key_namespaces)
    except ValueError as e:
        raise ValueError(f"router.api_key_file / router.key_namespaces: {e}") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def placement_recorder(cfg: RouterConfig) -> JsonlRecorder | None:
    """The placement log ``cfg`` asks for, or ``$KVROUTE_PLACEMENT_LOG``, or none."""
    path = cfg.placement_log or os.environ.get("KVROUTE_PLACEMENT_LOG")
    return JsonlRecorder(path) if path else None


class PoolAutoscaling(StrictModel):
    """Online autoscaling of one engine pool (``autoscaling.<pool name>``): Serve's controller
    runs kvroute's autoscaling core (``router.autoscale``) every ``interval_s`` on what the
    pool's replicas report (``deploy.autoscaling``), within [min_replicas, max_replicas]; the
    pool starts with its ``instances``, brought into that range."""

    policy: str = Field(
        "kvroute",
        description=f"the core's policy spec, NAME or NAME@key=value+...; NAME one of "
        f"{', '.join(POLICIES)}",
    )
    min_replicas: int = Field(1, ge=1, le=1024)
    max_replicas: int = Field(..., ge=1, le=1024)
    interval_s: float = Field(DEFAULT_INTERVAL_S, gt=0, le=600, description="between decisions")
    metrics_interval_s: float = Field(
        2.0, gt=0, le=60, description="each replica reports its load and counters this often"
    )
    slo_ttft_ms: float = Field(2000.0, gt=0, description="the TTFT SLO the policy plans for")
    slo_tpot_ms: float | None = Field(None, gt=0, description="the TPOT SLO (None: none)")
    attainment: float = Field(0.99, gt=0, le=1, description="fraction of requests within both")
    cold_start_s: float = Field(
        DEFAULT_COLD_START_S,
        ge=0,
        description="seconds from a scale-up decision to the new engine serving (node start, "
        "model load), which the policy forecasts across",
    )
    drain_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a replica scaled down finishes its requests within this long (Serve's "
        "graceful_shutdown_timeout_s) before it is stopped",
    )

    @model_validator(mode="after")
    def _fits(self) -> PoolAutoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas: must be >= min_replicas ({self.min_replicas}), "
                f"got {self.max_replicas}"
            )
        if self.interval_s < self.metrics_interval_s:
            raise ValueError(
                f"interval_s: must be >= metrics_interval_s ({self.metrics_interval_s}): a "
                f"decision sooner than the replicas' next report sees nothing new, got "
                f"{self.interval_s}"
            )
        try:
            create_policy(self.policy, profile=None, slo=self.slo, cold_start_s=self.cold_start_s)
        except ValueError as e:
            raise ValueError(f"policy: {str(e).removeprefix('--autoscale').lstrip(': ')}") from None
        return self

    @property
    def slo(self) -> Slo:
        tpot = None if self.slo_tpot_ms is None else self.slo_tpot_ms / 1e3
        return Slo(self.slo_ttft_ms / 1e3, tpot, self.attainment)

    def initial_replicas(self, instances: int) -> int:
        return min(self.max_replicas, max(self.min_replicas, instances))


class ServeConfig(StrictModel):
    """A deployment: engine pools, the event bus they share, and the router (ingress).

    One colocated pool is ``engines``; several (``router.pools``: e.g. a prefill and a decode
    pool) are ``pools``, which replaces it. The bus belongs to the deployment: ``bus`` (a
    single ``engines`` pool may still name it as ``engines.bus``)."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    app_name: str = Field("kvroute", min_length=1)
    engines: EngineDeploymentConfig = Field(
        default_factory=lambda: EngineDeploymentConfig(instances=2),
        description="the engine pool of a colocated deployment (role 'both')",
    )
    pools: list[EngineDeploymentConfig] = Field(
        default_factory=list,
        description="the engine pools, each its own Serve deployment with a distinct name and "
        "a role; replaces 'engines'",
    )
    bus: BusConfig | None = Field(
        None, description="the event bus of every pool; default: engines.bus, or a Ray bus"
    )
    router: RouterConfig = Field(default_factory=RouterConfig)
    autoscaling: dict[str, PoolAutoscaling] = Field(
        default_factory=dict,
        description="pools that Serve autoscales, by pool name (the others keep their "
        "instances); see deploy/autoscaling.py",
    )
    tokenizer: str | None = Field(None, description="HF tokenizer dir; default: the model's")
    pool: PoolConfig = Field(
        default_factory=PoolConfig, description="the cluster KV pool (docs/pool.md)"
    )

    @model_validator(mode="after")
    def _keys_off_loopback(self) -> ServeConfig:
        """A host other than loopback (``0.0.0.0``, a private address) takes client API keys
        (``router.api_key_file`` or ``router.api_keys``; ``$KVROUTE_API_KEYS`` alone does not
        count: the config must say so where it is read) unless
        ``router.allow_unauthenticated`` says it is meant to be open."""
        r = self.router
        if not (is_loopback(self.host) or r.api_keys or r.api_key_file or r.allow_unauthenticated):
            raise ValueError(
                f"router.api_key_file: host {self.host!r} is not loopback, so clients need API "
                "keys: set router.api_key_file (or router.api_keys), or "
                "router.allow_unauthenticated: true to serve it open"
            )
        return self

    @model_validator(mode="after")
    def _pools_fit(self) -> ServeConfig:
        if self.pools:
            if "engines" in self.model_fields_set:
                raise ValueError("engines: give either 'engines' (one pool) or 'pools', not both")
            bus = self.bus or BusConfig()
            for i, p in enumerate(self.pools):
                if "bus" in p.model_fields_set and p.bus != bus:
                    raise ValueError(
                        f"pools.{i}.bus: the bus belongs to the deployment; set 'bus' at the top"
                    )
        elif self.bus is not None and self.engines.bus not in (self.bus, BusConfig()):
            raise ValueError("bus: give either 'bus' or 'engines.bus', not both")
        elif self.engines.role != "both":
            raise ValueError(
                f"engines.role: a single pool must be 'both', got {self.engines.role!r}; "
                "use 'pools' for prefill and decode pools"
            )
        first = self.engine_pools[0].engine
        for i, p in enumerate(self.engine_pools[1:], 1):
            for key in ("model_name", "block_size", "max_model_len", "event_stride"):
                if getattr(p.engine, key) != getattr(first, key):
                    raise ValueError(
                        f"pools.{i}.engine.{key}: every pool serves the same model with the "
                        f"same {key} (the router tokenizes and hashes once), got "
                        f"{getattr(p.engine, key)!r} against {getattr(first, key)!r}"
                    )
        try:
            check_pools(tuple(Pool(p.name, p.role, p.engine.block_size) for p in self.engine_pools))
        except ValueError as e:
            raise ValueError(str(e)) from None
        names = [p.name for p in self.engine_pools]
        for name in self.autoscaling:
            if name not in names:
                raise ValueError(
                    f"autoscaling.{name}: no pool named {name!r}; pools: {', '.join(names)}"
                )
        if self.router.scorer == RAY_PREFIX_ROUTER and len(self.engine_pools) > 1:
            raise ValueError(
                f"router.scorer: {RAY_PREFIX_ROUTER!r} places within one Serve deployment; "
                "it cannot serve several pools"
            )
        return self

    @model_validator(mode="after")
    def _slos_above_the_floor(self) -> ServeConfig:
        """An autoscaled pool's SLO that no number of its engines can meet (under the floor of
        the profile the router prices them with) is refused: a policy would scale to its
        ceiling and stay there."""
        pools = {p.name: p for p in self.engine_pools}
        for name, scaling in self.autoscaling.items():
            profile = self.pool_profile(pools[name])
            for bound, floor_s in scaling.slo.floors_broken(profile):
                raise ValueError(
                    f"autoscaling.{name}.slo_{bound}_ms: no engine can meet it: the floor of "
                    f"profile {profile.name!r} is {floor_s * 1e3:.3g} ms (a one-token prompt's "
                    "TTFT, a lone decode step's TPOT, on an idle engine), got "
                    f"{getattr(scaling, f'slo_{bound}_ms')}"
                )
        return self

    def pool_profile(self, pool: EngineDeploymentConfig | None = None) -> LatencyProfile:
        """The profile the router prices ``pool``'s engines with (default: the first pool's),
        under the engines' own scheduler limits (a profile's per-token costs carry over; its
        batching limits are configuration)."""
        ecfg = (pool or self.engine_pools[0]).engine
        return LatencyProfile.load(self.pool_profile_name(pool)).with_limits(
            ecfg.max_num_batched_tokens, ecfg.long_prefill_token_threshold
        )

    def pool_profile_name(self, pool: EngineDeploymentConfig | None = None) -> str:
        """The name (or path) of ``pool_profile``'s profile: the router's, else the pool's
        engines', else the shipped default."""
        ecfg = (pool or self.engine_pools[0]).engine
        return self.router.profile or ecfg.profile or DEFAULT_PROFILE

    def to_dict(self) -> dict[str, Any]:
        """A plain dict that validates back to this config (what crosses into replicas): with
        pools, the unused single-pool default is left out."""
        if not self.pools:
            return self.model_dump()
        data = self.model_dump(exclude={"engines"})
        data["pools"] = [p.model_dump() for p in self.engine_pools]
        return data

    def with_pool(self, master_address: str, metadata_url: str) -> ServeConfig:
        """This config with the running pool master's address in every pool's engine config
        (``engine.pool``: what the engine deployments will read)."""
        endpoint = PoolEndpoint(
            master_address=master_address,
            metadata_url=metadata_url,
            segment_gib=self.pool.segment_gib,
        ).model_dump()
        data = self.to_dict()
        for p in data.get("pools") or [data["engines"]]:
            p["engine"]["pool"] = endpoint
        return ServeConfig.validated(data, source="pool")

    @property
    def deployment_bus(self) -> BusConfig:
        """The event bus every pool publishes on and every router replica reads."""
        if self.bus is not None:
            return self.bus
        return BusConfig() if self.pools else self.engines.bus

    @property
    def engine_pools(self) -> tuple[EngineDeploymentConfig, ...]:
        """Every pool, each carrying the deployment's bus (what its replicas open)."""
        bus = self.deployment_bus
        pools = self.pools or [self.engines]
        return tuple(p if p.bus == bus else p.model_copy(update={"bus": bus}) for p in pools)

    @property
    def engine(self) -> EngineConfig:
        """The engine settings the router serves with (model, block size, context): the first
        pool's, which every pool shares."""
        return self.engine_pools[0].engine

    def router_settings(self) -> RouterSettings:
        """The router's settings (``router.settings``), built once from this file. Where
        Serve's own router places (``ray_prefix``), the core keeps load with
        ``least_loaded``."""
        r = self.router
        serve_places = r.scorer == RAY_PREFIX_ROUTER
        return RouterSettings(
            scorer="least_loaded" if serve_places else r.scorer,
            scorer_options={} if serve_places else dict(r.scorer_options),
            block_size=self.engine.block_size,
            slo_ttft_s=r.slo_ttft_ms / 1e3 if r.slo_ttft_ms else None,
            max_in_flight=r.max_in_flight,
            max_queue=r.max_queue,
            max_wait_s=r.max_wait_s,
            event_stride=self.engine.event_stride,
            inflight_prompts=r.inflight_prompts,
            pd_max_local_prefill_tokens=r.pd_max_local_prefill_tokens,
            pd_overload_factor=r.pd_overload_factor,
            bus_poll_s=r.bus_poll_s,
        )

    @property
    def instances(self) -> int:
        """Engine instances over all pools (an autoscaled pool's: those it starts with)."""
        return sum(
            a.initial_replicas(p.instances) if (a := self.autoscaling.get(p.name)) else p.instances
            for p in self.engine_pools
        )

    @classmethod
    def from_yaml(cls, path: str | Path) -> ServeConfig:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--config: no such file {str(p)!r}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"--config {p}: not valid YAML: {e}") from None
        return cls.validated(data, source=str(p))

    @classmethod
    def validated(cls, data: dict[str, Any], source: str = "config") -> ServeConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            msg = err["msg"].removeprefix("Value error, ")
            where = ".".join(str(x) for x in err["loc"])
            # a check of the whole config names its field in the message itself
            raise ValueError(f"{source}: {where}: {msg}" if where else f"{source}: {msg}") from None
