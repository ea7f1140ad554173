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
  leading blocks resident in the pool (and readable by then) are loaded, asynchronously as
  vLLM's connector does by default (``load_async``): the request waits aside for ``load_s`` =
  ``link.load_s(blocks x block_bytes)`` (``engines.pool.link``), the batch running meanwhile,
  then is admitted with them cached (``engines.sim.scheduler``). Each engine has its own link
  (per-node bandwidth, one engine per node): loads on different engines never share
  bandwidth; one engine's loads queue on its link. The load is network time: an engine's
  slowdown and jitter do not stretch it.
- **Announcements** (``announce``): what the pool stores and evicts, as the cache map's bus
  updates (``Stored``/``Removed`` on the ``CPU`` tier, for the instance
  ``cachemap.POOL_INSTANCE``), in order, each with the virtual time it happened at
  (``take_updates``). The cluster publishes them with the engines' event lag. kvroute owns
  this pool's eviction (its policy is a ``policies/`` one), so the map's view is the pool's
  own, late by that lag: the design for the real store (``docs/pool.md``, "The map").
  ``stride``: announce every ``stride``-th block only, as the engines' translators do.
- **Virtual time**: the cluster runs each engine up to a time in turn, so a put stamped later
  than a lookup is not seen by it (``ready_s``), but a put may evict a block a lagging engine
  would still have read: the pool is exact to within one arrival's interval.
"""

from __future__ import annotations

from collections.abc import Sequence

from cachemap.events import Removed, Stored, Update
from cachemap.hashing import Tier
from engines.pool.link import PoolLink
from policies.base import EvictionPolicy
from policies.registry import create_policy

_CPU = Tier.CPU.value


class SimPool:
    """``capacity_blocks`` blocks of ``block_bytes`` each, shared by a cluster's sim engines;
    ``link``: each engine's link to it. ``policy``: a registered policy name or an instance
    (which then serves this pool only). ``announce``: keep what it stores and evicts as bus
    updates (``take_updates``), every ``stride``-th block."""

    def __init__(
        self,
        capacity_blocks: int,
        block_bytes: int,
        *,
        link: PoolLink | None = None,
        policy: str | EvictionPolicy = "lru",
        announce: bool = False,
        stride: int = 1,
    ) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"pool capacity_blocks must be > 0, got {capacity_blocks}")
        if block_bytes <= 0:
            raise ValueError(f"pool block_bytes must be > 0, got {block_bytes}")
        if stride < 1:
            raise ValueError(f"pool stride must be >= 1, got {stride}")
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.link = link if link is not None else PoolLink()
        self.announce = announce
        self.stride = stride
        # (virtual time, update) in the order they happened (``announce``)
        self._updates: list[tuple[float, Update]] = []
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
        return self.link.load_s(n_blocks * self.block_bytes)

    def take_updates(self, until_s: float) -> list[Update]:
        """The announced updates from the oldest on, up to the first stamped after
        ``until_s`` (kept, with every later one: the order is the pool's)."""
        ups = self._updates
        n = 0
        while n < len(ups) and ups[n][0] <= until_s:
            n += 1
        out = [u for _, u in ups[:n]]
        del ups[:n]
        return out

    def _stored(self, hashes: Sequence[int], run: list[int], at: float) -> list[int]:
        """Announce blocks ``run`` (ascending indices, contiguous) of ``hashes`` as stored:
        the kept ones (every ``stride``-th), each the child of the kept one ``stride`` before.
        Returns a new, empty run."""
        st = self.stride
        kept = [i for i in run if (i + 1) % st == 0]
        if kept:
            first = kept[0]
            parent = hashes[first - st] if first >= st else None
            chain = [hashes[i] for i in kept]
            self._updates.append((at, Stored(_CPU, chain, parent, (first + 1) // st - 1)))
        return []

    def put(self, hashes: Sequence[int], start: int, end: int, ready_s: float) -> None:
        """Store blocks ``start:end`` of a prompt (``hashes``: its chained block hashes),
        readable from ``ready_s``, evicting per the policy when full."""
        ready, policy, cap, announce = self._ready, self.policy, self.capacity_blocks, self.announce
        run: list[int] = []  # the blocks stored in a row, to announce as one chain
        for i in range(start, min(end, len(hashes))):
            h = hashes[i]
            parent = hashes[i - 1] if i else None
            at = ready.get(h)
            stored = False
            if at is not None:  # a second put stores nothing (Mooncake); the earlier wins
                ready[h] = min(at, ready_s)
            elif policy.admit(h, parent, i, ready_s):
                victims = policy.evict(len(ready) + 1 - cap) if len(ready) >= cap else []
                if victims is not None:
                    for v in victims:
                        del ready[v]  # type: ignore[arg-type]
                    self.evictions += len(victims)
                    if victims and announce:  # in order: a victim may be of this run's chain
                        run = self._stored(hashes, run, ready_s)
                        self._updates.append((ready_s, Removed(_CPU, [*victims])))  # type: ignore[list-item]
                    ready[h] = ready_s
                    policy.insert(h, ready_s, parent, i)
                    self.stored_blocks += 1
                    stored = True
            if stored and announce:
                run.append(i)
            elif run:
                run = self._stored(hashes, run, ready_s)
        if run:
            self._stored(hashes, run, ready_s)

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
