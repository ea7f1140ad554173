"""Paged KV blocks with prefix caching, mirroring vLLM v1's ``BlockPool``/``KVCacheManager``.

GPU tier (what vLLM 0.32 does for a single full-attention KV group):

- ``num_gpu_blocks`` physical blocks; block 0 is the null block and never used.
- Free blocks sit in one queue in eviction order. A new block is popped from its front; if it
  still holds a cached hash, that hash is evicted then (``BlockRemoved``). So the cache is LRU
  over free cached blocks, and a hit on a free block takes it out of the queue.
- A finished (or preempted) request frees its blocks tail first: uncached blocks go to the
  front of the queue (reused first), cached ones to the back in reverse order, so a request's
  tail is evicted before its head.
- Hashes are chained per full block; a block is cached (``BlockStored``) when the scheduler
  allocates the step that completes it. Equal blocks computed twice are both cached (no
  de-duplication), as in vLLM.
- A lookup matches the longest run of cached leading blocks, at most ``num_tokens - 1`` tokens:
  the last prompt token is always recomputed, so a full-prompt hit recomputes the last block.

CPU tier (optional): a block evicted from the GPU is offloaded to a CPU cache whose order is
any ``policies/`` policy. A lookup extends a GPU hit with blocks resident on CPU; those are
copied back into new GPU blocks (the caller charges the load time). The policy sees each
request's lifecycle (``begin_request`` at first admission, ``end_request`` with the blocks it
loaded as the reuse when it finishes); blocks enter the tier at eviction, outside any request.

Cluster pool (optional, ``engines.sim.pool``): one ``SimPool`` shared by a simulated cluster's
engines (``pool``, set by the owner). A lookup's third tier: the leading blocks after the GPU
and CPU-tier hit that the pool holds are loaded into new GPU blocks (``pool_hit``,
``allocate_new(n_pool=...)``, after the wait ``pool_load_s``), and the prompt blocks a step
computes are stored to it (``store_to_pool``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from cachemap.events import AllBlocksCleared, BlockRemoved, BlockStored
from engines.sim.cpu_tier import CPUTier
from engines.sim.pool import SimPool
from engines.sim.request import SimRequest
from policies.base import EvictionPolicy, RequestInfo

GPU = "GPU"


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    depth: int = 0
    # kept only when events are on, for the CPU-tier events of an offloaded block:
    token_ids: list[int] | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    generated: bool = False  # holds generated tokens (not offloaded by a prompt-only CPU tier)
    # the last request that held it: the CPU-tier policy stores it on that request's behalf
    info: RequestInfo | None = None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVBlockManager:
    """The block pool of one engine instance. ``now_s`` (set by the caller before each step)
    is the time given to the CPU-tier policy; events accumulate until ``take_events``."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        *,
        cpu_capacity_blocks: int = 0,
        cpu_policy: str | EvictionPolicy = "lru",
        enable_events: bool = False,
    ) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(
                f"num_gpu_blocks must be >= 2 (one is the null block), got {num_gpu_blocks}"
            )
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if cpu_capacity_blocks < 0:
            raise ValueError(f"cpu_capacity_blocks must be >= 0, got {cpu_capacity_blocks}")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        # NOTE: the free queue, front = next to reuse, is three parts: blocks freed uncached
        # (put at the front), the blocks never used yet (ids ``_fresh`` up, in order), and
        # blocks freed cached (put at the back); OrderedDicts pop, remove and add in O(1). A
        # block exists (``blocks[i]``) from its first use: a short run (a what-if) touches a
        # fraction of an engine's tens of thousands of blocks
        self.blocks = [Block(0)]
        self._front: OrderedDict[int, None] = OrderedDict()
        self._fresh = 1
        self._back: OrderedDict[int, None] = OrderedDict()
        # hash -> the block a lookup returns; equal blocks cached later wait in _dups (rare).
        self._cached: dict[int, Block] = {}
        self._dups: dict[int, list[Block]] = {}
        self.events: list[Any] | None = [] if enable_events else None
        self.cpu: CPUTier | None = None
        if cpu_capacity_blocks:
            self.cpu = CPUTier(cpu_capacity_blocks, cpu_policy, block_size, self.events)
        # the cluster's KV pool (``engines.sim.pool``), shared with the other engines; set by
        # the engine's owner (a virtual cluster), None: no pool
        self.pool: SimPool | None = None
        self.now_s = 0.0

    # -- state -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._front) + self.num_gpu_blocks - self._fresh + len(self._back)

    def gpu_usage(self) -> float:
        return 1.0 - self.num_free / (self.num_gpu_blocks - 1)

    def cpu_usage(self) -> float:
        return self.cpu.usage() if self.cpu is not None else 0.0

    def gpu_hashes(self) -> set[int]:
        """Hashes a lookup can hit on the GPU now."""
        return set(self._cached)

    def cpu_hashes(self) -> set[int]:
        return self.cpu.hashes() if self.cpu is not None else set()

    def free_queue_hashes(self) -> list[int | None]:
        """Hashes of free blocks in eviction order (front = next evicted); for tests."""
        fresh: list[int | None] = [None] * (self.num_gpu_blocks - self._fresh)
        front = [self.blocks[i].block_hash for i in self._front]
        return front + fresh + [self.blocks[i].block_hash for i in self._back]

    def begin_request(self, req: SimRequest) -> None:
        """A request arrives (its first admission attempt): the CPU-tier policy's request
        lifecycle. Once per request: later attempts (a blocked queue head) do nothing."""
        if req.begun:
            return
        req.begun = True
        if self.cpu is not None:
            if req.info is None:
                req.info = RequestInfo(num_blocks=len(req.block_hashes))
            elif not req.info.num_blocks:
                req.info = msgspec.structs.replace(req.info, num_blocks=len(req.block_hashes))
            self.cpu.begin_request(req.info, self.now_s)

    def end_request(self, req: SimRequest) -> None:
        """The request finished or was aborted: its CPU-tier reuse goes to the policy, and an
        operator's pin order (``RequestInfo.pin``) to the tier."""
        cpu, info = self.cpu, req.info
        if cpu is not None and info is not None:
            cpu.end_request(info, req.block_hashes, req.cpu_reused, self.now_s)
            if info.pin:
                cpu.pin(req.block_hashes)
            elif info.pin is False:
                cpu.unpin(req.block_hashes, self.now_s)

    def clear_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache`` with its connector's: forget every cached block on both
        tiers (and the CPU tier's pins), publishing ``AllBlocksCleared`` (for every tier, as
        vLLM does). False, changing nothing, while any request holds blocks."""
        if self.num_free < self.num_gpu_blocks - 1:
            return False
        for h in self._cached:
            self._cached[h].block_hash = None
        for dups in self._dups.values():
            for b in dups:
                b.block_hash = None
        self._cached.clear()
        self._dups.clear()
        for b in self.blocks:
            b.parent_hash = b.token_ids = b.info = None
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        if self.cpu is not None:
            self.cpu.clear()
        return True

    def take_events(self) -> list[Any]:
        if self.events is None:
            return []
        out = self.events.copy()
        self.events.clear()  # NOTE: in place: the CPU tier appends to the same list
        return out

    # -- lookup and allocation ---------------------------------------------------------------

    def lookup(self, req: SimRequest) -> tuple[list[Block], int]:
        """Blocks hit on the GPU, and how many following blocks are on the CPU tier."""
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = req.block_hashes
        hit: list[Block] = []
        cached = self._cached
        for i in range(min(max_blocks, len(hashes))):
            b = cached.get(hashes[i])
            if b is None:
                break
            hit.append(b)
        n_cpu = 0
        cpu = self.cpu
        if cpu is not None and len(cpu):
            j, end = len(hit), min(max_blocks, len(hashes))
            while j < end and hashes[j] in cpu:
                j += 1
            n_cpu = j - len(hit)
        return hit, n_cpu

    def pool_hit(self, req: SimRequest, start: int) -> int:
        """How many blocks from ``start`` (the GPU and CPU-tier hit) the pool holds, readable
        now: the lookup's third tier, within the same ``num_tokens - 1`` bound."""
        pool = self.pool
        if pool is None or not len(pool):
            return 0
        end = min((req.num_tokens - 1) // self.block_size, len(req.block_hashes))
        return pool.match(req.block_hashes, start, end, self.now_s)

    def pool_load_s(self, n_pool: int) -> float:
        """Seconds a load of ``n_pool`` blocks from the pool takes (0 without one)."""
        return self.pool.load_s(n_pool) if self.pool is not None else 0.0

    def store_to_pool(self, req: SimRequest, before: int, n: int, end_s: float) -> None:
        """A step computed tokens ``before:before + n`` of ``req``, ending at ``end_s``: the
        prompt blocks it completed go to the pool (vLLM's ``MooncakeStoreConnector``)."""
        if self.pool is not None:
            bs = self.block_size
            end = min(before + n, req.prompt_len) // bs
            if end > before // bs:
                self.pool.put(req.block_hashes, before // bs, end, end_s)

    def allocate_new(
        self,
        req: SimRequest,
        num_new_tokens: int,
        hit: list[Block],
        n_cpu: int,
        max_model_len: int,
        full_sequence_must_fit: bool = True,
        delay_cache_blocks: bool = False,
        n_pool: int = 0,
    ) -> bool:
        """Admit a waiting request with its lookup result (``KVCacheManager.allocate_slots``).
        ``delay_cache_blocks``: the new blocks are filled by a KV transfer, so they are cached
        (``cache_blocks``) when it completes, not now (vLLM's option of that name).
        ``n_pool``: blocks after the CPU-tier hit loaded from the pool (``pool_hit``)."""
        bs, n_hit = self.block_size, len(hit)
        evictable = sum(1 for b in hit if b.ref_cnt == 0)
        free = self.num_free
        if full_sequence_must_fit:
            full = cdiv(min(req.num_tokens, max_model_len), bs)
            if max(full - n_hit, 0) + evictable > free:
                return False
        computed = (n_hit + n_cpu + n_pool) * bs
        need_slot = min(computed + num_new_tokens, max_model_len)
        if max(cdiv(need_slot, bs) - n_hit, 0) + evictable > free:
            return False
        back = self._back
        for b in hit:
            if b.ref_cnt == 0:  # cached, so at the back (the front's blocks have no hash)
                del back[b.block_id]
            b.ref_cnt += 1
            b.info = req.info
        req.blocks = list(hit)
        req.num_cached_blocks = n_hit
        if n_cpu:
            assert self.cpu is not None
            loaded = req.block_hashes[n_hit : n_hit + n_cpu]
            # NOTE: reuse is reported at end_request (policy contract), not touched here.
            req.cpu_reused.extend(h for h in loaded if h not in req.cpu_reused)
            self.cpu.protected = frozenset(loaded)
        req.blocks.extend(self._get_new_blocks(cdiv(need_slot, bs) - n_hit))
        if n_cpu:
            self.cpu.protected = frozenset()  # type: ignore[union-attr]
        if n_pool and self.pool is not None:
            start = n_hit + n_cpu
            self.pool.load(req.block_hashes[start : start + n_pool], self.now_s)
        if not delay_cache_blocks:
            self._cache_blocks(req, min(computed + num_new_tokens, req.num_tokens))
        return True

    def cache_blocks(self, req: SimRequest, num_tokens: int) -> None:
        """Cache (and announce with ``BlockStored``) the full blocks of ``req`` up to
        ``num_tokens`` that are not yet cached: blocks a KV transfer filled."""
        self._cache_blocks(req, min(num_tokens, req.num_tokens))

    def blocks_needed(self, req: SimRequest, num_new_tokens: int, max_model_len: int) -> int:
        """New blocks a running request needs to compute ``num_new_tokens`` more tokens."""
        need_slot = min(req.num_computed + num_new_tokens, max_model_len)
        return max(cdiv(need_slot, self.block_size) - len(req.blocks), 0)

    def allocate_running(self, req: SimRequest, num_new_tokens: int, max_model_len: int) -> bool:
        """Slots for a running request's next ``num_new_tokens`` (False: not enough blocks)."""
        need = self.blocks_needed(req, num_new_tokens, max_model_len)
        if need > self.num_free:
            return False
        if need:
            req.blocks.extend(self._get_new_blocks(need))
        self._cache_blocks(req, min(req.num_computed + num_new_tokens, req.num_tokens))
        return True

    def free(self, req: SimRequest) -> None:
        """Release a request's blocks, tail first (``BlockPool.free_blocks(reversed(...))``)."""
        first: list[Block] = []
        last: list[Block] = []
        for b in reversed(req.blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                (first if b.block_hash is None else last).append(b)
        front, back = self._front, self._back
        for b in reversed(first):
            front[b.block_id] = None
            front.move_to_end(b.block_id, last=False)
        for b in last:
            back[b.block_id] = None
        req.blocks = []
        req.num_cached_blocks = 0

    # -- internals ---------------------------------------------------------------------------

    def _get_new_blocks(self, n: int) -> list[Block]:
        front, back, blocks = self._front, self._back, self.blocks
        out: list[Block] = []
        for _ in range(n):
            if front:
                out.append(blocks[front.popitem(last=False)[0]])
            elif self._fresh < self.num_gpu_blocks:
                b = Block(self._fresh)
                blocks.append(b)
                self._fresh += 1
                out.append(b)
            else:
                out.append(blocks[back.popitem(last=False)[0]])
        plain = self.events is None and self.cpu is None and not self._dups
        cached = self._cached
        for b in out:
            if b.block_hash is not None:
                if plain:
                    del cached[b.block_hash]
                    b.block_hash = None
                else:
                    self._evict_cached(b)
            b.ref_cnt = 1
        return out

    def _evict_cached(self, b: Block) -> None:
        h = b.block_hash
        assert h is not None
        dups = self._dups.get(h)
        if self._cached[h] is b:
            if dups:
                self._cached[h] = dups.pop(0)
            else:
                del self._cached[h]
                if self.cpu is not None and not (b.generated and self.cpu.prompt_only):
                    self.cpu.offload(
                        h,
                        b.parent_hash,
                        b.depth,
                        self.now_s,
                        b.token_ids or [],
                        b.lora_name,
                        b.extra_keys,
                        b.info,
                    )
        elif dups is not None:
            dups.remove(b)
        if dups is not None and not dups:
            del self._dups[h]
        if self.events is not None:
            self.events.append(BlockRemoved(block_hashes=[h], medium=GPU, group_idx=0))
        b.block_hash = b.parent_hash = b.token_ids = b.info = None

    def _stored(self, req: SimRequest, start: int, end: int, tokens: list[int]) -> BlockStored:
        """vLLM's ``BlockStored`` for blocks ``start:end`` of ``req`` (GPU, KV group 0)."""
        lora, salt = req.lora_name, req.cache_salt
        # every block carries the LoRA name; block 0 also the salt, after it (vLLM's order)
        extra: list[tuple[Any, ...] | None] = [(lora,) if lora else None] * (end - start)
        if start == 0:
            extra[0] = tuple(k for k in (lora, salt) if k) or None
        hashes = req.block_hashes
        return BlockStored(
            block_hashes=hashes[start:end],  # type: ignore[arg-type]
            parent_block_hash=hashes[start - 1] if start else None,
            token_ids=tokens,
            block_size=self.block_size,
            lora_id=None,
            medium=GPU,
            lora_name=lora,
            extra_keys=extra,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )

    def _cache_blocks(self, req: SimRequest, num_tokens: int) -> None:
        start, num_full = req.num_cached_blocks, num_tokens // self.block_size
        if start >= num_full:
            return
        hashes, blocks, cached = req.block_hashes, req.blocks, self._cached
        if len(hashes) < num_full:
            raise RuntimeError(
                f"request {req.request_id}: {len(hashes)} block hashes, caching {num_full}"
            )
        prev = hashes[start - 1] if start else None
        prompt_blocks = req.prompt_len // self.block_size
        for i in range(start, num_full):
            b, h = blocks[i], hashes[i]
            b.block_hash, b.parent_hash, b.depth, b.info = h, prev, i, req.info
            b.generated = i >= prompt_blocks
            if h in cached:
                self._dups.setdefault(h, []).append(b)
            else:
                cached[h] = b
            prev = h
        req.num_cached_blocks = num_full
        if self.events is not None:
            bs = self.block_size
            toks = req.token_ids[start * bs : num_full * bs] if req.token_ids is not None else []
            ev = self._stored(req, start, num_full, toks)
            self.events.append(ev)
            extra = ev.extra_keys or []
            for i in range(start, num_full):
                b = blocks[i]
                b.token_ids = toks[(i - start) * bs : (i - start + 1) * bs] if toks else None
                b.lora_name, b.extra_keys = req.lora_name, extra[i - start]
