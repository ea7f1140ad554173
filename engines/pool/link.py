"""An engine's link to the cluster KV pool: what a load of KV from the pool costs.

One formula, used by the sim engines' pool (``engines.sim.pool``: how long a load takes) and by
the router (``router.scorers.kv_ttft``: what a load is priced at against recomputing it). A
load is one batched Mooncake call per request: a fixed latency (the call's round trips: 50-400
us here whatever it carries, ``docs/pool.md``) plus its bytes over the link's bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DEFAULT_POOL_GBPS", "DEFAULT_POOL_LATENCY_MS", "PoolLink"]

# each engine node's link to the pool, GB/s (1e9 B/s): a 200 Gb/s RDMA NIC
DEFAULT_POOL_GBPS = 25.0
# a batched Mooncake call costs 50-400 us here whatever it carries (docs/pool.md): one per load
DEFAULT_POOL_LATENCY_MS = 0.4


@dataclass(frozen=True, slots=True)
class PoolLink:
    """``gbps``: GB/s (1e9 B/s) between an engine and the pool; ``latency_ms``: per load."""

    gbps: float = DEFAULT_POOL_GBPS
    latency_ms: float = DEFAULT_POOL_LATENCY_MS

    def __post_init__(self) -> None:
        if not (self.gbps > 0 and math.isfinite(self.gbps)):
            raise ValueError(f"gbps must be a positive number, got {self.gbps}")
        if not (self.latency_ms >= 0 and math.isfinite(self.latency_ms)):
            raise ValueError(f"latency_ms must be a number >= 0, got {self.latency_ms}")

    def load_s(self, n_bytes: int) -> float:
        """Seconds one load of ``n_bytes`` takes over this link (0: nothing to load)."""
        if n_bytes <= 0:
            return 0.0
        return self.latency_ms / 1e3 + n_bytes / (self.gbps * 1e9)
