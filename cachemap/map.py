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
from itertools import compress
from typing import NamedTuple, TypeVar, overload

import numpy as np
import numpy.typing as npt

from cachemap.hashing import BlockHash, InstanceId, Tier, as_tier
from cachemap.index import TOMBSTONE, HashIndex, _probe
from cachemap.jit import jit

_TIERS: tuple[Tier, ...] = tuple(Tier)
_new_tuple = tuple.__new__
_T = TypeVar("_T")


class Match(NamedTuple):
    """Leading blocks of a prompt resident on one instance."""

    gpu_blocks: int  # leading blocks on GPU
    total_blocks: int  # leading blocks on GPU or CPU (>= gpu_blocks)

    @property
    def cpu_blocks(self) -> int:
        """Blocks after the GPU run that would be loaded from the CPU tier."""
        return self.total_blocks - self.gpu_blocks


class MatchResult(Mapping[str, Match]):
    """``match``'s answer: a read-only mapping built lazily from per-instance-bit run lengths, so
    a prefix held by dozens of instances costs nothing until a scorer asks about them. Keyed by
    plain ``str``, as scorers and views name instances (its keys are ``InstanceId``s)."""

    __slots__ = ("_bit_of", "_instance_at", "_n_any", "_n_gpu")

    def __init__(
        self,
        bit_of: dict[str, int],
        instance_at: dict[int, InstanceId],
        n_gpu: list[int],
        n_any: list[int],
    ) -> None:
        self._bit_of, self._instance_at = bit_of, instance_at
        self._n_gpu, self._n_any = n_gpu, n_any

    def __getitem__(self, instance: str) -> Match:
        m = self.get(instance)
        if m is None:
            raise KeyError(instance)
        return m

    # NOTE: scorers call ``get`` once per candidate on every placement; the Mapping mixin's
    # version goes through ``__getitem__`` and a raised KeyError for every instance without a hit.
    @overload
    def get(self, instance: str, /) -> Match | None: ...
    @overload
    def get(self, instance: str, /, default: Match | _T) -> Match | _T: ...
    def get(self, instance: str, /, default: object = None) -> object:
        b = self._bit_of.get(instance)
        if b is None:
            return default
        n_any = self._n_any[b]
        if not n_any:
            return default
        # NOTE: ``Match(g, a)`` is this through the namedtuple's Python-level ``__new__``
        return _new_tuple(Match, (self._n_gpu[b], n_any))

    def __contains__(self, instance: object) -> bool:
        return isinstance(instance, str) and self.get(instance) is not None

    def __iter__(self) -> Iterator[InstanceId]:
        inst, n_any = self._instance_at, self._n_any
        return (inst[b] for b in compress(range(len(n_any)), n_any) if b in inst)

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
        # released slots, reused first (last in, first out); a list, as it grows and shrinks
        # by a few slots per call
        self._free: list[int] = []
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
        tier = as_tier(tier)
        bit = self._bit(instance)
        hs = np.asarray(hashes, np.uint64)
        w, m = divmod(bit, 64)
        # NOTE: one kernel finds the hashes, sets the bit on the known ones and lists the new
        # ones (a hash may repeat within one call: its first position defines the node)
        added, pos = _store_known(*self._index.table(), hs, self._mask[tier], w, m)
        if len(pos):
            at = self._alloc(len(pos))
            self._index.insert(hs[pos], at)
            added += _store_new(
                self._hash,
                self._parent,
                self._has_parent,
                self._depth,
                at,
                hs,
                pos,
                np.uint64(parent if parent is not None else 0),
                parent is not None,
                depth,
                self._mask[tier],  # NOTE: after _alloc, which may regrow it
                w,
                m,
            )
        self._count[tier][instance] += added
        return int(added)

    def _alloc(self, n: int) -> npt.NDArray[np.int64]:
        reuse = min(n, len(self._free))
        got = np.array(self._free[len(self._free) - reuse :], np.int64)
        del self._free[len(self._free) - reuse :]
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
        tier = as_tier(tier)
        bit = self._bit_of.get(instance)
        if bit is None:
            return 0
        hs = np.fromiter(hashes, np.uint64)
        w, m = divmod(bit, 64)
        dead = np.empty(len(hs), np.int64)
        # NOTE: one kernel finds the slots, clears the bits and takes the nodes left with no
        # holder out of the index (the rest of ``_free_slots`` follows)
        mask = self._mask
        held, n_dead = _remove(
            *self._index.table(), hs, mask[tier], mask[Tier.GPU], mask[Tier.CPU], w, m, dead
        )
        self._count[tier][instance] -= held
        if n_dead:
            self._index.deleted(n_dead)
            dead = np.sort(dead[:n_dead])
            self._has_parent[dead] = False
            self._free.extend(dead.tolist())
        return int(held)

    def clear(self, instance: str, tier: Tier | None = None) -> int:
        """Forget everything ``instance`` holds on ``tier`` (all tiers when None)."""
        bit = self._bit_of.get(instance)
        if bit is None:
            return 0
        w, m = divmod(bit, 64)
        flag = np.uint64(1 << m)
        removed = 0
        touched: list[npt.NDArray[np.int64]] = []
        for t in _TIERS if tier is None else (as_tier(tier),):
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
        if len(dead) > 0:
            self._free_slots(dead)

    def _free_slots(self, dead: npt.NDArray[np.int64]) -> None:
        """Free the nodes at ``dead`` (distinct slots, ascending), which nothing holds any more."""
        self._index.delete(self._hash[dead])
        self._has_parent[dead] = False
        self._free.extend(dead.tolist())

    # -- queries ---------------------------------------------------------------------------------

    def match(self, hashes: Sequence[int] | npt.NDArray[np.uint64]) -> Mapping[str, Match]:
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
        return MatchResult(self._bit_of, self._instance_at, n_gpu.tolist(), n_any.tolist())

    def resident(self, instance: str, tier: Tier) -> list[BlockHash]:
        """Every hash ``instance`` holds on ``tier`` (for resync dumps and tests)."""
        bit = self._bit_of.get(instance)
        if bit is None:
            return []
        w, m = divmod(bit, 64)
        col = self._mask[as_tier(tier)][: self._next, w]
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
        return self._count[as_tier(tier)].get(instance, 0)

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
        free = np.array(self._free, np.int64)
        if len(np.unique(free)) != len(free) or used[free].any():
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


@jit
def _remove(tk, tv, shift, tmask, keys, mask, gpu, cpu, w, m, dead):  # type: ignore[no-untyped-def]
    """Clear bit ``m`` of word ``w`` in ``mask``'s rows of ``keys`` (found in the index table
    ``tk``, ``tv``, ``shift``, ``tmask``: ``HashIndex.table``; absent keys and rows without
    the bit are skipped, a key may repeat). Rows left with no bit on either tier (``gpu``,
    ``cpu``) go to ``dead``, in order, and their keys are tombstoned in the table afterwards,
    as ``HashIndex.delete`` would. Returns (rows cleared, dead rows)."""
    flag = np.uint64(1) << np.uint64(m)
    words = mask.shape[1]
    cells = np.empty(keys.shape[0], np.int64)
    held = 0
    n_dead = 0
    for i in range(keys.shape[0]):
        s, p = _probe(tk, tv, shift, tmask, keys[i])
        if s < 0 or not mask[s, w] & flag:
            continue
        mask[s, w] &= ~flag
        held += 1
        live = False
        for v in range(words):
            if gpu[s, v] or cpu[s, v]:
                live = True
                break
        if not live:
            dead[n_dead] = s
            cells[n_dead] = p
            n_dead += 1
    for j in range(n_dead):
        tv[cells[j]] = TOMBSTONE
    return held, n_dead


@jit
def _store_known(tk, tv, shift, tmask, keys, mask, w, m):  # type: ignore[no-untyped-def]
    """Set bit ``m`` of word ``w`` in ``mask``'s rows of the ``keys`` the index table holds
    (``HashIndex.table``; a key may repeat). Returns (rows that did not have it yet, the
    position of the first occurrence of each absent key, in ascending key order)."""
    flag = np.uint64(1) << np.uint64(m)
    n = keys.shape[0]
    miss = np.empty(n, np.int64)
    n_miss = 0
    added = 0
    for i in range(n):
        s = _probe(tk, tv, shift, tmask, keys[i])[0]
        if s < 0:
            miss[n_miss] = i
            n_miss += 1
        elif not mask[s, w] & flag:
            mask[s, w] |= flag
            added += 1
    miss = miss[:n_miss]
    missing_keys = keys[miss]
    order = np.argsort(missing_keys, kind="mergesort")  # stable: equal keys keep their first
    out = np.empty(n_miss, np.int64)
    n_out = 0
    for j in range(n_miss):
        if j == 0 or missing_keys[order[j]] != missing_keys[order[j - 1]]:
            out[n_out] = miss[order[j]]
            n_out += 1
    return added, out[:n_out]


@jit
def _store_new(hash_, parent, has_parent, depth, at, hs, pos, root, has_root, depth0, mask, w, m):  # type: ignore[no-untyped-def]
    """Fill the columns of new slots ``at``, each the node of chain position ``pos`` (the chain
    ``hs`` starts at ``depth0`` below ``root``, a parent only when ``has_root``), and set bit
    ``m`` of word ``w`` in their ``mask`` rows. Returns how many rows got it."""
    flag = np.uint64(1) << np.uint64(m)
    added = 0
    for j in range(at.shape[0]):
        s, p = at[j], pos[j]
        hash_[s] = hs[p]
        if p > 0:
            parent[s], has_parent[s] = hs[p - 1], True
        else:
            parent[s], has_parent[s] = root, has_root
        depth[s] = depth0 + p
        if not mask[s, w] & flag:
            mask[s, w] |= flag
            added += 1
    return added


def _bit_counts(runs: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
    """Per instance bit, how many rows of ``runs`` (n x words) have it set."""
    bits = np.unpackbits(np.ascontiguousarray(runs).view(np.uint8), axis=1, bitorder="little")
    counts: npt.NDArray[np.int64] = bits.sum(axis=0, dtype=np.int64)
    return counts
