"""The sim engines' cluster KV pool (issue 58): one object shared by every engine of a simulated
cluster (virtual time), standing for a Mooncake Store that spans the nodes' DRAM.

- **Residency**: blocks by chained hash, at most ``capacity_blocks``; the order is any
  ``policies/`` policy (LRU by default), as the CPU tier's (``engines.sim.cpu_tier``). The
  pool owns residency and capacity, the policy only the order.
- **Stores** follow vLLM's ``MooncakeStoreConnector`` (``save_decode_cache`` off, its
  default): each full *prompt* block an engine computes is put in the pool at the end of the
  step that computed it (its ``build_connector_meta`` saves each chunk's new full blocks;
  blocks a request loaded are not saved again). Generated blocks are not stored. A put of a
  key already resident stores nothing (Mooncake keeps a key's first value). The write's own
  transfer is not modelled: a block is readable from the end of its step (``ready_s``).
- **Loads**: at admission, after the GPU hit and the engine's own CPU tier, the further
  leading blocks resident in the pool (and readable by then) are loaded; the request's first
  step takes ``load_s`` longer: ``latency_ms / 1e3 + bytes / (gbps * 1e9)`` per request, bytes
  = blocks x ``block_bytes`` (block size x the profile's KV bytes per token). Each engine has
  its own link of ``gbps`` (per-node bandwidth, one engine per node): loads on different
  engines never share bandwidth; loads on one engine serialise through its steps, as its
  CPU-tier loads do. The load is network time: an engine's slowdown and jitter do not stretch
  it. vLLM's connector loads asynchronously (``load_async``: the request waits aside while the
  batch runs); the sim charges the load to the step that admits the request, as it charges a
  CPU-tier load.
- **Virtual time**: the cluster runs each engine up to a time in turn, so a put stamped later
  than a lookup is not seen by it (``ready_s``), but a put may evict a block a lagging engine
  would still have read: the pool is exact to within one arrival's interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from policies.base import EvictionPolicy
from policies.registry import create_policy

DEFAULT_POOL_GBPS = 25.0
# a batched Mooncake call costs 50-400 us here whatever it carries (docs/pool.md): one per load
DEFAULT_POOL_LATENCY_MS = 0.4


class SimPool:
    """``capacity_blocks`` blocks of ``block_bytes`` each, shared by a cluster's sim engines;
    ``gbps`` and ``latency_ms``: each engine's link to it. ``policy``: a registered policy name
    or an instance (which then serves this pool only)."""

    def __init__(
        self,
        capacity_blocks: int,
        block_bytes: int,
        *,
        gbps: float = DEFAULT_POOL_GBPS,
        latency_ms: float = DEFAULT_POOL_LATENCY_MS,
        policy: str | EvictionPolicy = "lru",
    ) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"pool capacity_blocks must be > 0, got {capacity_blocks}")
        if block_bytes <= 0:
            raise ValueError(f"pool block_bytes must be > 0, got {block_bytes}")
        if not (gbps > 0 and math.isfinite(gbps)):
            raise ValueError(f"pool gbps must be a positive number, got {gbps}")
        if not (latency_ms >= 0 and math.isfinite(latency_ms)):
            raise ValueError(f"pool latency_ms must be a number >= 0, got {latency_ms}")
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.gbps = gbps
        self.latency_ms = latency_ms
        self.policy = create_policy(policy, capacity_blocks) if isinstance(policy, str) else policy
        self._ready: dict[int, float] = {}  # hash -> when it became readable
        self.stored_blocks = 0  # blocks put that were not resident (and admitted)
        self.evictions = 0
        self.loads = 0  # requests that loaded from the pool
        self.loaded_blocks = 0

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._ready

    def __len__(self) -> int:
        return len(self._ready)

    def usage(self) -> float:
        return len(self._ready) / self.capacity_blocks

    def load_s(self, n_blocks: int) -> float:
        """Seconds one request's load of ``n_blocks`` takes over its engine's link (0: none)."""
        if n_blocks <= 0:
            return 0.0
        return self.latency_ms / 1e3 + n_blocks * self.block_bytes / (self.gbps * 1e9)

    def put(self, hashes: Sequence[int], start: int, end: int, ready_s: float) -> None:
        """Store blocks ``start:end`` of a prompt (``hashes``: its chained block hashes),
        readable from ``ready_s``, evicting per the policy when full."""
        ready, policy, cap = self._ready, self.policy, self.capacity_blocks
        for i in range(start, min(end, len(hashes))):
            h = hashes[i]
            parent = hashes[i - 1] if i else None
            at = ready.get(h)
            if at is not None:  # a second put stores nothing (Mooncake); the earlier wins
                if ready_s < at:
                    ready[h] = ready_s
                continue
            if not policy.admit(h, parent, i, ready_s):
                continue
            if len(ready) >= cap:
                victims = policy.evict(len(ready) + 1 - cap)
                if victims is None:
                    continue
                for v in victims:
                    del ready[v]  # type: ignore[arg-type]
                self.evictions += len(victims)
            ready[h] = ready_s
            policy.insert(h, ready_s, parent, i)
            self.stored_blocks += 1

    def match(self, hashes: Sequence[int], start: int, end: int, now_s: float) -> int:
        """How many of blocks ``start:end`` of ``hashes``, from ``start`` on, are resident
        and readable at ``now_s``."""
        ready = self._ready
        j = start
        while j < end:
            at = ready.get(hashes[j])
            if at is None or at > now_s:
                break
            j += 1
        return j - start

    def load(self, hashes: Sequence[int], now_s: float) -> None:
        """A request loads ``hashes`` (resident: just matched): each one is reused."""
        touch = self.policy.touch
        for h in reversed(hashes):  # tail first: the head ends up the most recently used
            touch(h, now_s)
        self.loads += 1
        self.loaded_blocks += len(hashes)
