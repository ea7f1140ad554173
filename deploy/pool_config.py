"""The serve config's ``pool`` section: the cluster KV pool (Mooncake Store, docs/pool.md), its
master's ports on a cluster, and what a node mounts into it."""

from __future__ import annotations

import ipaddress

from pydantic import Field, field_validator, model_validator

from engines.config import StrictModel
from engines.pool.master import MasterConfig

# The head's master on a cluster (deploy/node-setup.sh pool, deploy/cluster*.yaml): Mooncake's
# own default ports, fixed because every node must find it. A ``pool`` port of 0 means these with
# ``--ray-address`` and a free port on a local ``kvroute serve``.
CLUSTER_POOL_PORTS = {"rpc_port": 50051, "metadata_port": 8080, "metrics_port": 9003}
MIN_SEGMENT_GIB = 16 / 1024  # Mooncake refuses segments under 16 MiB


class PoolConfig(StrictModel):
    """The cluster KV pool (Mooncake Store, docs/pool.md): ``kvroute serve`` starts its master
    before Ray (a cluster's head starts it instead: deploy/node-setup.sh pool) and tells the
    engine deployments where it is; their vLLM engines run the pool's connector and mount
    ``segment_gib`` each (sim engines ignore it). The router hints each request whether to
    load from it, pricing a load over ``link_gbps`` against recomputing (docs/pool.md)."""

    enabled: bool = Field(
        False, description="start the pool's master (and hand its address to the engines)"
    )
    segment_gib: float = Field(
        4.0, gt=0, le=16384, description="DRAM each engine node mounts into the pool, GiB"
    )
    link_gbps: float = Field(
        25.0, gt=0, le=10_000, description="each engine node's bandwidth to the pool, GB/s"
    )
    link_latency_ms: float = Field(
        0.4, ge=0, le=10_000, description="what one load from the pool costs besides its bytes"
    )
    master_host: str = Field(
        "127.0.0.1",
        description="the address the master and its metadata server bind (an IP of this "
        "machine, never 0.0.0.0); on a cluster, loopback means the Ray head's address",
    )
    rpc_port: int = Field(0, ge=0, le=65535, description="the master's RPC port (0: see below)")
    metadata_port: int = Field(0, ge=0, le=65535, description="the HTTP metadata server's port")
    metrics_port: int = Field(0, ge=0, le=65535, description="the master's metrics port")
    client_ttl_s: int = Field(
        10,
        ge=1,
        le=3600,
        description="a client's segment leaves the pool this long after its last heartbeat",
    )
    kv_lease_ttl_ms: int = Field(
        10_000, ge=0, le=3_600_000, description="a read holds an object against eviction this long"
    )
    eviction_high_watermark: float = Field(
        0.9, gt=0, le=1, description="the share of the pool in use at which the master evicts"
    )
    eviction_ratio: float = Field(0.05, gt=0, le=1, description="the share it evicts then")
    start_timeout_s: float = Field(20.0, gt=0, le=600)

    @field_validator("segment_gib")
    @classmethod
    def _segment_fits(cls, v: float) -> float:
        if v < MIN_SEGMENT_GIB:
            raise ValueError(f"Mooncake refuses segments under 16 MiB ({MIN_SEGMENT_GIB} GiB)")
        return v

    @field_validator("master_host")
    @classmethod
    def _bindable(cls, v: str) -> str:
        try:
            ip = ipaddress.ip_address(v)
        except ValueError:
            raise ValueError(
                f"an IP address of this machine (127.0.0.1, or the cluster's private address), "
                f"got {v!r}"
            ) from None
        if ip.is_unspecified or ip.is_multicast:
            raise ValueError(
                f"{v!r} would listen on every interface: give 127.0.0.1 or the cluster's "
                "private address (the security group keeps the pool's ports to the cluster)"
            )
        return v

    @model_validator(mode="after")
    def _distinct_ports(self) -> PoolConfig:
        seen: dict[int, str] = {}
        for name in CLUSTER_POOL_PORTS:
            port = getattr(self, name)
            if port and port in seen:
                raise ValueError(f"pool.{name}: {port} is pool.{seen[port]} too")
            seen.setdefault(port, name)
        return self

    def master_config(self, host: str | None = None, cluster: bool = False) -> MasterConfig:
        """The master's settings (``host`` instead of ``master_host``; ``cluster``: a port of 0
        is the cluster's fixed one, ``CLUSTER_POOL_PORTS``)."""
        fixed = CLUSTER_POOL_PORTS.items()
        ports = {k: getattr(self, k) or (v if cluster else 0) for k, v in fixed}
        return MasterConfig(
            host=host or self.master_host,
            client_ttl_s=self.client_ttl_s,
            kv_lease_ttl_ms=self.kv_lease_ttl_ms,
            eviction_high_watermark=self.eviction_high_watermark,
            eviction_ratio=self.eviction_ratio,
            start_timeout_s=self.start_timeout_s,
            **ports,
        )
