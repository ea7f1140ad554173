"""The global cache map: which engine instance holds which KV block on which tier.

Representation (built for tens of millions of resident blocks over a thousand instances):

- one ``HashIndex`` (flat numpy open addressing) ``block hash -> slot``;
- per slot, numpy columns: hash and parent hash (uint64), depth (int32), and its holders, in
  one of two forms:
  - *narrow* (most blocks: a conversation's private tail lives on one or two instances): up to
    ``INLINE`` holders inline, each a uint16 ``instance bit << 2 | tier flags`` (0: empty);
  - *wide* (a block held by more than ``INLINE`` instances, such as a shared system prompt): a
    row of two instance bitmasks (GPU, CPU), ``words`` uint64 words each (64 instances per
    word; the width grows as instances join), in a row pool the slot points into.

  A slot is promoted to a row when a holder does not fit inline, and keeps it until it is
  freed. So a private block costs ~60-85 bytes (its columns and index cells) whatever the
  cluster size, and a row's ``16 * words`` bytes are only spent on blocks shared widely enough
  to repay them (measured: ``benchmarks/cachemap_bench.py``).

A block's node lives while at least one instance holds it on some tier; the last removal frees
the slot (and its row) for reuse. Because hashes chain the whole prefix, ``match`` needs one
lookup per block (done as one vectorised probe), then one pass that runs an AND of the rows over
the widely shared head of the prompt and follows the few inline holders after it gives every
instance's leading run at once.

The passes over the columns are numba kernels (``cachemap.kernels``); ``match``'s answer is a
``MatchResult`` (``cachemap.match``).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

# NOTE: the kernels are called through their module, where ``cachemap.jit`` puts a kernel's
# compiled dispatcher after its first call; a name imported from it would stay the lazy wrapper,
# one Python call more per use
import cachemap.kernels as kernels
from cachemap.hashing import BlockHash, InstanceId, Tier, as_tier
from cachemap.index import HashIndex
from cachemap.jit import KERNELS
from cachemap.match import Match, MatchResult

_TIERS: tuple[Tier, ...] = tuple(Tier)
U64 = npt.NDArray[np.uint64]
_A = TypeVar("_A", bound=np.generic)


class CacheMapStats(NamedTuple):
    blocks: int  # distinct blocks resident anywhere
    residency: int  # (block, instance, tier) entries
    instances: int
    slot_capacity: int
    mask_words: int  # uint64 words per tier in a wide block's row
    wide_blocks: int = 0  # blocks held by more instances than fit inline (each has a row)


INLINE = 4  # holders a narrow slot keeps inline
MAX_INSTANCES = 1 << 14  # an inline holder is a uint16: instance bit << 2 | tier flags
_FLAG = {t: 1 << i for i, t in enumerate(_TIERS)}  # a tier's flag in an inline holder


class CacheMap:
    """Per-instance, per-tier block residency keyed by chained block hash. Not thread-safe.

    ``stride``: the map holds every ``stride``-th block of a prompt only (the engines' KV
    events carry no others: ``EngineEventTranslator``'s ``stride``), so each entry stands for a
    run of ``stride`` engine blocks ending at it. ``match`` still takes every block's hash and
    answers in engine blocks (whole runs: a prefix ending inside a run counts up to the run
    before it), and ``count`` estimates engine blocks; ``store``, ``remove`` and ``resident``
    deal in the kept hashes."""

    def __init__(self, initial_slots: int = 1024, stride: int = 1) -> None:
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        self.stride = stride
        cap = max(16, initial_slots)
        self._index = HashIndex(cap)
        # released slots, reused first (last in, first out): a stack, ``_free[:_n_free]``, as
        # long as the slot columns (a slot is free at most once), that the kernels push and pop
        self._free = np.zeros(cap, np.int64)
        self._n_free = 0
        self._next = 0  # slots [0, _next) have been handed out at least once
        self._words = 1
        self._hash = np.zeros(cap, np.uint64)
        self._parent = np.zeros(cap, np.uint64)
        self._has_parent = np.zeros(cap, np.bool_)
        self._depth = np.zeros(cap, np.int32)
        self._hold = np.zeros((cap, INLINE), np.uint16)
        self._wide = np.full(cap, -1, np.int32)
        # the rows of wide slots: per tier a bitmask of ``_words`` words per row
        rows = 16
        self._rows = {t: np.zeros((rows, 1), np.uint64) for t in _TIERS}
        self._free_rows: list[int] = []
        self._next_row = 0
        self._bit_of: dict[str, int] = {}
        self._instance_at: dict[int, InstanceId] = {}
        self._free_bits: list[int] = []
        self._count = {t: dict[str, int]() for t in _TIERS}
        # the same counts by instance bit, for a caller that weighs many instances in numpy
        self._count_at = {t: np.zeros(64, np.int64) for t in _TIERS}

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
            if bit >= MAX_INSTANCES:
                raise ValueError(f"the cache map holds at most {MAX_INSTANCES} instances")
            if bit >= 64 * self._words:
                self._resize_rows(len(self._rows[Tier.GPU]), self._words * 2)
        # NOTE: copy-on-write, so MatchResults handed out keep a consistent roster.
        self._bit_of = {**self._bit_of, instance: bit}
        self._instance_at = {**self._instance_at, bit: InstanceId(instance)}
        for t in _TIERS:
            self._count[t][instance] = 0
            if bit >= len(self._count_at[t]):
                grown = np.zeros(2 * bit, np.int64)
                grown[: len(self._count_at[t])] = self._count_at[t]
                self._count_at[t] = grown
            self._count_at[t][bit] = 0
        return bit

    def _resize(self, slots: int) -> None:
        n = len(self._hash)

        def grow(a: npt.NDArray[_A], fill: int = 0) -> npt.NDArray[_A]:
            out = np.full((slots, *a.shape[1:]), fill, a.dtype)
            out[:n] = a
            return out

        self._hash = grow(self._hash)
        self._parent = grow(self._parent)
        self._has_parent = grow(self._has_parent)
        self._depth = grow(self._depth)
        self._hold = grow(self._hold)
        self._wide = grow(self._wide, -1)
        self._free = grow(self._free)

    def _resize_rows(self, rows: int, words: int) -> None:
        for t in _TIERS:
            old = self._rows[t]
            m = np.zeros((rows, words), np.uint64)
            m[: len(old), : old.shape[1]] = old
            self._rows[t] = m
        self._words = words

    def _alloc_rows(self, n: int) -> npt.NDArray[np.int64]:
        reuse = min(n, len(self._free_rows))
        got = np.array(self._free_rows[len(self._free_rows) - reuse :], np.int64)
        del self._free_rows[len(self._free_rows) - reuse :]
        fresh = n - reuse
        size = len(self._rows[Tier.GPU])
        if self._next_row + fresh > size:
            self._resize_rows(_doubled(size, self._next_row + fresh), self._words)
        out: npt.NDArray[np.int64] = np.concatenate(
            [got, np.arange(self._next_row, self._next_row + fresh, dtype=np.int64)]
        )
        self._next_row += fresh
        return out

    def _holders(self) -> tuple[npt.NDArray[np.uint16], npt.NDArray[np.int32], U64, U64]:
        """The holder columns as the kernels take them: inline holders, row of each slot, and
        the GPU and CPU rows."""
        return self._hold, self._wide, self._rows[Tier.GPU], self._rows[Tier.CPU]

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
        return self.store_chains(instance, tier, ((hashes, parent, depth),))

    def store_chains(
        self,
        instance: str,
        tier: Tier,
        chains: Sequence[tuple[Sequence[int], int | None, int]],
    ) -> int:
        """``store`` of each ``(hashes, parent, depth)`` of ``chains`` in turn, in one pass:
        the same map and count as the calls one after another (a hash in two chains is one
        node, defined where it first stands). An engine's batch of KV events is mostly short
        chains (a decoded block each); one pass costs the kernels' calls once for all."""
        flat: list[int] = []
        roots: list[int] = []
        meta: list[int] = []  # per chain: start in flat, depth, rooted
        for hashes, parent, depth in chains:
            if len(hashes):
                meta += (len(flat), depth, parent is not None)
                roots.append(parent if parent is not None else 0)
                flat.extend(hashes)
        n = len(flat)
        if not n:
            return 0
        tier = as_tier(tier)
        bit = self._bit(instance)  # NOTE: before _holders: a new bit may widen the rows
        flag = _FLAG[tier]
        flat += roots
        hs = np.asarray(flat, np.uint64)
        # NOTE: room for every hash being new, so that one kernel finds the hashes, adds the
        # holder to the known ones, and takes slots for the new ones (a hash may repeat within
        # one call: its first position defines the node) and puts them in the index
        if self._next + n - self._n_free > len(self._hash):
            self._resize(_doubled(len(self._hash), self._next + n - self._n_free))
        index = self._index
        index.reserve(n)
        added, reused, grown, cells, full = kernels._store(
            *index.table(),
            *self._holders(),
            self._hash,
            self._parent,
            self._has_parent,
            self._depth,
            *self._stack(),
            self._next,
            hs,
            np.asarray(meta, np.int64),
            bit,
            flag,
        )
        self._n_free -= reused
        self._next += grown
        index.inserted(reused + grown, cells)
        if len(full):  # narrow slots with no room left for the holder
            full = np.unique(full)
            at_rows = self._alloc_rows(len(full))
            # NOTE: after _alloc_rows, which may regrow the rows
            added += kernels._promote(*self._holders(), full, at_rows, bit, flag)
        self._count[tier][instance] += added
        self._count_at[tier][bit] += added
        return int(added)

    def remove(self, instance: str, tier: Tier, hashes: Iterable[int]) -> int:
        """Forget ``instance``'s copies of ``hashes`` on ``tier``; unknown hashes are ignored.
        Returns how many entries were removed."""
        tier = as_tier(tier)
        bit = self._bit_of.get(instance)
        if bit is None:
            return 0
        hs = np.fromiter(hashes, np.uint64)
        # NOTE: one kernel finds the slots, removes the holder, takes the nodes left with none
        # out of the index and frees their slots (``_recycle``); only their rows come back
        held, n_dead, rows = kernels._remove(
            *self._index.table(),
            hs,
            *self._holders(),
            bit,
            _FLAG[tier],
            self._has_parent,
            *self._stack(),
        )
        self._count[tier][instance] -= held
        self._count_at[tier][bit] -= held
        if n_dead:
            self._index.deleted(n_dead)
            self._freed(n_dead, rows)
        return int(held)

    def clear(self, instance: str, tier: Tier | None = None) -> int:
        """Forget everything ``instance`` holds on ``tier`` (all tiers when None)."""
        bit = self._bit_of.get(instance)
        if bit is None:
            return 0
        tiers = _TIERS if tier is None else (as_tier(tier),)
        flags = sum(_FLAG[t] for t in tiers)
        hold = self._hold[: self._next]
        mine = (hold >> 2 == bit) & (hold & flags != 0)
        touched = [np.flatnonzero(mine.any(axis=1))]
        wide = np.flatnonzero(self._wide[: self._next] >= 0)
        w, m = divmod(bit, 64)
        flag = np.uint64(1 << m)
        removed = 0
        for t in tiers:
            removed += int((mine & (hold & _FLAG[t] != 0)).sum())
            col = self._rows[t][self._wide[wide], w]
            held = col & flag != 0
            self._rows[t][self._wide[wide[held]], w] &= ~flag
            removed += int(held.sum())
            touched.append(wide[held])
            self._count[t][instance] = 0
            self._count_at[t][bit] = 0
        left = np.where(mine, hold & ~np.uint16(flags), hold)
        hold[:] = np.where(left & 3 == 0, 0, left)
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

    def _live(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """Whether each of ``slots`` has a holder on some tier."""
        live = np.asarray(self._hold[slots].any(axis=1), np.bool_)
        rows = self._wide[slots]
        wide = rows >= 0
        for t in _TIERS:
            live[wide] |= self._rows[t][rows[wide]].any(axis=1)
        return live

    def _release(self, slots: npt.NDArray[np.int64]) -> None:
        """Free the nodes among ``slots`` that no instance holds on any tier any more."""
        if len(slots) == 0:
            return
        dead = slots[~self._live(slots)]
        if len(dead) > 0:
            self._index.delete(self._hash[dead])
            self._recycle(dead)

    def _recycle(self, dead: npt.NDArray[np.int64]) -> None:
        """Slots ``dead`` (distinct, ascending, out of the index) and their rows become free."""
        rows = kernels._free_slots(dead, self._has_parent, self._wide, *self._stack())
        self._freed(len(dead), rows)

    def _stack(self) -> tuple[npt.NDArray[np.int64], int]:
        """The free-slot stack as the kernels take it: ``free[:n_free]``."""
        return self._free, self._n_free

    def _freed(self, n: int, rows: npt.NDArray[np.int64]) -> None:
        """A kernel pushed ``n`` slots on the free stack (``kernels._free_slots``), which had
        ``rows``."""
        self._n_free += n
        if len(rows):
            self._free_rows.extend(rows.tolist())

    # -- queries ---------------------------------------------------------------------------------

    def match(self, hashes: Sequence[int] | npt.NDArray[np.uint64]) -> Mapping[str, Match]:
        """For every instance holding at least the first block: its leading run on GPU and on
        GPU or CPU. Instances with no leading block are absent."""
        if not len(hashes):
            return {}
        k = self.stride
        keys = np.asarray(hashes if k == 1 else hashes[k - 1 :: k], np.uint64)
        bits, packed, dense = kernels._match(*self._index.table(), keys, *self._holders(), k)
        if len(dense):
            return MatchResult(self._bit_of, self._instance_at, array("q", dense.tobytes()))
        if len(bits) == 0:
            return {}
        runs = dict(zip(bits.tolist(), packed.tolist(), strict=True))
        return MatchResult(self._bit_of, self._instance_at, runs)

    def _held(self, bit: int, tier: Tier) -> npt.NDArray[np.int64]:
        """The slots where instance ``bit`` holds a block on ``tier``, ascending."""
        hold = self._hold[: self._next]
        inline = np.flatnonzero(((hold >> 2 == bit) & (hold & _FLAG[tier] != 0)).any(axis=1))
        wide = np.flatnonzero(self._wide[: self._next] >= 0)
        w, m = divmod(bit, 64)
        col = self._rows[tier][self._wide[wide], w]
        return np.union1d(inline, wide[col & np.uint64(1 << m) != 0])

    def resident(self, instance: str, tier: Tier) -> list[BlockHash]:
        """Every hash ``instance`` holds on ``tier`` (for resync dumps and tests)."""
        bit = self._bit_of.get(instance)
        if bit is None:
            return []
        return [BlockHash(h) for h in self._hash[self._held(bit, as_tier(tier))].tolist()]

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
        row = int(self._wide[s])
        for t in _TIERS:
            if row >= 0:
                bits = np.unpackbits(self._rows[t][row].view(np.uint8), bitorder="little")
                held = np.flatnonzero(bits).tolist()
            else:
                held = [int(e) >> 2 for e in self._hold[s].tolist() if e & _FLAG[t]]
            for b in held:
                out.setdefault(self._instance_at[b], set()).add(t)
        return {k: frozenset(v) for k, v in out.items()}

    def counts(self, tier: Tier) -> Mapping[str, int]:
        """Entries per instance on ``tier``, live and read-only (times ``stride``: engine
        blocks), for a caller that asks about many instances at once."""
        return MappingProxyType(self._count[as_tier(tier)])

    def counts_by_bit(self, tier: Tier) -> tuple[Mapping[str, int], npt.NDArray[np.int64]]:
        """``counts(tier)`` for numpy: (each instance's bit, the entries per bit), both live
        and read-only by contract. The bit mapping is replaced, never changed in place, when an
        instance joins or leaves: a caller that keeps something per bit can tell by identity
        when to redo it. The array may be replaced as the map grows: ask again per use."""
        return self._bit_of, self._count_at[as_tier(tier)]

    def count(self, instance: str, tier: Tier) -> int:
        """Engine blocks ``instance`` holds on ``tier`` (entries times ``stride``)."""
        return self._count[as_tier(tier)].get(instance, 0) * self.stride

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
            wide_blocks=self._next_row - len(self._free_rows),
        )

    def check_integrity(self) -> None:
        """Raise RuntimeError if the derived state disagrees with the holders (tests,
        debugging)."""
        self._index.check_counts()
        used = np.zeros(len(self._hash), np.bool_)
        keys, slots = self._index.items()
        used[slots] = True
        free = self._free[: self._n_free]
        if len(np.unique(free)) != len(free) or used[free].any():
            raise RuntimeError("free list overlaps live slots")
        if len(slots) + len(free) != self._next:
            raise RuntimeError("slots leaked: live + free != handed out")
        if len(np.unique(slots)) != len(slots) or (self._hash[slots] != keys).any():
            raise RuntimeError("index and slot hashes disagree")
        if (self._index.get(keys) != slots).any():
            raise RuntimeError("an indexed key is not found by a probe")
        everything = np.arange(len(self._hash), dtype=np.int64)
        if (self._live(everything) != used).any():
            raise RuntimeError("a node without residency is live, or a free slot has residency")
        rows = self._wide[slots]
        wide_slots, rows = slots[rows >= 0], rows[rows >= 0]
        if self._hold[wide_slots].any():
            raise RuntimeError("a wide slot has inline holders")
        if (self._wide[~used] >= 0).any():
            raise RuntimeError("a free slot keeps a row")
        if len(np.unique(rows)) != len(rows) or set(rows.tolist()) & set(self._free_rows):
            raise RuntimeError("a row is shared or both used and free")
        if len(rows) + len(self._free_rows) != self._next_row:
            raise RuntimeError("rows leaked: used + free != handed out")
        hold = self._hold[slots]
        who = (hold >> 2).astype(np.int64)
        for s in range(len(hold)):
            held = who[s][hold[s] != 0]
            if len(np.unique(held)) != len(held):
                raise RuntimeError("an instance is inline twice in one slot")
        n_bits = 64 * self._words
        for t in _TIERS:
            inline = np.bincount(who[hold & _FLAG[t] != 0], minlength=n_bits)
            counts = inline[:n_bits] + _bit_counts(self._rows[t][rows], n_bits)
            stray = [b for b in np.flatnonzero(counts).tolist() if b not in self._instance_at]
            if len(inline) > n_bits or stray:
                raise RuntimeError("a bit of a dropped or unknown instance is set")
            for inst, bit in self._bit_of.items():
                if int(counts[bit]) != self._count[t][inst] or int(self._count_at[t][bit]) != int(
                    counts[bit]
                ):
                    raise RuntimeError(
                        f"count of {inst}/{t} is {self._count[t][inst]} "
                        f"({int(self._count_at[t][bit])} by bit), not {int(counts[bit])}"
                    )


def _doubled(size: int, need: int) -> int:
    """``size`` doubled until it holds ``need``."""
    while size < need:
        size *= 2
    return size


def _bit_counts(rows: npt.NDArray[np.uint64], n_bits: int) -> npt.NDArray[np.int64]:
    """Per instance bit, how many of ``rows`` (n x words) have it set."""
    if len(rows) == 0:
        return np.zeros(n_bits, np.int64)
    bits = np.unpackbits(np.ascontiguousarray(rows).view(np.uint8), axis=1, bitorder="little")
    counts: npt.NDArray[np.int64] = bits.sum(axis=0, dtype=np.int64)
    return counts


def warm_kernels() -> list[str]:
    """Compile the kernels, or load them from numba's on-disk cache, by running a small cache
    map through every call that uses one: a block stored new, stored again on another tier,
    held by more instances than a narrow row holds, the index grown, matched, looked up,
    removed, an instance dropped. Returns the names of the kernels (``cachemap.jit.KERNELS``)
    compiled by now, in definition order.

    ``make native`` (``python -m deploy.native build``) calls it, so that the cache is filled
    when the code is installed: the first cache map a process uses then loads every kernel
    (~1 s) instead of compiling them (~10 s of one core, here), which an ingress replica
    would otherwise pay at its first KV events and a fresh checkout's test workers each once."""
    chain = list(range(1, 9))
    cmap = CacheMap()
    cmap.store("e0", Tier.GPU, chain)
    cmap.store_chains("e1", Tier.CPU, ((chain[:4], None, 0), ([100, 101], chain[3], 4)))
    for i in range(2, 130):  # past a narrow row's holders
        cmap.store(f"e{i}", Tier.GPU, chain[:2])
    cmap.store("e0", Tier.GPU, range(1000, 4000))  # past the index's first table: a rehash
    cmap.match(chain)
    cmap.remove("e0", Tier.GPU, chain[4:])
    cmap.drop_instance("e1")
    cmap.match(chain)
    cmap.holders(chain[0])
    cmap.check_integrity()
    return [k.fn.__name__ for k in KERNELS if k.compiled is not None]
