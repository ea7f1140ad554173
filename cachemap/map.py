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
"""

from __future__ import annotations

from array import array
from collections.abc import ItemsView, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple, TypeVar, overload

import numpy as np
import numpy.typing as npt

from cachemap.hashing import BlockHash, InstanceId, Tier, as_tier
from cachemap.index import TOMBSTONE, HashIndex, _insert, _probe
from cachemap.jit import KERNELS, jit

_TIERS: tuple[Tier, ...] = tuple(Tier)
_new_tuple = tuple.__new__
_LOW = (1 << 32) - 1
U64 = npt.NDArray[np.uint64]
_T = TypeVar("_T")
_A = TypeVar("_A", bound=np.generic)


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

    __slots__ = ("_bit_of", "_instance_at", "_runs")

    def __init__(
        self,
        bit_of: dict[str, int],
        instance_at: dict[int, InstanceId],
        runs: array[int] | dict[int, int],
    ) -> None:
        """``runs``: per instance bit its runs packed as ``gpu_blocks << 32 | total_blocks``
        (0: none), as an int64 ``array`` indexed by bit (many holders: a copy of the kernel's
        answer, where a list would make an int object per bit) or a dict of the bits that have
        one (a few)."""
        self._bit_of, self._instance_at, self._runs = bit_of, instance_at, runs

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
        runs = self._runs
        v = runs.get(b, 0) if isinstance(runs, dict) else runs[b]
        if not v:
            return default
        # NOTE: ``Match(g, a)`` is this through the namedtuple's Python-level ``__new__``
        return _new_tuple(Match, (v >> 32, v & _LOW))

    def __contains__(self, instance: object) -> bool:
        return isinstance(instance, str) and self.get(instance) is not None

    def __iter__(self) -> Iterator[InstanceId]:
        inst, runs = self._instance_at, self._runs
        if isinstance(runs, dict):
            return (inst[b] for b, v in runs.items() if v and b in inst)
        held = np.flatnonzero(np.frombuffer(runs, np.int64)).tolist()
        return (inst[b] for b in held if b in inst)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"MatchResult({dict(self.items())!r})"

    def items(self) -> ItemsView[str, Match]:
        return _MatchItems(self)

    def _pairs(self) -> Iterator[tuple[str, Match]]:
        inst, runs = self._instance_at, self._runs
        if isinstance(runs, dict):
            held = [b for b, v in runs.items() if v]
        else:
            held = np.flatnonzero(np.frombuffer(runs, np.int64)).tolist()
        for b in held:
            iid = inst.get(b)
            if iid is not None:
                v = runs[b]
                yield iid, _new_tuple(Match, (v >> 32, v & _LOW))


class _MatchItems(ItemsView[str, Match]):
    """``MatchResult.items()``: the pairs straight from the runs (a scorer walks them on every
    placement), not a ``get`` per key."""

    _mapping: MatchResult

    def __iter__(self) -> Iterator[tuple[str, Match]]:
        return self._mapping._pairs()


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
        added, reused, grown, cells, full = _store(
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
            added += _promote(*self._holders(), full, at_rows, bit, flag)
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
        held, n_dead, rows = _remove(
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
        self._freed(len(dead), _free_slots(dead, self._has_parent, self._wide, *self._stack()))

    def _stack(self) -> tuple[npt.NDArray[np.int64], int]:
        """The free-slot stack as the kernels take it: ``free[:n_free]``."""
        return self._free, self._n_free

    def _freed(self, n: int, rows: npt.NDArray[np.int64]) -> None:
        """A kernel pushed ``n`` slots on the free stack (``_free_slots``), which had ``rows``."""
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
        bits, packed, dense = _match(*self._index.table(), keys, *self._holders(), k)
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


@jit
def _tiers_at(hold, wide, gpu, cpu, s, b):  # type: ignore[no-untyped-def]
    """The tier flags (1 GPU, 2 CPU) instance bit ``b`` holds slot ``s`` with."""
    r = wide[s]
    if r >= 0:
        w, m = b >> 6, np.uint64(b & 63)
        return np.int64((gpu[r, w] >> m) & np.uint64(1)) | np.int64(
            ((cpu[r, w] >> m) & np.uint64(1)) << np.uint64(1)
        )
    for k in range(hold.shape[1]):
        e = np.int64(hold[s, k])
        if e and e >> 2 == b:
            return e & 3
    return 0


@jit
def _drops(d, w, i, out):  # type: ignore[no-untyped-def]
    """Write ``i`` into ``out`` at the bits set in word ``d`` (word ``w`` of a bitmask)."""
    b = 0
    while d:
        if d & np.uint64(1):
            out[64 * w + b] = i
        d >>= np.uint64(1)
        b += 1


@jit
def _match(tk, tv, shift, tmask, keys, hold, wide, gpu, cpu, scale):  # type: ignore[no-untyped-def]
    """Every instance bit's leading run of ``keys`` (found in the index table ``tk``, ``tv``,
    ``shift``, ``tmask``: ``HashIndex.table``) on GPU and on GPU or CPU, times ``scale``, packed
    as ``gpu << 32 | any``, for the bits holding the first key: as a dense array indexed by bit
    when that block is wide, else as (bits, packed runs) of its few inline holders.

    While the slots are wide, the rows are ANDed a word at a time and each bit that drops out
    at position ``i`` gets a run of ``i``; at the first narrow slot only its few inline holders
    can go on, and are followed one by one from there."""
    idx = np.empty(keys.shape[0], np.int64)
    n = 0
    for j in range(keys.shape[0]):
        v = _probe(tk, tv, shift, tmask, keys[j])[0]
        if v < 0:
            break
        idx[j] = v
        n += 1
    inline = hold.shape[1]
    words = gpu.shape[1]
    cand = np.empty(inline, np.int64)  # the bits followed one by one
    cg = np.empty(inline, np.int64)  # their GPU run's end (-1: still running)
    ca = np.empty(inline, np.int64)
    nc = 0
    i = 1
    dense_start = n > 0 and wide[idx[0]] >= 0
    ng = np.zeros(64 * words if dense_start else 0, np.int64)
    na = np.zeros(64 * words if dense_start else 0, np.int64)
    if dense_start:
        r0 = wide[idx[0]]
        run_g = gpu[r0].copy()
        run_a = run_g | cpu[r0]
        alive = True
        while i < n and wide[idx[i]] >= 0 and alive:
            r = wide[idx[i]]
            alive = False
            for w in range(words):
                new_g = run_g[w] & gpu[r, w]
                new_a = run_a[w] & (gpu[r, w] | cpu[r, w])
                _drops(run_g[w] & ~new_g, w, i, ng)
                _drops(run_a[w] & ~new_a, w, i, na)
                run_g[w] = new_g
                run_a[w] = new_a
                if new_a:
                    alive = True
            i += 1
        if alive and i < n:
            # a narrow slot: only its inline holders still in the run go on, from here
            s = idx[i]
            for k in range(inline):
                e = np.int64(hold[s, k])
                if not e:
                    continue
                hb = e >> 2
                hw, hm = hb >> 6, np.uint64(hb & 63)
                if not (run_a[hw] >> hm) & np.uint64(1):
                    continue
                cand[nc] = hb
                cg[nc] = -1 if (run_g[hw] >> hm) & np.uint64(1) else ng[hb]
                ca[nc] = -1
                nc += 1
                run_g[hw] &= ~(np.uint64(1) << hm)
                run_a[hw] &= ~(np.uint64(1) << hm)
        for w in range(words):  # the rest of the run ends here
            _drops(run_g[w], w, i, ng)
            _drops(run_a[w], w, i, na)
    elif n > 0:
        s = idx[0]
        for k in range(inline):
            e = np.int64(hold[s, k])
            if e:
                cand[nc] = e >> 2
                cg[nc] = -1 if e & 1 else 0
                ca[nc] = -1
                nc += 1
    left = nc
    while i < n and left:
        s = idx[i]
        for c in range(nc):
            if ca[c] >= 0:
                continue
            t = _tiers_at(hold, wide, gpu, cpu, s, cand[c])
            if cg[c] < 0 and not t & 1:
                cg[c] = i
            if not t:
                ca[c] = i
                left -= 1
        i += 1
    for c in range(1, nc):  # in bit order, as the dense form iterates
        j = c
        while j > 0 and cand[j - 1] > cand[j]:
            cand[j - 1], cand[j] = cand[j], cand[j - 1]
            cg[j - 1], cg[j] = cg[j], cg[j - 1]
            ca[j - 1], ca[j] = ca[j], ca[j - 1]
            j -= 1
    bits = np.empty(0 if dense_start else nc, np.int64)
    packed = np.empty(0 if dense_start else nc, np.int64)
    dense = np.empty(64 * words if dense_start else 0, np.int64)
    if dense_start:
        for d in range(dense.shape[0]):
            dense[d] = ng[d] * scale << 32 | na[d] * scale
    for c in range(nc):
        g = (n if cg[c] < 0 else cg[c]) * scale
        a = (n if ca[c] < 0 else ca[c]) * scale
        if dense_start:
            dense[cand[c]] = g << 32 | a
        else:
            bits[c] = cand[c]
            packed[c] = g << 32 | a
    return bits, packed, dense


@jit
def _remove(  # type: ignore[no-untyped-def]
    tk, tv, shift, tmask, keys, hold, wide, gpu, cpu, bit, flag, has_parent, free, n_free
):
    """Take instance ``bit``'s tier ``flag`` (1 GPU, 2 CPU) off the slots of ``keys`` (found in
    the index table ``tk``, ``tv``, ``shift``, ``tmask``: ``HashIndex.table``; absent keys and
    slots without that holder are skipped, a key may repeat). The slots left with no holder
    die: their keys are tombstoned in the table afterwards, as ``HashIndex.delete`` would, and
    they are freed in ascending order (``_free_slots``). Returns (holders removed, dead slots,
    the rows they had)."""
    w, m = bit >> 6, np.uint64(bit & 63)
    one = np.uint64(1) << m
    words = gpu.shape[1]
    inline = hold.shape[1]
    cells = np.empty(keys.shape[0], np.int64)
    dead = np.empty(keys.shape[0], np.int64)
    held = 0
    n_dead = 0
    for i in range(keys.shape[0]):
        s, p = _probe(tk, tv, shift, tmask, keys[i])
        if s < 0:
            continue
        r = wide[s]
        live = False
        if r >= 0:
            rows = gpu if flag == 1 else cpu
            if not rows[r, w] & one:
                continue
            rows[r, w] &= ~one
            for v in range(words):
                if gpu[r, v] or cpu[r, v]:
                    live = True
                    break
        else:
            found = False
            for k in range(inline):
                e = np.int64(hold[s, k])
                if e and e >> 2 == bit and e & flag:
                    e &= ~flag
                    hold[s, k] = e if e & 3 else 0
                    found = True
                    break
            if not found:
                continue
            for k in range(inline):
                if hold[s, k]:
                    live = True
                    break
        held += 1
        if not live:
            dead[n_dead] = s
            cells[n_dead] = p
            n_dead += 1
    for j in range(n_dead):
        tv[cells[j]] = TOMBSTONE
    return held, n_dead, _free_slots(np.sort(dead[:n_dead]), has_parent, wide, free, n_free)


@jit
def _free_slots(dead, has_parent, wide, free, n_free):  # type: ignore[no-untyped-def]
    """Free the slots ``dead`` (distinct, ascending, out of the index): pushed in that order on
    the free stack ``free[:n_free]``, without a parent, their rows dropped. Returns those rows,
    in order (for the caller's free rows)."""
    rows = np.empty(dead.shape[0], np.int64)
    n_rows = 0
    for j in range(dead.shape[0]):
        s = dead[j]
        has_parent[s] = False
        if wide[s] >= 0:
            rows[n_rows] = wide[s]
            n_rows += 1
            wide[s] = -1
        free[n_free + j] = s
    return rows[:n_rows]


@jit
def _store_known(tk, tv, shift, tmask, keys, hold, wide, gpu, cpu, bit, flag):  # type: ignore[no-untyped-def]
    """Add instance ``bit`` with tier ``flag`` to the slots of the ``keys`` the index table
    holds (``HashIndex.table``; a key may repeat). Returns (holders added, the position of the
    first occurrence of each absent key in ascending key order, the narrow slots with no room
    left for it)."""
    w, m = bit >> 6, np.uint64(bit & 63)
    one = np.uint64(1) << m
    inline = hold.shape[1]
    n = keys.shape[0]
    miss = np.empty(n, np.int64)
    full = np.empty(n, np.int64)
    n_miss = 0
    n_full = 0
    added = 0
    for i in range(n):
        s = _probe(tk, tv, shift, tmask, keys[i])[0]
        if s < 0:
            miss[n_miss] = i
            n_miss += 1
            continue
        r = wide[s]
        if r >= 0:
            rows = gpu if flag == 1 else cpu
            if not rows[r, w] & one:
                rows[r, w] |= one
                added += 1
            continue
        empty = -1
        found = False
        for k in range(inline):
            e = np.int64(hold[s, k])
            if not e:
                if empty < 0:
                    empty = k
            elif e >> 2 == bit:
                found = True
                if not e & flag:
                    hold[s, k] = e | flag
                    added += 1
                break
        if found:
            continue
        if empty >= 0:
            hold[s, empty] = bit << 2 | flag
            added += 1
        else:
            full[n_full] = s
            n_full += 1
    miss = miss[:n_miss]
    missing_keys = keys[miss]
    order = np.argsort(missing_keys, kind="mergesort")  # stable: equal keys keep their first
    out = np.empty(n_miss, np.int64)
    n_out = 0
    for j in range(n_miss):
        if j == 0 or missing_keys[order[j]] != missing_keys[order[j - 1]]:
            out[n_out] = miss[order[j]]
            n_out += 1
    return added, out[:n_out], full[:n_full]


@jit
def _promote(hold, wide, gpu, cpu, slots, rows, bit, flag):  # type: ignore[no-untyped-def]
    """Give each narrow slot of ``slots`` (distinct, full) the row of ``rows`` beside it: its
    inline holders move there, then instance ``bit`` joins with tier ``flag``. Returns how
    many joined (all of them)."""
    for j in range(slots.shape[0]):
        s, r = slots[j], rows[j]
        gpu[r, :] = 0
        cpu[r, :] = 0
        for k in range(hold.shape[1]):
            e = np.int64(hold[s, k])
            if e:
                b = e >> 2
                w, m = b >> 6, np.uint64(b & 63)
                if e & 1:
                    gpu[r, w] |= np.uint64(1) << m
                if e & 2:
                    cpu[r, w] |= np.uint64(1) << m
                hold[s, k] = 0
        wide[s] = r
        w, m = bit >> 6, np.uint64(bit & 63)
        if flag == 1:
            gpu[r, w] |= np.uint64(1) << m
        else:
            cpu[r, w] |= np.uint64(1) << m
    return slots.shape[0]


@jit
def _store(  # type: ignore[no-untyped-def]
    tk, tv, shift, tmask, hold, wide, gpu, cpu, hash_, parent, has_parent, depth, free, n_free,
    next_, hs, meta, bit, flag,
):  # fmt: skip
    """``CacheMap.store_chains``'s pass: add instance ``bit`` with tier ``flag`` to the known
    keys among ``hs`` (``_store_known``), then give each new key (its first position) a slot,
    from the top of the free stack ``free[:n_free]`` first (the stack's order: its last
    ``reused`` in place), then from ``next_`` on, put it in the index table (``_insert``, as
    ``HashIndex.insert`` does) and fill the slot's columns with that one holder. ``hs`` is
    the chains' hashes laid end to end, then each chain's parent (0 for none); ``meta`` is per
    chain (start in ``hs``, first block's depth, has a parent). The caller made room (slots,
    free stack and table) for every key being new. Returns (holders added, slots reused, slots
    taken from ``next_``, EMPTY table cells used, the known narrow slots with no room left for
    the holder)."""
    k = meta.shape[0] // 3
    n = hs.shape[0] - k
    keys = hs[:n]
    added, pos, full = _store_known(tk, tv, shift, tmask, keys, hold, wide, gpu, cpu, bit, flag)
    new = pos.shape[0]
    reused = min(new, n_free)
    at = np.empty(new, np.int64)
    for j in range(new):
        at[j] = free[n_free - reused + j] if j < reused else next_ + j - reused
    cells = _insert(tk, tv, shift, tmask, keys[pos], at)
    starts = np.empty(k, np.int64)
    for c in range(k):
        starts[c] = meta[3 * c]
    entry = bit << 2 | flag
    for j in range(new):
        s, p = at[j], pos[j]
        key = keys[p]
        c = np.searchsorted(starts, p, side="right") - 1
        hash_[s] = key
        if p > starts[c]:
            parent[s], has_parent[s] = keys[p - 1], True
        else:
            parent[s], has_parent[s] = hs[n + c], meta[3 * c + 2] != 0
        depth[s] = meta[3 * c + 1] + p - starts[c]
        hold[s, :] = 0
        hold[s, 0] = entry
    return added + new, reused, new - reused, cells, full


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
