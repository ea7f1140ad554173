"""The global cache map: which engine instance holds which KV block on which tier.

Representation (built for tens of millions of resident blocks):

- one ``HashIndex`` (flat numpy open addressing) ``block hash -> slot``;
- per slot, numpy columns: parent hash (uint64), depth (int32), and one instance bitmask per tier
  (``words`` uint64 words per slot, so 64 instances per word; the width grows as instances join).

A block's node lives while at least one instance holds it on some tier; the last removal frees
the slot for reuse. Because hashes chain the whole prefix, ``match`` needs one dict lookup per
block (done as one vectorised probe), then a running AND of the masks gives every instance's
leading run at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from cachemap.hashing import BlockHash, InstanceId, Tier
from cachemap.index import HashIndex
from cachemap.jit import jit

_TIERS: tuple[Tier, ...] = tuple(Tier)


class Match(NamedTuple):
    """Leading blocks of a prompt resident on one instance."""

    gpu_blocks: int  # leading blocks on GPU
    total_blocks: int  # leading blocks on GPU or CPU (>= gpu_blocks)

    @property
    def cpu_blocks(self) -> int:
        """Blocks after the GPU run that would be loaded from the CPU tier."""
        return self.total_blocks - self.gpu_blocks


class MatchResult(Mapping[InstanceId, Match]):
    """``match``'s answer: a read-only mapping built lazily from per-instance-bit arrays, so a
    prefix held by dozens of instances costs nothing until a scorer asks about them."""

    __slots__ = ("_bit_of", "_instance_at", "_n_any", "_n_gpu")

    def __init__(
        self,
        bit_of: dict[str, int],
        instance_at: dict[int, InstanceId],
        n_gpu: npt.NDArray[np.int64],
        n_any: npt.NDArray[np.int64],
    ) -> None:
        self._bit_of, self._instance_at = bit_of, instance_at
        self._n_gpu, self._n_any = n_gpu, n_any

    def __getitem__(self, instance: str) -> Match:
        b = self._bit_of.get(instance)
        if b is None or not self._n_any[b]:
            raise KeyError(instance)
        return Match(int(self._n_gpu[b]), int(self._n_any[b]))

    def __iter__(self) -> Iterator[InstanceId]:
        inst = self._instance_at
        return (inst[b] for b in np.flatnonzero(self._n_any).tolist() if b in inst)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"MatchResult({dict(self.items())!r})"


class CacheMapStats(NamedTuple):
    blocks: int  # distinct blocks resident anywhere
    residency: int  # (block, instance, tier) entries
    instances: int
    slot_capacity: int
    mask_words: int


class CacheMap:
    """Per-instance, per-tier block residency keyed by chained block hash. Not thread-safe."""

    def __init__(self, initial_slots: int = 1024) -> None:
        cap = max(16, initial_slots)
        self._index = HashIndex(cap)
        self._free = np.empty(0, np.int64)  # released slots, reused first
        self._next = 0  # slots [0, _next) have been handed out at least once
        self._words = 1
        self._hash = np.zeros(cap, np.uint64)
        self._parent = np.zeros(cap, np.uint64)
        self._has_parent = np.zeros(cap, np.bool_)
        self._depth = np.zeros(cap, np.int32)
        self._mask = {t: np.zeros((cap, 1), np.uint64) for t in _TIERS}
        self._bit_of: dict[str, int] = {}
        self._instance_at: dict[int, InstanceId] = {}
        self._free_bits: list[int] = []
        self._count = {t: dict[str, int]() for t in _TIERS}

    # -- instances -------------------------------------------------------------------------------

    def instances(self) -> list[InstanceId]:
        return list(self._instance_at.values())

    def _bit(self, instance: str) -> int:
        bit = self._bit_of.get(instance)
        if bit is not None:
            return bit
        if self._free_bits:
            bit = self._free_bits.pop()
        else:
            bit = len(self._bit_of)
            if bit >= 64 * self._words:
                self._resize(len(self._hash), self._words * 2)
        # NOTE: copy-on-write, so MatchResults handed out keep a consistent roster.
        self._bit_of = {**self._bit_of, instance: bit}
        self._instance_at = {**self._instance_at, bit: InstanceId(instance)}
        for t in _TIERS:
            self._count[t][instance] = 0
        return bit

    def _resize(self, slots: int, words: int) -> None:
        n = len(self._hash)

        def grow(a: npt.NDArray[np.generic]) -> npt.NDArray[np.generic]:
            out = np.zeros((slots, *a.shape[1:]), a.dtype)
            out[:n] = a
            return out

        self._hash = grow(self._hash)  # type: ignore[assignment]
        self._parent = grow(self._parent)  # type: ignore[assignment]
        self._has_parent = grow(self._has_parent)  # type: ignore[assignment]
        self._depth = grow(self._depth)  # type: ignore[assignment]
        for t in _TIERS:
            m = np.zeros((slots, words), np.uint64)
            m[:n, : self._words] = self._mask[t]
            self._mask[t] = m
        self._words = words

    # -- updates ---------------------------------------------------------------------------------

    def store(
        self,
        instance: str,
        tier: Tier,
        hashes: Sequence[int],
        parent: int | None = None,
        depth: int = 0,
    ) -> int:
        """Record that ``instance`` holds the chain ``hashes`` on ``tier``.

        ``hashes[0]``'s parent is ``parent`` (None for a prompt's first block) and its depth
        (block index within the prompt) is ``depth``; each later hash is the child of the one
        before it. Returns how many (block, instance, tier) entries were new.
        """
        if not hashes:
            return 0
        tier = Tier(tier)
        bit = self._bit(instance)
        hs = np.asarray(hashes, np.uint64)
        idx = self._index.get(hs)
        new = idx < 0
        if new.any():
            # NOTE: a hash may repeat within one call; its first position defines the node.
            keys, first = np.unique(hs[new], return_index=True)
            pos = np.flatnonzero(new)[first]
            at = self._alloc(len(keys))
            self._index.insert(keys, at)
            parents = np.empty(len(hs), np.uint64)
            parents[1:] = hs[:-1]
            parents[0] = parent if parent is not None else 0
            self._hash[at] = keys
            self._parent[at] = parents[pos]
            self._has_parent[at] = (pos > 0) | (parent is not None)
            self._depth[at] = depth + pos
            idx = self._index.get(hs)
        if len(idx) > 1:
            idx = np.unique(idx)  # NOTE: a hash may repeat within one call
        w, m = divmod(bit, 64)
        flag = np.uint64(1 << m)
        col = self._mask[tier][:, w]
        added = int(np.count_nonzero((col[idx] & flag) == 0))
        col[idx] |= flag
        self._count[tier][instance] += added
        return added

    def _alloc(self, n: int) -> npt.NDArray[np.int64]:
        reuse = min(n, len(self._free))
        got = self._free[len(self._free) - reuse :]
        self._free = self._free[: len(self._free) - reuse]
        fresh = n - reuse
        if self._next + fresh > len(self._hash):
            size = len(self._hash)
            while self._next + fresh > size:
                size *= 2
            self._resize(size, self._words)
        out: npt.NDArray[np.int64] = np.concatenate(
            [got, np.arange(self._next, self._next + fresh, dtype=np.int64)]
        )
        self._next += fresh
        return out

    def remove(self, instance: str, tier: Tier, hashes: Iterable[int]) -> int:
        """Forget ``instance``'s copies of ``hashes`` on ``tier``; unknown hashes are ignored.
        Returns how many entries were removed."""
        tier = Tier(tier)
        bit = self._bit_of.get(instance)
        if bit is None:
            return 0
        idx = self._index.get(np.fromiter(hashes, np.uint64))
        idx = np.unique(idx[idx >= 0])
        if len(idx) == 0:
            return 0
        w, m = divmod(bit, 64)
        flag = np.uint64(1 << m)
        col = self._mask[tier][:, w]
        held = idx[(col[idx] & flag) != 0]
        col[held] &= ~flag
        self._count[tier][instance] -= len(held)
        self._release(held)
        return len(held)

    def clear(self, instance: str, tier: Tier | None = None) -> int:
        """Forget everything ``instance`` holds on ``tier`` (all tiers when None)."""
        bit = self._bit_of.get(instance)
        if bit is None:
            return 0
        w, m = divmod(bit, 64)
        flag = np.uint64(1 << m)
        removed = 0
        touched: list[npt.NDArray[np.int64]] = []
        for t in _TIERS if tier is None else (Tier(tier),):
            col = self._mask[t][: self._next, w]
            held = np.flatnonzero(col & flag)
            col[held] &= ~flag
            removed += len(held)
            self._count[t][instance] = 0
            touched.append(held)
        if touched:
            self._release(np.unique(np.concatenate(touched)))
        return removed

    def drop_instance(self, instance: str) -> int:
        """Remove all of ``instance``'s residency (crash, scale-down) and free its bit."""
        bit = self._bit_of.get(instance)
        if bit is None:
            return 0
        removed = self.clear(instance)
        self._bit_of = {k: v for k, v in self._bit_of.items() if k != instance}
        self._instance_at = {k: v for k, v in self._instance_at.items() if k != bit}
        for t in _TIERS:
            del self._count[t][instance]
        self._free_bits.append(bit)
        return removed

    def _release(self, slots: npt.NDArray[np.int64]) -> None:
        """Free the nodes among ``slots`` that no instance holds on any tier any more."""
        if len(slots) == 0:
            return
        live = np.zeros(len(slots), np.bool_)
        for t in _TIERS:
            live |= self._mask[t][slots].any(axis=1)
        dead = slots[~live]
        if len(dead) == 0:
            return
        self._index.delete(self._hash[dead])
        self._has_parent[dead] = False
        self._free = np.concatenate([self._free, dead])

    # -- queries ---------------------------------------------------------------------------------

    def match(self, hashes: Sequence[int] | npt.NDArray[np.uint64]) -> Mapping[InstanceId, Match]:
        """For every instance holding at least the first block: its leading run on GPU and on
        GPU or CPU. Instances with no leading block are absent."""
        if not len(hashes):
            return {}
        idx = self._index.get_prefix(np.asarray(hashes, np.uint64))
        if len(idx) == 0:
            return {}
        n_bits = 64 * self._words
        n_gpu = np.zeros(n_bits, np.int64)
        n_any = np.zeros(n_bits, np.int64)
        if not _leading_runs(self._mask[Tier.GPU], self._mask[Tier.CPU], idx, n_gpu, n_any):
            return {}
        return MatchResult(self._bit_of, self._instance_at, n_gpu, n_any)

    def resident(self, instance: str, tier: Tier) -> list[BlockHash]:
        """Every hash ``instance`` holds on ``tier`` (for resync dumps and tests)."""
        bit = self._bit_of.get(instance)
        if bit is None:
            return []
        w, m = divmod(bit, 64)
        col = self._mask[Tier(tier)][: self._next, w]
        held = np.flatnonzero(col & np.uint64(1 << m))
        return [BlockHash(h) for h in self._hash[held].tolist()]

    def node(self, block: int) -> tuple[int | None, int] | None:
        """``(parent hash or None, depth)`` of a known block, else None."""
        s = self._slot(block)
        if s < 0:
            return None
        parent = int(self._parent[s]) if self._has_parent[s] else None
        return parent, int(self._depth[s])

    def holders(self, block: int) -> dict[InstanceId, frozenset[Tier]]:
        s = self._slot(block)
        if s < 0:
            return {}
        out: dict[InstanceId, set[Tier]] = {}
        for t in _TIERS:
            bits = np.unpackbits(self._mask[t][s].view(np.uint8), bitorder="little")
            for b in np.flatnonzero(bits).tolist():
                out.setdefault(self._instance_at[b], set()).add(t)
        return {k: frozenset(v) for k, v in out.items()}

    def count(self, instance: str, tier: Tier) -> int:
        return self._count[Tier(tier)].get(instance, 0)

    def _slot(self, block: int) -> int:
        return int(self._index.get(np.asarray([block], np.uint64))[0])

    def __contains__(self, block: object) -> bool:
        return isinstance(block, int) and self._slot(block) >= 0

    def __len__(self) -> int:
        return len(self._index)

    def stats(self) -> CacheMapStats:
        return CacheMapStats(
            blocks=len(self._index),
            residency=sum(sum(c.values()) for c in self._count.values()),
            instances=len(self._bit_of),
            slot_capacity=len(self._hash),
            mask_words=self._words,
        )

    def check_integrity(self) -> None:
        """Raise RuntimeError if the derived state disagrees with the masks (tests, debugging)."""
        used = np.zeros(len(self._hash), np.bool_)
        keys, slots = self._index.items()
        used[slots] = True
        if len(np.unique(self._free)) != len(self._free) or used[self._free].any():
            raise RuntimeError("free list overlaps live slots")
        if len(slots) + len(self._free) != self._next:
            raise RuntimeError("slots leaked: live + free != handed out")
        if len(np.unique(slots)) != len(slots) or (self._hash[slots] != keys).any():
            raise RuntimeError("index and slot hashes disagree")
        if (self._index.get(keys) != slots).any():
            raise RuntimeError("an indexed key is not found by a probe")
        live = np.zeros(len(self._hash), np.bool_)
        for t in _TIERS:
            live |= self._mask[t].any(axis=1)
            counts = _bit_counts(self._mask[t][slots]) if len(slots) else None
            for inst, bit in self._bit_of.items():
                got = int(counts[bit]) if counts is not None else 0
                if got != self._count[t][inst]:
                    raise RuntimeError(f"count of {inst}/{t} is {self._count[t][inst]}, not {got}")
        if (live != used).any():
            raise RuntimeError("a node without residency is live, or a free slot has residency")
        stray = np.uint64(0)
        for t in _TIERS:
            free_bits = [b for b in range(64 * self._words) if b not in self._instance_at]
            for b in free_bits:
                w, m = divmod(b, 64)
                stray |= np.bitwise_or.reduce(self._mask[t][:, w] & np.uint64(1 << m))
        if stray:
            raise RuntimeError("a bit of a dropped or unknown instance is set")


@jit
def _leading_runs(gpu, cpu, idx, n_gpu, n_any):  # type: ignore[no-untyped-def]
    """For every instance bit, the leading run of rows ``idx`` holding it on GPU (into
    ``n_gpu``) and on GPU or CPU (into ``n_any``). Returns whether any bit has a run."""
    words = gpu.shape[1]
    run_g = gpu[idx[0]].copy()
    run_a = run_g | cpu[idx[0]]
    alive = False
    for w in range(words):
        if run_a[w]:
            alive = True
    if not alive:
        return False
    n = idx.shape[0]
    for i in range(1, n + 1):
        for w in range(words):
            if i < n:
                s = idx[i]
                new_g = run_g[w] & gpu[s, w]
                new_a = run_a[w] & (gpu[s, w] | cpu[s, w])
            else:
                new_g = np.uint64(0)
                new_a = np.uint64(0)
            # Bits that drop out at row i had a run of exactly i rows.
            d = run_g[w] & ~new_g
            b = 0
            while d:
                if d & np.uint64(1):
                    n_gpu[64 * w + b] = i
                d >>= np.uint64(1)
                b += 1
            d = run_a[w] & ~new_a
            b = 0
            while d:
                if d & np.uint64(1):
                    n_any[64 * w + b] = i
                d >>= np.uint64(1)
                b += 1
            run_g[w] = new_g
            run_a[w] = new_a
    return True


def _bit_counts(runs: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
    """Per instance bit, how many rows of ``runs`` (n x words) have it set."""
    bits = np.unpackbits(np.ascontiguousarray(runs).view(np.uint8), axis=1, bitorder="little")
    counts: npt.NDArray[np.int64] = bits.sum(axis=0, dtype=np.int64)
    return counts
