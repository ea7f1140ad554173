"""The PD data path: move a request's KV blocks between two workers over ``torch.distributed``.

kvroute's prefill/decode connector (docs/architecture.md "Prefill/decode disaggregation") runs
inside vLLM's worker processes and calls this module to ship the KV blocks of a request from the
prefill worker to the decode worker. Pure torch: no vLLM, Ray or ``router`` import; vLLM's layout
arrives as tensors and block ids, described by ``engines.pd.layout`` (``LayerSpec``: which
layouts move as raw pages, which in logical order; the chunk format's gather and scatter).

Process group. ``KVTransport`` owns its own group, built from explicit parameters and never from
the default (global) group, which vLLM's workers already use for tensor parallelism: a
``TCPStore`` of its own (hosted by rank 0 on ``host:port``, or one passed in), wrapped in a
``PrefixStore`` named after the group, and the backend object constructed directly on it
(``ProcessGroupGloo`` / ``ProcessGroupNCCL``), as vLLM's ``stateless_init_torch_distributed_
process_group`` does, without registering anything globally. Gloo moves CPU tensors, NCCL CUDA
tensors; the code above the backend is the same.

Protocol, per ordered pair of ranks (one channel per direction, FIFO):

1. A header: ``HEADER_WORDS`` int64s: magic+version, sequence number (per pair and direction,
   from 0), request key (63 bits of BLAKE2b of the request id), status (OK or ABORT), number of
   blocks, number of layers, bytes per block (all layers), layout fingerprint, blocks per chunk,
   number of chunks, total payload bytes.
2. ``num_chunks`` payload messages. Chunk ``i`` holds blocks ``[i*bpc, (i+1)*bpc)`` of the
   request for every layer, layer-major (layer 0's blocks, then layer 1's ...), each block in
   its layer's page format; it is at most ``chunk_bytes`` (at least one block). Chunks go out on
   ``channels`` tags round-robin (on Gloo each tag maps to its own TCP connection).

Sends are rendezvous on Gloo as on NCCL: a send completes when the peer has received it.
A transfer holds its pair's lock from header to last chunk, so the transfers of concurrent
requests never interleave on a channel. The receiver checks magic, sequence, request, sizes and
layout before it writes anything: a header for another request (``recv_next`` accepts any of a
set of expected requests; ``recv_blocks`` one) or another layout is drained (its payload read
into the staging buffer and dropped, the channel stays in step) and raises
``KVTransferMismatch``. An ABORT header (``send_abort``) carries no payload and raises
``KVTransferAborted`` on the receiver.

Errors. Every wait has a timeout; a peer that dies closes its sockets (Gloo raises at once:
"Connection closed by peer") or stays silent (the wait times out): both raise
``KVTransferError`` (``KVTransferTimeout`` for the second), never hang. After a failure the
channel is out of step, so it is marked broken and later calls on it raise
``KVTransportBroken``; a timeout marks every peer broken, because Gloo signals a timeout to all
pairs of its context (measured: the next receive from another, healthy peer fails with
"Application timeout caused pair closure"), and NCCL aborts the communicator. Build a new
``KVTransport`` to recover. A receiver should therefore only wait for a transfer that is coming
(the connector pulls), with a timeout it can afford to lose the group on.

Speed. Gather (``engines.pd.layout.gather_blocks``) into a preallocated staging buffer (pinned
when the cache is on a GPU and the backend is Gloo), one message per chunk, scatter
(``scatter_blocks``) on the other side. ``depth`` staging buffers per direction overlap the
gather (scatter) of one chunk with the send (receive) of the previous (next) one.

NCCL. The same code; ops are ordered per pair and tags are ignored, which the FIFO protocol
needs anyway. Use one direction per pair (prefill -> decode): NCCL send and receive between the
same two ranks from two threads can deadlock. Untested here (no GPUs on the development box).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from engines.pd.layout import (
    LayerSpec,
    gather_blocks,
    layer_specs,
    layout_fingerprint,
    scatter_blocks,
)
from engines.pd.wire import (
    HEADER_WORDS,
    STATUS_ABORT,
    STATUS_OK,
    Header,
    KVTransferAborted,
    KVTransferError,
    KVTransferMismatch,
    KVTransferTimeout,
    KVTransportBroken,
    TransferStats,
    request_key,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "KVTransport",
]

DEFAULT_CHUNK_BYTES = 64 << 20
_HEADER_TAG = 0
_PAYLOAD_TAG0 = 1

Backend = Literal["gloo", "nccl"]


@dataclass(slots=True)
class _Peer:
    """State of the two channels with one peer rank."""

    send_lock: threading.Lock = field(default_factory=threading.Lock)
    recv_lock: threading.Lock = field(default_factory=threading.Lock)
    send_seq: int = 0
    recv_seq: int = 0
    broken: str | None = None
    send_bufs: list[torch.Tensor] = field(default_factory=list)
    recv_bufs: list[torch.Tensor] = field(default_factory=list)


class KVTransport:
    """A private ``torch.distributed`` group of ``world_size`` ranks moving KV blocks between them.

    Every rank builds one with the same ``host``/``port`` (rank 0 hosts the ``TCPStore`` there),
    or passes a ``store`` of its own making. Construction returns once all ranks have connected,
    or raises after ``timeout_s``. ``backend="gloo"`` moves CPU tensors (a GPU cache goes through
    a pinned staging buffer); ``"nccl"`` moves tensors on ``device`` (this worker's GPU).
    ``local_addr`` is the address Gloo's sockets bind to (default: loopback when ``host`` is,
    else torch's default device). ``chunk_bytes`` bounds one message and each staging buffer;
    ``depth`` buffers per peer and direction are kept (grown on demand, never shrunk);
    ``channels`` is the number of Gloo connections per peer chunks are spread over.
    ``timeout_s`` bounds every wait (per-call ``timeout_s`` overrides it).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        backend: Backend = "gloo",
        host: str = "127.0.0.1",
        port: int | None = None,
        store: Store | None = None,
        local_addr: str | None = None,
        group_name: str = "kvroute-pd",
        timeout_s: float = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        channels: int = 1,
        depth: int = 2,
        device: torch.device | str | None = None,
    ) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, world_size >= 2: {rank}/{world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if chunk_bytes <= 0 or channels < 1 or depth < 1 or timeout_s <= 0:
            raise ValueError("chunk_bytes, channels, depth and timeout_s must be positive")
        if store is None and port is None:
            raise ValueError("give a store or a port for rank 0 to host one on")
        self.rank = rank
        self.world_size = world_size
        self.backend: Backend = backend
        self.timeout = _dt.timedelta(seconds=timeout_s)
        self.chunk_bytes = chunk_bytes
        self.channels = channels
        self.depth = depth
        if backend == "nccl":
            self.comm_device = torch.device(device if device is not None else "cuda")
            if self.comm_device.type != "cuda":
                raise ValueError(f"nccl needs a CUDA device, got {self.comm_device}")
        else:
            self.comm_device = torch.device("cpu")
        if store is None:
            assert port is not None
            store = TCPStore(
                host,
                port,
                world_size,
                rank == 0,
                timeout=self.timeout,
                wait_for_workers=True,
            )
        self._store = store  # keep the server alive as long as the group
        if local_addr is None and host in ("127.0.0.1", "localhost", "::1"):
            local_addr = host  # everything on this machine: Gloo on loopback too
        self._local_addr = local_addr
        prefix = PrefixStore(f"{group_name}/", store)
        self._pg: Any = self._make_backend(prefix)
        self._peers = {r: _Peer() for r in range(world_size) if r != rank}

    def _make_backend(self, store: Store) -> Any:
        size = self.world_size
        if self.backend == "gloo":
            gloo: Any = dist.ProcessGroupGloo  # the stubs lag the bindings (_Options)
            opts = gloo._Options()
            opts._timeout = self.timeout
            opts._threads = max(2, self.channels)
            opts._devices = [_gloo_device(self._local_addr) for _ in range(self.channels)]
            return gloo(store, self.rank, size, opts)
        from torch.distributed import ProcessGroupNCCL

        torch.cuda.set_device(self.comm_device)
        nccl_opts = ProcessGroupNCCL.Options()
        nccl_opts._timeout = self.timeout
        return ProcessGroupNCCL(store, self.rank, size, nccl_opts)

    # ---------------------------------------------------------------- lifecycle

    @property
    def store(self) -> Store:
        """The group's store (rank 0's ``TCPStore`` or the one passed in), for side metadata."""
        return self._store

    def close(self) -> None:
        """Shut the group down (pending operations fail on both sides)."""
        for peer in self._peers.values():
            peer.broken = peer.broken or "transport closed"
            peer.send_bufs.clear()
            peer.recv_bufs.clear()
        pg, self._pg = self._pg, None
        if pg is not None:
            with contextlib.suppress(Exception):  # best effort: the group may already be gone
                pg.shutdown()

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- sending

    def send_blocks(
        self,
        dst: int,
        request_id: str,
        kv_caches: Sequence[torch.Tensor] | Sequence[LayerSpec],
        block_ids: Sequence[int],
        *,
        timeout_s: float | None = None,
    ) -> TransferStats:
        """Send blocks ``block_ids`` of every layer of ``kv_caches`` to rank ``dst``.

        Blocks until the receiver has taken every chunk: Gloo sends are rendezvous (measured:
        even an 8-byte send waits for the matching receive), so a peer that never receives makes
        it time out; the connector sends from a thread of its own. All checks run before the
        header goes out, so a bad argument leaves the channel untouched."""
        specs = _as_specs(kv_caches)
        ids = [int(b) for b in block_ids]
        _check_ids(ids, specs, "source")
        peer = self._peer(dst)
        t_start = time.perf_counter()
        block_bytes = sum(s.block_bytes for s in specs)
        bpc = max(1, self.chunk_bytes // block_bytes)
        num_chunks = -(-len(ids) // bpc)
        timeout = self._timeout(timeout_s)
        stats = TransferStats(request_id, len(ids), block_bytes * len(ids), num_chunks)
        with peer.send_lock:
            self._check_peer(dst, peer)
            header = Header(
                seq=peer.send_seq,
                key=request_key(request_id),
                status=STATUS_OK,
                num_blocks=len(ids),
                num_layers=len(specs),
                block_bytes=block_bytes,
                fingerprint=layout_fingerprint(specs),
                blocks_per_chunk=bpc,
                num_chunks=num_chunks,
                total_bytes=block_bytes * len(ids),
            )
            bufs = self._buffers(peer.send_bufs, min(bpc, len(ids)) * block_bytes, specs)
            idx_all = torch.tensor(ids, dtype=torch.long, device=specs[0].view.device)
            try:
                self._send_header(dst, header, timeout, stats)
                peer.send_seq += 1
                self._send_payload(dst, header, specs, ids, bufs, idx_all, timeout, stats)
            except KVTransferError as exc:
                self._mark_broken(peer, exc)
                raise
        stats.total_s = time.perf_counter() - t_start
        return stats

    def _send_payload(
        self,
        dst: int,
        header: Header,
        specs: Sequence[LayerSpec],
        ids: list[int],
        bufs: list[torch.Tensor],
        idx_all: torch.Tensor,
        timeout: _dt.timedelta,
        stats: TransferStats,
    ) -> None:
        """Gather and send ``header``'s chunks from the staging buffers ``bufs`` (allocated
        before the header went out)."""
        bpc, n = header.blocks_per_chunk, header.num_blocks
        pending: list[Any] = [None] * len(bufs)
        for c in range(header.num_chunks):
            slot = c % len(bufs)
            if pending[slot] is not None:
                self._wait(pending[slot], timeout, stats, dst, "send")
                pending[slot] = None
            lo, hi = c * bpc, min(n, (c + 1) * bpc)
            t0 = time.perf_counter()
            payload = gather_blocks(specs, ids[lo:hi], bufs[slot], idx_all[lo:hi])
            stats.staging_s += time.perf_counter() - t0
            pending[slot] = self._post("send", payload, dst, self._payload_tag(c))
        for work in pending:
            if work is not None:
                self._wait(work, timeout, stats, dst, "send")

    def send_abort(self, dst: int, request_id: str, *, timeout_s: float | None = None) -> None:
        """Tell ``dst`` that ``request_id``'s KV will not come (its receive raises)."""
        peer = self._peer(dst)
        stats = TransferStats(request_id, 0, 0, 0)
        with peer.send_lock:
            self._check_peer(dst, peer)
            header = Header(
                peer.send_seq, request_key(request_id), STATUS_ABORT, 0, 0, 0, 0, 0, 0, 0
            )
            try:
                self._send_header(dst, header, self._timeout(timeout_s), stats)
            except KVTransferError as exc:
                self._mark_broken(peer, exc)
                raise
            peer.send_seq += 1

    # ---------------------------------------------------------------- receiving

    def recv_blocks(
        self,
        src: int,
        request_id: str,
        kv_caches: Sequence[torch.Tensor] | Sequence[LayerSpec],
        block_ids: Sequence[int],
        *,
        timeout_s: float | None = None,
    ) -> TransferStats:
        """Receive the next transfer from ``src``, which must be ``request_id``'s, into
        ``block_ids`` of every layer of ``kv_caches``. Raises ``KVTransferMismatch`` (channel
        still usable) if another request's transfer comes first."""
        _, stats = self.recv_next(src, {request_id: block_ids}, kv_caches, timeout_s=timeout_s)
        return stats

    def recv_next(
        self,
        src: int,
        expected: Mapping[str, Sequence[int]],
        kv_caches: Sequence[torch.Tensor] | Sequence[LayerSpec],
        *,
        timeout_s: float | None = None,
    ) -> tuple[str, TransferStats]:
        """Receive the next transfer from ``src``: whichever of the ``expected`` requests
        (request id -> destination block ids) it is. Returns that request id and the stats."""
        specs = _as_specs(kv_caches)
        by_key: dict[int, tuple[str, list[int]]] = {}
        for rid, blocks in expected.items():
            ids = [int(b) for b in blocks]
            _check_ids(ids, specs, f"destination of {rid!r}")
            by_key[request_key(rid)] = (rid, ids)
        peer = self._peer(src)
        t_start = time.perf_counter()
        timeout = self._timeout(timeout_s)
        with peer.recv_lock:
            self._check_peer(src, peer)
            stats = TransferStats("", 0, 0, 0)
            try:
                header = self._recv_header(src, timeout, stats)
                if header.seq != peer.recv_seq:
                    raise KVTransportBroken(
                        f"from rank {src}: header sequence {header.seq}, "
                        f"expected {peer.recv_seq}: channel out of step"
                    )
                peer.recv_seq += 1
                if header.status == STATUS_ABORT:
                    rid = by_key.get(header.key, ("<unexpected>", []))[0]
                    raise KVTransferAborted(f"rank {src} aborted the transfer of {rid}", header)
                if header.status != STATUS_OK:
                    raise KVTransportBroken(f"from rank {src}: unknown status {header.status}")
                problem = self._mismatch(header, by_key, specs)
                if problem is not None:
                    self._drain(src, peer, header, timeout, stats)
                    raise KVTransferMismatch(f"from rank {src}: {problem}", header)
                rid, ids = by_key[header.key]
                stats.request_id = rid
                stats.num_blocks = header.num_blocks
                stats.bytes = header.total_bytes
                stats.chunks = header.num_chunks
                self._recv_payload(src, peer, header, specs, ids, timeout, stats)
            except (KVTransferMismatch, KVTransferAborted):
                raise
            except KVTransferError as exc:
                self._mark_broken(peer, exc)
                raise
        stats.total_s = time.perf_counter() - t_start
        return rid, stats

    def _mismatch(
        self,
        header: Header,
        by_key: Mapping[int, tuple[str, list[int]]],
        specs: Sequence[LayerSpec],
    ) -> str | None:
        if header.key not in by_key:
            return f"transfer of an unexpected request (key {header.key:#x})"
        rid, ids = by_key[header.key]
        if header.num_blocks != len(ids):
            return f"{rid}: {header.num_blocks} blocks sent, {len(ids)} destination blocks"
        if header.num_layers != len(specs):
            return f"{rid}: {header.num_layers} layers sent, {len(specs)} here"
        block_bytes = sum(s.block_bytes for s in specs)
        if header.block_bytes != block_bytes:
            return f"{rid}: {header.block_bytes} bytes per block sent, {block_bytes} here"
        if header.fingerprint != layout_fingerprint(specs):
            return f"{rid}: KV cache layout differs (dtype, block shape or memory order)"
        if header.total_bytes != block_bytes * header.num_blocks or header.blocks_per_chunk < 1:
            return f"{rid}: inconsistent header {header}"
        return None

    def _recv_payload(
        self,
        src: int,
        peer: _Peer,
        header: Header,
        specs: Sequence[LayerSpec],
        ids: list[int],
        timeout: _dt.timedelta,
        stats: TransferStats,
    ) -> None:
        bpc, n = header.blocks_per_chunk, header.num_blocks
        block_bytes = header.block_bytes
        bufs = self._buffers(peer.recv_bufs, min(bpc, n) * block_bytes, specs)
        idx_all = torch.tensor(ids, dtype=torch.long, device=specs[0].view.device)
        pending: list[Any] = [None] * len(bufs)

        def post(c: int) -> None:
            size = (min(n, (c + 1) * bpc) - c * bpc) * block_bytes
            slot = c % len(bufs)
            pending[slot] = self._post("receive", bufs[slot][:size], src, self._payload_tag(c))

        for c in range(min(len(bufs), header.num_chunks)):
            post(c)
        for c in range(header.num_chunks):
            slot = c % len(bufs)
            self._wait(pending[slot], timeout, stats, src, "receive")
            pending[slot] = None
            lo, hi = c * bpc, min(n, (c + 1) * bpc)
            t0 = time.perf_counter()
            scatter_blocks(specs, ids[lo:hi], bufs[slot], idx_all[lo:hi])
            stats.staging_s += time.perf_counter() - t0
            if c + len(bufs) < header.num_chunks:
                post(c + len(bufs))

    def _drain(
        self, src: int, peer: _Peer, header: Header, timeout: _dt.timedelta, stats: TransferStats
    ) -> None:
        """Read and drop a transfer's payload so the channel stays in step."""
        if header.blocks_per_chunk < 1 or header.block_bytes < 1:
            raise KVTransportBroken(f"from rank {src}: undrainable header {header}")
        chunk = header.blocks_per_chunk * header.block_bytes
        buf = torch.empty(chunk, dtype=torch.uint8, device=self.comm_device)
        left = header.total_bytes
        for c in range(header.num_chunks):
            size = min(chunk, left)
            left -= size
            work = self._post("receive", buf[:size], src, self._payload_tag(c))
            self._wait(work, timeout, stats, src, "receive")

    # ---------------------------------------------------------------- helpers

    def _peer(self, rank: int) -> _Peer:
        if self._pg is None:
            raise KVTransportBroken("transport closed")
        try:
            return self._peers[rank]
        except KeyError:
            raise ValueError(
                f"peer rank must be another rank of 0..{self.world_size - 1}, got {rank}"
            ) from None

    @staticmethod
    def _check_peer(rank: int, peer: _Peer) -> None:
        if peer.broken is not None:
            raise KVTransportBroken(f"channel with rank {rank} is broken: {peer.broken}")

    def _timeout(self, timeout_s: float | None) -> _dt.timedelta:
        return self.timeout if timeout_s is None else _dt.timedelta(seconds=timeout_s)

    def _payload_tag(self, chunk: int) -> int:
        return _PAYLOAD_TAG0 + chunk % self.channels

    def _send_header(
        self, dst: int, header: Header, timeout: _dt.timedelta, stats: TransferStats
    ) -> None:
        words = torch.tensor(header.to_words(), dtype=torch.int64, device=self.comm_device)
        self._wait(self._post("send", words, dst, _HEADER_TAG), timeout, stats, dst, "send")

    def _recv_header(self, src: int, timeout: _dt.timedelta, stats: TransferStats) -> Header:
        words = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.comm_device)
        work = self._post("receive", words, src, _HEADER_TAG)
        self._wait(work, timeout, stats, src, "receive")
        return Header.from_words(words.tolist())

    def _post(self, what: str, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        """Start a send or receive of ``tensor`` with ``peer``; errors become ours."""
        try:
            if what == "send":
                return self._pg.send([tensor], peer, tag)
            return self._pg.recv([tensor], peer, tag)
        except Exception as exc:  # a closed pair refuses new work at once
            raise _translate(exc, what, peer, None) from exc

    def _wait(
        self, work: Any, timeout: _dt.timedelta, stats: TransferStats, peer: int, what: str
    ) -> None:
        t0 = time.perf_counter()
        try:
            work.wait(timeout)
        except Exception as exc:  # Gloo/NCCL raise RuntimeError (or DistBackendError)
            waited = time.perf_counter() - t0
            # a wait that ends early on a timeout error reports an earlier timeout: no duration
            own = timeout if waited >= 0.9 * timeout.total_seconds() else None
            raise _translate(exc, what, peer, own) from exc
        if self.comm_device.type == "cuda":
            torch.cuda.current_stream(self.comm_device).synchronize()
        stats.wait_s += time.perf_counter() - t0

    def _mark_broken(self, peer: _Peer, exc: KVTransferError) -> None:
        """After a failure the channel is out of step or closed. A timeout breaks every peer:
        Gloo signals it to all pairs of its context (and NCCL aborts the communicator)."""
        if isinstance(exc, KVTransferTimeout):
            for p in self._peers.values():
                p.broken = p.broken or f"an earlier timeout closed the group: {exc}"
        peer.broken = peer.broken or str(exc)

    def _buffers(
        self, bufs: list[torch.Tensor], nbytes: int, specs: Sequence[LayerSpec]
    ) -> list[torch.Tensor]:
        """``depth`` staging buffers of at least ``nbytes`` on the comm device (grown, kept)."""
        if len(bufs) != self.depth or bufs[0].numel() < nbytes:
            pin = (
                self.comm_device.type == "cpu"
                and specs[0].view.device.type == "cuda"
                and torch.cuda.is_available()
            )
            bufs[:] = [
                torch.empty(nbytes, dtype=torch.uint8, device=self.comm_device, pin_memory=pin)
                for _ in range(self.depth)
            ]
        return bufs


def _translate(
    exc: Exception, what: str, peer: int, timeout: _dt.timedelta | None
) -> KVTransferError:
    """Our exception for a backend's: a timeout (this wait's, or an earlier one that closed the
    connection) or any other failure (the peer closed it, an NCCL error ...)."""
    text = str(exc).strip()
    msg = text.splitlines()[0] if text else type(exc).__name__
    if "timed out" in text.lower() or "timeout" in text.lower():
        after = f" after {timeout.total_seconds():g} s" if timeout is not None else ""
        return KVTransferTimeout(f"{what} with rank {peer} timed out{after}: {msg}")
    return KVTransferError(f"{what} with rank {peer} failed: {msg}")


def _gloo_device(local_addr: str | None) -> Any:
    """A Gloo TCP device bound to ``local_addr``, or torch's default (``GLOO_SOCKET_IFNAME``,
    else the address of this host's name)."""
    gloo: Any = dist.ProcessGroupGloo
    if local_addr is None:
        return gloo.create_default_device()
    return gloo.create_device(hostname=local_addr)


def _as_specs(kv_caches: Sequence[torch.Tensor] | Sequence[LayerSpec]) -> list[LayerSpec]:
    if kv_caches and all(isinstance(k, LayerSpec) for k in kv_caches):
        return list(kv_caches)  # type: ignore[arg-type]
    return layer_specs(kv_caches)  # type: ignore[arg-type]


def _check_ids(ids: list[int], specs: Sequence[LayerSpec], what: str) -> None:
    if not ids:
        raise ValueError(f"{what}: no block ids")
    num_blocks = min(s.num_blocks for s in specs)
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{what}: block ids {bad[:5]} outside 0..{num_blocks - 1}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what}: duplicate block ids")
