"""A compiled open-addressing hash index: uint64 block hash -> int32 slot.

Why not a dict: at a million entries a dict lookup costs ~190 ns (dependent cache misses on the
index table, the entry and the key's int object) and ~110 bytes per entry; a prompt of 512 blocks
would spend 100 us in lookups alone. Here keys and values live in two flat numpy arrays (linear
probing, Fibonacci hashing, at most half full, tombstones for deletes), and each batch operation
is one numba-compiled loop: ~24-48 bytes per entry and a few nanoseconds per probe plus the cache
miss.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from cachemap.hashing import GOLDEN
from cachemap.jit import jit

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]

EMPTY = -1
TOMBSTONE = -2
_GOLDEN = np.uint64(GOLDEN)  # Fibonacci hashing's multiplier


@jit
def _probe(tk, tv, shift, mask, k):  # type: ignore[no-untyped-def]
    """(value, cell) of key ``k`` in the table; value -1 when absent."""
    p = np.int64((k * _GOLDEN) >> shift)
    while True:
        t = tv[p]
        if t == EMPTY:
            return -1, p
        if t >= 0 and tk[p] == k:
            return t, p
        p = (p + 1) & mask


@jit
def _find(tk, tv, shift, mask, keys, out, stop_at_miss):  # type: ignore[no-untyped-def]
    """Fill ``out`` with each key's value (-1: absent); returns how many entries were filled
    (all, or with ``stop_at_miss`` the length of the leading run of present keys)."""
    for i in range(keys.shape[0]):
        v = _probe(tk, tv, shift, mask, keys[i])[0]
        out[i] = v
        if v < 0 and stop_at_miss:
            return i
    return keys.shape[0]


@jit
def _insert(tk, tv, shift, mask, keys, vals):  # type: ignore[no-untyped-def]
    """Place absent, distinct ``keys``; returns how many EMPTY (not tombstone) cells were used."""
    fresh = 0
    for i in range(keys.shape[0]):
        k = keys[i]
        p = np.int64((k * _GOLDEN) >> shift)
        while tv[p] >= 0:
            p = (p + 1) & mask
        if tv[p] == EMPTY:
            fresh += 1
        tk[p] = k
        tv[p] = vals[i]
    return fresh


@jit
def _delete(tk, tv, shift, mask, keys):  # type: ignore[no-untyped-def]
    removed = 0
    for i in range(keys.shape[0]):
        v, p = _probe(tk, tv, shift, mask, keys[i])
        if v >= 0:
            tv[p] = TOMBSTONE
            removed += 1
    return removed


class HashIndex:
    """Maps distinct uint64 keys to non-negative int32 values. Not thread-safe."""

    def __init__(self, capacity: int = 1024) -> None:
        self._alloc(self._size_for(capacity))
        self._live = 0

    @staticmethod
    def _size_for(n: int) -> int:
        return max(64, 1 << (3 * max(1, n) - 1).bit_length())  # load <= 1/3 right after

    def _alloc(self, size: int) -> None:
        self._size = size
        self._shift = np.uint64(64 - (size.bit_length() - 1))
        self._mask = size - 1
        self._keys = np.zeros(size, np.uint64)
        self._vals = np.full(size, EMPTY, np.int32)
        self._used = 0  # live + tombstones

    def __len__(self) -> int:
        return self._live

    def get(self, keys: U64) -> I64:
        """Value of each key, or -1 where absent."""
        out = np.empty(len(keys), np.int64)
        _find(self._keys, self._vals, self._shift, self._mask, keys, out, False)
        return out

    def get_prefix(self, keys: U64) -> I64:
        """Values of the leading run of present keys (stops at the first absent one)."""
        out = np.empty(len(keys), np.int64)
        n = _find(self._keys, self._vals, self._shift, self._mask, keys, out, True)
        return out[:n]

    def insert(self, keys: U64, vals: npt.NDArray[np.integer]) -> None:
        """Add ``keys`` (distinct, all absent) with ``vals`` (>= 0)."""
        if len(keys) == 0:
            return
        self.reserve(len(keys))
        keys = np.ascontiguousarray(keys, np.uint64)
        vals = np.ascontiguousarray(vals, np.int32)
        self._used += _insert(self._keys, self._vals, self._shift, self._mask, keys, vals)
        self._live += len(keys)

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more entries, for a kernel that inserts them into the ``table``
        itself (``CacheMap.store_chains``) and then says so through ``inserted``."""
        if (self._used + n) * 2 > self._size:
            self._rehash(self._live + n)

    def inserted(self, n: int, cells: int) -> None:
        """A kernel put ``n`` entries into the ``table`` (after ``reserve``), ``cells`` of them
        in EMPTY cells (the rest over tombstones), probing as ``insert`` does."""
        self._live += n
        self._used += cells

    def delete(self, keys: U64) -> int:
        """Remove the present ones among ``keys``; returns how many were removed."""
        if len(keys) == 0:
            return 0
        keys = np.unique(np.asarray(keys, np.uint64))
        removed = int(_delete(self._keys, self._vals, self._shift, self._mask, keys))
        self._live -= removed
        return removed

    def table(self) -> tuple[U64, npt.NDArray[np.int32], np.uint64, int]:
        """The probe table (keys, values, shift, mask), for kernels that find keys and act on
        what they find in one pass (``CacheMap.remove``); such a kernel that tombstones cells
        says how many through ``deleted``."""
        return self._keys, self._vals, self._shift, self._mask

    def deleted(self, n: int) -> None:
        """``n`` live entries were tombstoned in the ``table`` by a kernel."""
        self._live -= n

    def check_counts(self) -> None:
        """Raise RuntimeError if the live and used counts (what ``insert``, a kernel's
        ``inserted`` and ``deleted`` said) disagree with the table (tests, debugging)."""
        live, used = int((self._vals >= 0).sum()), int((self._vals != EMPTY).sum())
        if (self._live, self._used) != (live, used):
            raise RuntimeError(
                f"index counts live {self._live}, used {self._used}; the table {live}, {used}"
            )

    def items(self) -> tuple[U64, I64]:
        live = self._vals >= 0
        return self._keys[live], self._vals[live].astype(np.int64)

    def _rehash(self, want: int) -> None:
        keys, vals = self.items()
        # NOTE: only grow when live entries need it; a table full of tombstones is rebuilt as is.
        self._alloc(max(self._size, self._size_for(want)))
        self._used = _insert(
            self._keys, self._vals, self._shift, self._mask, keys, vals.astype(np.int32)
        )
