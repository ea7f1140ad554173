"""A client of the cluster KV pool: one ``MooncakeDistributedStore`` that mounts a segment of
this process's DRAM into the pool and puts and gets blocks by pool key (``engines.pool.keys``).

The pool is a cache: nothing it does may fail a request. Every fault (the master unreachable, the
pool full, a block missing, a block of another size than asked for, an error inside Mooncake) is
a logged line (rate-limited per kind), a counter in ``stats()`` and a ``False`` for that block,
never an exception. While the master is unreachable the client answers misses at once (a call
into Mooncake with its master gone blocks ~4 s) and checks the master's port again after
``master_backoff_s``; Mooncake's client reconnects and remounts its segment on its own when the
master is back.

Binding: the transfer engine advertises ``local_hostname`` for its data and RPC ports (and
``MC_TCP_BIND_ADDRESS``, which this module sets to the same address: without it Mooncake
advertises the host's first interface address). Mooncake 0.3.13 still *listens* on every
interface for those ports; only the advertised address, which peers connect to, is ours to set.

Zero copy: ``register(arr)`` registers caller memory (an engine's KV buffer) with the transfer
engine; blocks inside registered memory are put from and read into in place. Other values go
through a registered staging buffer of ``staging_bytes`` (one extra copy each way).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import numpy as np
import numpy.typing as npt

__all__ = ["PoolStore", "StoreConfig"]

log = logging.getLogger(__name__)

_MiB = 1 << 20

# Mooncake's ErrorCode values (mooncake-store/include/types.h) this client tells apart.
_NOT_FOUND = {-704, -710, -712}  # OBJECT_NOT_FOUND, REPLICA_NOT_FOUND, REPLICA_IS_GONE
_MASTER = {-900, -901, -103}  # RPC_FAIL, RPC_TIMEOUT, CLIENT_NOT_FOUND
_FULL = {-200, -10, -101}  # NO_AVAILABLE_HANDLE, BUFFER_OVERFLOW, SEGMENT_NOT_FOUND
_SIZE = {-600}  # INVALID_PARAMS: on a read, the buffer is smaller than the object
_TRANSFER = {-800, -801}  # TRANSFER_FAIL, CHECKSUM_MISMATCH

_LOG_EVERY_S = 10.0
# Mooncake 0.3.13's smallest segment (client_buffer_allocation.cpp: "at least 16777216")
_MIN_SEGMENT = 16 * _MiB


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """How a client joins the pool (``PoolMaster.master_address`` and ``.metadata_url``)."""

    master_address: str
    metadata_url: str
    # The address this client's segment is advertised at: 127.0.0.1 on one machine; a node's
    # cluster-network address in a cluster. Never left to Mooncake (it picks eth0's).
    local_hostname: str = "127.0.0.1"
    # DRAM this client contributes to the pool, and its buffer for Mooncake's own copies.
    segment_bytes: int = 64 * _MiB
    local_buffer_bytes: int = 16 * _MiB
    # The registered buffer values outside registered memory are copied through.
    staging_bytes: int = 16 * _MiB
    protocol: str = "tcp"
    rdma_devices: str = ""
    master_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.segment_bytes < _MIN_SEGMENT:
            raise ValueError(
                f"segment_bytes: Mooncake refuses segments under 16 MiB, got {self.segment_bytes}"
            )
        if self.staging_bytes <= 0 or self.local_buffer_bytes <= 0:
            raise ValueError("staging_bytes and local_buffer_bytes must be positive")


def _port_open(host: str, port: object) -> bool:
    try:
        with socket.create_connection((host, int(str(port))), timeout=0.2):
            return True
    except (OSError, ValueError):
        return False


def _ptr(arr: npt.NDArray[Any]) -> int:
    return int(arr.ctypes.data)


def _as_bytes_view(value: object) -> npt.NDArray[np.uint8]:
    """A flat uint8 view of a contiguous buffer (ndarray, bytes, memoryview)."""
    # bytes, memoryview and the like: numpy reads any object with the buffer protocol
    arr = value if isinstance(value, np.ndarray) else np.frombuffer(cast(bytes, value), np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("a pool value must be C-contiguous")
    return arr.reshape(-1).view(np.uint8)


class PoolStore:
    """One pool client. ``connect()`` once; then ``put_blocks``/``get_blocks``/``exists``.

    Thread-safe: calls are serialised by one lock (the staging buffer is shared)."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._store: Any = None
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._last_log: dict[str, tuple[float, int]] = {}
        self._down_until = 0.0
        self._registered: list[tuple[int, int, npt.NDArray[Any]]] = []
        self._staging: npt.NDArray[np.uint8] | None = None
        self._closed = False

    # -- faults -------------------------------------------------------------------------------

    def _fault(self, kind: str, n: int, detail: str) -> None:
        """Count ``n`` blocks that hit fault ``kind`` and log it (once per kind per 10 s)."""
        self._counts[f"fault_{kind}"] += n
        now = time.monotonic()
        last, suppressed = self._last_log.get(kind, (-_LOG_EVERY_S, 0))
        if now - last >= _LOG_EVERY_S:
            more = f" ({suppressed} more since the last line)" if suppressed else ""
            log.warning("pool: %s: %s%s", kind, detail, more)
            self._last_log[kind] = (now, 0)
        else:
            self._last_log[kind] = (last, suppressed + 1)

    def _classify(self, code: int) -> str:
        if code in _NOT_FOUND:
            return "missing"
        if code in _MASTER:
            return "master_unreachable"
        if code in _FULL:
            return "pool_full"
        if code in _SIZE:
            return "size_mismatch"
        if code in _TRANSFER:
            return "transfer"
        return "error"

    def _master_fault(self, detail: str, n: int) -> None:
        self._down_until = time.monotonic() + self.config.master_backoff_s
        self._fault("master_unreachable", n, detail)

    def _available(self, n: int) -> bool:
        """Whether to call into Mooncake now: connected, and the master not known to be down
        (past the back-off, its port must accept a connection first)."""
        if self._closed:
            self._counts["skipped_closed"] += n
            return False
        if self._store is None and not self._connect_locked():
            self._fault("not_connected", n, "no pool client (setup failed); answering misses")
            return False
        if time.monotonic() < self._down_until:
            self._counts["skipped_master_down"] += n
            return False
        if self._down_until and not self._master_port_open():
            self._master_fault(f"master {self.config.master_address} still unreachable", n)
            return False
        self._down_until = 0.0
        return True

    def _master_port_open(self) -> bool:
        host, _, port = self.config.master_address.rpartition(":")
        return _port_open(host, port)

    # -- life ---------------------------------------------------------------------------------

    def connect(self) -> bool:
        """Set the client up and mount its segment; ``False`` (logged, counted) on failure, in
        which case every call answers misses and the next call after the back-off retries."""
        with self._lock:
            self._closed = False
            return self._connect_locked()

    def _connect_locked(self) -> bool:
        if self._store is not None:
            return True
        if time.monotonic() < self._down_until:
            return False
        c = self.config
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            self._down_until = time.monotonic() + c.master_backoff_s
            self._fault("not_installed", 1, f"the Mooncake wheel is not importable: {e}")
            return False
        # Mooncake's setup with its master or metadata server down blocks ~90 s (20 tries of
        # ~4.5 s each): look first, and cap its tries
        meta = urlsplit(c.metadata_url)
        if not self._master_port_open() or not _port_open(meta.hostname or "", meta.port or 80):
            self._down_until = time.monotonic() + c.master_backoff_s
            self._fault(
                "setup", 1, f"pool master {c.master_address} or {c.metadata_url} unreachable"
            )
            return False
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "3")
        # Mooncake's INFO lines (dozens per setup) stay out of engine logs; its warnings and
        # errors, and this module's fault lines, do not
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        # read by the transfer engine at setup: the address peers connect to for this client
        os.environ["MC_TCP_BIND_ADDRESS"] = c.local_hostname
        store = MooncakeDistributedStore()
        try:
            rc = store.setup(
                c.local_hostname,
                c.metadata_url,
                c.segment_bytes,
                c.local_buffer_bytes,
                c.protocol,
                c.rdma_devices,
                c.master_address,
            )
        except Exception as e:  # any failure of the pool is a miss, never fatal
            rc, detail = -1, repr(e)
        else:
            detail = f"setup returned {rc}"
        if rc != 0:
            self._down_until = time.monotonic() + c.master_backoff_s
            self._fault("setup", 1, f"cannot join the pool at {c.master_address}: {detail}")
            return False
        staging = np.empty(c.staging_bytes, dtype=np.uint8)
        if store.register_buffer(_ptr(staging), staging.nbytes) != 0:
            self._fault("setup", 1, "cannot register the staging buffer")
            store.close()
            return False
        self._store, self._staging = store, staging
        for start, size, _ in self._registered:
            store.register_buffer(start, size)
        log.info(
            "pool: client %s joined %s with a %d MiB segment",
            c.local_hostname,
            c.master_address,
            c.segment_bytes // _MiB,
        )
        return True

    def close(self) -> None:
        """Unmount the segment (its blocks leave the pool) and drop the client; later calls
        answer misses (``skipped_closed``)."""
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
            if store is not None:
                try:
                    store.close()
                except Exception as e:
                    log.warning("pool: close failed: %r", e)

    def register(self, arr: npt.NDArray[Any]) -> bool:
        """Register ``arr``'s memory (kept alive here) so blocks inside it move without a
        staging copy. Also applied on a later (re)connect."""
        if not arr.flags.c_contiguous:
            raise ValueError("only C-contiguous memory can be registered")
        with self._lock:
            self._registered.append((_ptr(arr), arr.nbytes, arr))
            if self._store is None:
                return True
            ok = self._store.register_buffer(_ptr(arr), arr.nbytes) == 0
            if not ok:
                self._registered.pop()
                self._fault("register", 1, f"cannot register {arr.nbytes} bytes")
            return bool(ok)

    def unregister(self, arr: npt.NDArray[Any]) -> None:
        """Undo ``register(arr)`` (before the memory is freed or reused for something else)."""
        with self._lock:
            kept = [r for r in self._registered if r[2] is not arr]
            if len(kept) == len(self._registered):
                return
            self._registered = kept
            if self._store is not None:
                try:
                    self._store.unregister_buffer(_ptr(arr))
                except Exception as e:  # any failure of the pool is a miss, never fatal
                    self._fault("register", 1, f"cannot unregister: {e!r}")

    def _in_registered(self, arr: npt.NDArray[Any]) -> bool:
        start, end = _ptr(arr), _ptr(arr) + arr.nbytes
        return any(s <= start and end <= s + n for s, n, _ in self._registered)

    def stats(self) -> dict[str, int]:
        """Counters: blocks put, hit, missed, and each fault kind (``fault_<kind>``)."""
        with self._lock:
            return dict(self._counts)

    # -- blocks -------------------------------------------------------------------------------

    def _call(self, what: str, n: int, fn: Any, *args: Any) -> list[int] | None:
        """A batch call into Mooncake; ``None`` (counted, logged) if it raised."""
        try:
            return [int(c) for c in fn(*args)]
        except Exception as e:  # any failure of the pool is a miss, never fatal
            self._fault("error", n, f"{what} raised {e!r}")
            return None

    def _settle(
        self,
        what: str,
        keys: Sequence[str],
        codes: Sequence[int],
        sizes: Sequence[int],
        ok: list[bool],
        idxs: Sequence[int],
    ) -> None:
        """Turn per-block result codes into ``ok`` flags, counting and logging the faults.
        A read's code is the bytes read: anything but the expected size is a mismatch."""
        faults: Counter[str] = Counter()
        example: dict[str, str] = {}
        for i, code, size in zip(idxs, codes, sizes, strict=True):
            if code == 0 or (what == "get" and code == size):
                ok[i] = True
                continue
            kind = "size_mismatch" if code > 0 else self._classify(code)
            faults[kind] += 1
            example.setdefault(kind, f"{what} {keys[i]!r}: code {code} (expected {size} bytes)")
        for kind, n in faults.items():
            if kind == "master_unreachable":
                self._master_fault(example[kind], n)
            elif kind == "missing":
                self._counts[f"{what}_missing"] += n
                log.debug("pool: %s", example[kind])
            else:
                self._fault(kind, n, example[kind])

    def _staged_runs(self, sizes: Sequence[int], idxs: Sequence[int]) -> list[list[int]]:
        """``idxs`` cut into runs that fit the staging buffer together (one value larger than
        the whole buffer is left out: counted as too large)."""
        cap = self.config.staging_bytes
        runs: list[list[int]] = []
        run: list[int] = []
        used = 0
        for i in idxs:
            if sizes[i] > cap:
                self._fault("too_large", 1, f"a {sizes[i]}-byte value exceeds staging ({cap})")
                continue
            if used + sizes[i] > cap:
                runs.append(run)
                run, used = [], 0
            run.append(i)
            used += sizes[i]
        if run:
            runs.append(run)
        return runs

    def _put_run(
        self,
        keys: Sequence[str],
        idxs: Sequence[int],
        ptrs: list[int],
        sizes: Sequence[int],
        ok: list[bool],
        config: Any,
    ) -> None:
        ks, szs = [keys[i] for i in idxs], [sizes[i] for i in idxs]
        fn = self._store.batch_put_from
        codes = self._call("put", len(idxs), fn, ks, ptrs, szs, config)
        if codes is not None:
            self._settle("put", keys, codes, szs, ok, idxs)

    @property
    def segment_name(self) -> str | None:
        """This client's segment in the pool (``host:port``), ``None`` when not connected."""
        with self._lock:
            return None if self._store is None else str(self._store.get_hostname())

    def put_blocks(
        self, keys: Sequence[str], values: Sequence[object], segment: str | None = None
    ) -> list[bool]:
        """Store each value (a contiguous ndarray, bytes or memoryview) under its key; a key
        already in the pool keeps its first value (Mooncake answers success). ``segment``: the
        segment to place them in (a ``segment_name``; Mooncake's choice otherwise). Per block:
        stored (or already there), or ``False`` with the fault counted."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys for {len(values)} values")
        with self._lock:
            ok = [False] * len(keys)
            if not keys or not self._available(len(keys)):
                self._counts["put_skipped"] += len(keys) if keys else 0
                return ok
            views = [_as_bytes_view(v) for v in values]
            sizes = [v.nbytes for v in views]
            direct = [i for i, v in enumerate(views) if self._in_registered(v)]
            staged = [i for i, v in enumerate(views) if not self._in_registered(v)]
            from mooncake.store import ReplicateConfig

            config = ReplicateConfig()
            if segment is not None:
                config.preferred_segment = segment
            if direct:
                self._put_run(keys, direct, [_ptr(views[i]) for i in direct], sizes, ok, config)
            assert self._staging is not None
            for run in self._staged_runs(sizes, staged):
                if time.monotonic() < self._down_until:
                    break
                # each run is copied in only after the previous one was put: they share staging
                ptrs, off = [], 0
                for i in run:
                    self._staging[off : off + sizes[i]] = views[i]
                    ptrs.append(_ptr(self._staging) + off)
                    off += sizes[i]
                self._put_run(keys, run, ptrs, sizes, ok, config)
            self._counts["put_ok"] += sum(ok)
            return ok

    def get_blocks(self, keys: Sequence[str], out: Sequence[npt.NDArray[Any]]) -> list[bool]:
        """Read each key's value into the matching array of ``out`` (C-contiguous, exactly the
        value's size). Per block: read and of the right size, or ``False`` (a miss; the array's
        contents are then unspecified and must not be used)."""
        if len(keys) != len(out):
            raise ValueError(f"{len(keys)} keys for {len(out)} output arrays")
        with self._lock:
            ok = [False] * len(keys)
            if not keys or not self._available(len(keys)):
                self._counts["get_skipped"] += len(keys) if keys else 0
                return ok
            views = [_as_bytes_view(o) for o in out]
            sizes = [v.nbytes for v in views]
            direct = [i for i, v in enumerate(views) if self._in_registered(v)]
            staged = [i for i, v in enumerate(views) if not self._in_registered(v)]
            if direct:
                ks, szs = [keys[i] for i in direct], [sizes[i] for i in direct]
                ptrs = [_ptr(views[i]) for i in direct]
                codes = self._call("get", len(direct), self._store.batch_get_into, ks, ptrs, szs)
                if codes is not None:
                    self._settle("get", keys, codes, szs, ok, direct)
            assert self._staging is not None
            for run in self._staged_runs(sizes, staged):
                if time.monotonic() < self._down_until:
                    break
                offs = np.cumsum([0] + [sizes[i] for i in run]).tolist()
                ptrs = [_ptr(self._staging) + o for o in offs[:-1]]
                ks, szs = [keys[i] for i in run], [sizes[i] for i in run]
                codes = self._call("get", len(run), self._store.batch_get_into, ks, ptrs, szs)
                if codes is None:
                    continue
                self._settle("get", keys, codes, szs, ok, run)
                for j, i in enumerate(run):
                    if ok[i]:
                        views[i][:] = self._staging[offs[j] : offs[j + 1]]
            hits = sum(ok)
            self._counts["get_hit"] += hits
            self._counts["get_miss"] += len(keys) - hits
            return ok

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is in the pool now (a fault answers ``False``)."""
        with self._lock:
            if not keys or not self._available(len(keys)):
                return [False] * len(keys)
            codes = self._call("exists", len(keys), self._store.batch_is_exist, list(keys))
            if codes is None:
                return [False] * len(keys)
            bad = [(i, c) for i, c in enumerate(codes) if c < 0]
            if bad:
                i, c = bad[0]
                kind = self._classify(c)
                detail = f"exists {keys[i]!r}: code {c}"
                if kind == "master_unreachable":
                    self._master_fault(detail, len(bad))
                else:
                    self._fault(kind, len(bad), detail)
            return [c == 1 for c in codes]

    def remove_blocks(self, keys: Sequence[str], force: bool = False) -> int:
        """Remove keys from the pool; how many were removed. A key read within the master's
        lease (``kv_lease_ttl_ms``) stays unless ``force``."""
        with self._lock:
            if not keys or not self._available(len(keys)):
                return 0
            removed = 0
            for k in keys:
                try:
                    code = int(self._store.remove(k, force))
                except Exception as e:
                    self._fault("error", 1, f"remove {k!r} raised {e!r}")
                    continue
                if code == 0:
                    removed += 1
                elif self._classify(code) == "master_unreachable":
                    self._master_fault(f"remove {k!r}: code {code}", 1)
                    break
            self._counts["removed"] += removed
            return removed

    def locate(self, key: str) -> list[str]:
        """The segments (``segment_name``s) holding a memory replica of ``key``; empty when it
        is not in the pool or on a fault. What a router needs to price a load by its path."""
        with self._lock:
            if not self._available(1):
                return []
            try:
                replicas = self._store.get_replica_desc(key)
                return [
                    str(r.get_memory_descriptor().buffer_descriptor.transport_endpoint)
                    for r in replicas
                    if r.is_memory_replica()
                ]
            except Exception as e:  # any failure of the pool is a miss, never fatal
                self._fault("error", 1, f"locate {key!r} raised {e!r}")
                return []
