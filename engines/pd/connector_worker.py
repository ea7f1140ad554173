"""The PD connector's worker side (one per vLLM worker process): the prefill worker's control
channel and held blocks, sent when pulled; the decode worker's pulls; a two-rank
``KVTransport`` per prefill/decode pair of workers, built on first use.

``engines.pd.connector`` (see its docstring for the contract) delegates to ``WorkerSide``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import zmq
from torch._C._distributed_c10d import TCPStore
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from engines.pd.connector_records import KvrouteConnectorMetadata, KvrouteConnectorStats, RecvTask
from engines.pd.layout import LayerSpec, layer_specs
from engines.pd.protocol import (
    CONNECTOR_NAME,
    Connect,
    ConnectorSettings,
    ConnectReply,
    ProtocolError,
    Pull,
    PullParams,
    PullReply,
    Release,
    SendLedger,
    decode_message,
    encode_message,
)
from engines.pd.transfer import KVTransport
from engines.pd.wire import KVTransferAborted, KVTransferError, KVTransferMismatch, TransferStats

__all__ = ["PullRefused", "WorkerSide"]

log = logging.getLogger(__name__)


class PullRefused(KVTransferError):
    """The prefill worker no longer holds the request's blocks (lease expired, already pulled,
    released); the channel is fine."""


class _SendPair:
    """Prefill side of one decode peer: a thread that joins the peer's store, builds the
    two-rank transport (rank 0) and serves its pulls in order."""

    def __init__(self, worker: WorkerSide, msg: Connect) -> None:
        self.worker = worker
        self.msg = msg
        self.tasks: queue.Queue[Pull | None] = queue.Queue()
        self.transport: KVTransport | None = None
        self.closed = False
        self.thread = threading.Thread(
            target=self._run, name=f"kvroute-pd-send-{msg.pair_id[-8:]}", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.closed = True
        self.tasks.put(None)
        t = self.transport
        if t is not None:
            t.close()

    def _run(self) -> None:
        w, msg = self.worker, self.msg
        s = w.settings
        try:
            store = TCPStore(
                msg.store_host,
                msg.store_port,
                2,
                False,
                timeout=_dt.timedelta(seconds=s.connect_timeout_s),
                wait_for_workers=False,
            )
            transport = self.transport = w.new_transport(0, store, msg.pair_id)
        except Exception as e:
            log.warning("KV pair %s: could not join the decode worker: %s", msg.pair_id, e)
            self.closed = True
            return
        try:
            while not self.closed:
                task = self.tasks.get()
                if task is None or not self._serve(transport, task):
                    break
        finally:
            self.closed = True
            transport.close()

    def _serve(self, transport: KVTransport, task: Pull) -> bool:
        """One pull; False when the channel is unusable afterwards."""
        w, rid = self.worker, task.request_id
        got = w.ledger.claim(rid, w.settings.claim_wait_s)
        t0 = time.perf_counter()
        if isinstance(got, str) or not 0 < task.num_blocks <= len(got):
            if isinstance(got, str):
                why = got
            else:
                why = f"{task.num_blocks} blocks asked, {len(got)} held"
                w.ledger.finish(rid, why)
            log.info("KV pull of %s refused: %s", rid, why)
            try:
                transport.send_abort(1, rid)
            except KVTransferError:
                return False
            return True
        try:
            stats = transport.send_blocks(1, rid, w.specs, got[-task.num_blocks :])
        except KVTransferError as e:
            w.ledger.finish(rid, f"sending failed: {e}")
            w.record("send", rid, rid, time.perf_counter() - t0, error=str(e))
            return False
        w.ledger.finish(rid)
        w.record("send", rid, rid, time.perf_counter() - t0, stats=stats)
        return True


class _RecvPair:
    """Decode side of one prefill worker: the control socket and the two-rank transport (rank
    1, hosting the store), built on first use and rebuilt after a failure. Used under ``lock``."""

    def __init__(self, worker: WorkerSide, endpoint: str) -> None:
        self.worker = worker
        self.endpoint = endpoint
        self.lock = threading.Lock()
        self.pair_id = ""
        self.sock: zmq.Socket[bytes] | None = None
        self.transport: KVTransport | None = None

    def connect(self) -> KVTransport:
        if self.transport is not None:
            return self.transport
        w, s = self.worker, self.worker.settings
        self.pair_id = f"{w.engine_id}/{w.tp_rank}/{uuid.uuid4().hex}"
        timeout = _dt.timedelta(seconds=s.connect_timeout_s)
        store = TCPStore(s.host, 0, 2, True, timeout=timeout, wait_for_workers=False)
        sock = w.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self.sock = sock
        hello = Connect(self.pair_id, w.engine_id, s.host, int(store.port), w.backend)
        reply = self._ask(hello)
        if not isinstance(reply, ConnectReply) or reply.pair_id != self.pair_id:
            raise KVTransferError(f"prefill worker at {self.endpoint}: unexpected reply {reply}")
        if not reply.ok:
            raise KVTransferError(f"prefill worker at {self.endpoint} refused: {reply.error}")
        self.transport = w.new_transport(1, store, self.pair_id)
        return self.transport

    def pull(self, request_id: str, num_blocks: int) -> None:
        """Ask for ``request_id``'s last ``num_blocks`` blocks (the transfer follows)."""
        reply = self._ask(Pull(self.pair_id, request_id, num_blocks))
        if not isinstance(reply, PullReply) or reply.request_id != request_id:
            raise KVTransferError(f"prefill worker at {self.endpoint}: unexpected reply {reply}")
        if not reply.ok:
            kind = PullRefused if reply.refused else KVTransferError
            raise kind(f"prefill worker at {self.endpoint} refused the pull: {reply.error}")

    def _ask(self, msg: Connect | Pull) -> Any:
        assert self.sock is not None
        self.sock.send(encode_message(msg))
        wait_ms = int(self.worker.settings.connect_timeout_s * 1000)
        if not self.sock.poll(wait_ms):
            raise KVTransferError(
                f"no answer from the prefill worker at {self.endpoint} within "
                f"{self.worker.settings.connect_timeout_s:g} s (stopped, or a wrong address)"
            )
        try:
            return decode_message(self.sock.recv())
        except ProtocolError as e:
            raise KVTransferError(f"prefill worker at {self.endpoint}: {e}") from e

    def close(self) -> None:
        t, self.transport = self.transport, None
        if t is not None:
            t.close()
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close(0)


class WorkerSide:
    """The connector in one vLLM worker: serves pulls of this worker's KV (prefill side, with a
    control ``port``) and pulls KV from prefill workers (decode side), on threads of its own."""

    def __init__(self, settings: ConnectorSettings, engine_id: str, tp_size: int) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.tp_rank = 0
        self.ledger = SendLedger()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.specs: list[LayerSpec] = []
        self.backend: Any = "gloo"
        self.device = torch.device("cpu")
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        self._send_pairs: dict[str, _SendPair] = {}
        self._recv_pairs: dict[str, _RecvPair] = {}
        self._pairs_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(settings.pull_threads, thread_name_prefix="kvroute-pull")
        self._lock = threading.Lock()
        self._done_recv: set[str] = set()
        self._failed_recv: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._records: list[dict[str, Any]] = []

    # -- setup

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        seen: set[tuple[int, tuple[int, ...]]] = set()
        tensors = []
        for name in sorted(kv_caches):
            t = kv_caches[name]
            key = (t.data_ptr(), tuple(t.shape))
            if key not in seen:  # layers sharing one cache are moved once
                seen.add(key)
                tensors.append(t)
        self.specs = layer_specs(tensors)
        self.device = tensors[0].device
        backend = self.settings.backend
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"backend 'nccl' needs CUDA KV caches, these are on {self.device}")
        self.backend = backend
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.tp_rank = int(get_tensor_model_parallel_rank())
        except Exception:  # no TP group: one worker
            self.tp_rank = 0
        if self.settings.port is not None:
            port = self.settings.port + self.tp_rank
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            host = self.settings.host
            try:
                sock.bind(f"tcp://{'[' + host + ']' if ':' in host else host}:{port}")
            except zmq.ZMQError as e:
                sock.close(0)
                raise RuntimeError(
                    f"{CONNECTOR_NAME}: cannot bind the control channel on {host}:{port}: {e}"
                ) from e
            self._server = threading.Thread(
                target=self._serve, args=(sock,), name="kvroute-pd-control", daemon=True
            )
            self._server.start()
        log.info(
            "%s worker %s/%d: %d KV layers on %s, backend %s, control %s",
            CONNECTOR_NAME,
            self.engine_id,
            self.tp_rank,
            len(self.specs),
            self.device,
            self.backend,
            f"{self.settings.host}:{self.settings.port + self.tp_rank}"
            if self.settings.port is not None
            else "off (decode only)",
        )

    def new_transport(self, rank: int, store: TCPStore, pair_id: str) -> KVTransport:
        """The two-rank group of pair ``pair_id`` (prefill rank 0, decode rank 1); returns once
        both have joined ``store`` (or raises after ``timeout_s``)."""
        s = self.settings
        return KVTransport(
            rank=rank,
            world_size=2,
            backend=self.backend,
            store=store,
            local_addr=s.host,
            group_name=f"kvroute-pd/{pair_id}",
            timeout_s=s.timeout_s,
            chunk_bytes=s.chunk_bytes,
            channels=s.channels,
            device=self.device if self.backend == "nccl" else None,
        )

    # -- prefill side: control channel

    def _serve(self, sock: zmq.Socket[bytes]) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                try:
                    reply = self._handle(frames[-1])
                    if reply is not None:
                        sock.send_multipart([frames[0], encode_message(reply)])
                except Exception:  # one bad message must not end the control channel
                    log.exception("control channel: message not handled")
        finally:
            sock.close(0)

    def _handle(self, payload: bytes) -> ConnectReply | PullReply | None:
        try:
            msg = decode_message(payload)
        except ProtocolError as e:
            log.warning("control channel: %s", e)
            return None
        if isinstance(msg, Connect):
            return self._on_connect(msg)
        if isinstance(msg, Pull):
            return self._on_pull(msg)
        if isinstance(msg, Release):
            self.ledger.release(msg.request_id)
        return None

    def _on_connect(self, msg: Connect) -> ConnectReply:
        if msg.backend != self.backend:
            return ConnectReply(
                msg.pair_id,
                False,
                self.engine_id,
                f"backend {msg.backend} asked, this prefill worker moves KV with {self.backend}",
            )
        # a decode worker rebuilds its pair after a failure: its older pairs are dead
        peer = msg.pair_id.rpartition("/")[0]
        with self._pairs_lock:
            stale = [
                p
                for p, pair in self._send_pairs.items()
                if pair.closed or p.rpartition("/")[0] == peer
            ]
            old = [self._send_pairs.pop(p) for p in stale]
            self._send_pairs[msg.pair_id] = _SendPair(self, msg)
        for pair in old:
            pair.close()
        return ConnectReply(msg.pair_id, True, self.engine_id)

    def _on_pull(self, msg: Pull) -> PullReply:
        with self._pairs_lock:
            pair = self._send_pairs.get(msg.pair_id)
        if pair is None or pair.closed:
            return PullReply(msg.request_id, False, f"no live KV channel {msg.pair_id}")
        gone = self.ledger.why_gone(msg.request_id)
        if gone is not None:
            return PullReply(msg.request_id, False, gone, refused=True)
        pair.tasks.put(msg)
        return PullReply(msg.request_id, True)

    # -- per step

    def start(self, meta: KvrouteConnectorMetadata) -> None:
        for rid, blocks in meta.to_send.items():
            self.ledger.add(rid, blocks, self.settings.lease_s)
        for task in meta.to_recv:
            self._pool.submit(self._pull, task)
        for pull in meta.to_release:
            self._pool.submit(self._release, pull)

    def transfer_results(self) -> KVConnectorTransferResults:
        sending = self.ledger.take_finished()
        with self._lock:
            done, failed = self._done_recv, self._failed_recv
            self._done_recv, self._failed_recv = set(), set()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=done | failed, failed_recving=failed
        )

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    def take_stats(self) -> KvrouteConnectorStats | None:
        with self._lock:
            if not self._records:
                return None
            recs, self._records = self._records, []
        return KvrouteConnectorStats(data={"transfers": recs})

    def record(
        self,
        role: str,
        request_id: str,
        remote_request_id: str,
        seconds: float,
        *,
        stats: TransferStats | None = None,
        error: str | None = None,
        blocks: int = 0,
    ) -> None:
        rec: dict[str, Any] = {
            "role": role,
            "request_id": request_id,
            "remote_request_id": remote_request_id,
            "ok": error is None,
            "blocks": stats.num_blocks if stats is not None else blocks,
            "bytes": stats.bytes if stats is not None else 0,
            "seconds": round(seconds, 6),
            "wire_seconds": round(stats.total_s, 6) if stats is not None else 0.0,
        }
        if error is not None:
            rec["error"] = error
        log.debug("KV transfer: %s", rec)
        with self._lock:
            self._records.append(rec)

    # -- decode side

    def _recv_pair(self, endpoint: str) -> _RecvPair:
        with self._pairs_lock:
            pair = self._recv_pairs.get(endpoint)
            if pair is None:
                pair = self._recv_pairs[endpoint] = _RecvPair(self, endpoint)
            return pair

    def _drop(self, pair: _RecvPair) -> None:
        pair.close()
        with self._pairs_lock:
            if self._recv_pairs.get(pair.endpoint) is pair:
                del self._recv_pairs[pair.endpoint]

    def _pull(self, task: RecvTask) -> None:
        t0 = time.perf_counter()
        pull, local = task.pull, task.local_block_ids
        error: str | None = None
        stats: TransferStats | None = None
        pair: _RecvPair | None = None
        try:
            if len(local) > len(pull.block_ids):
                raise ValueError(
                    f"{len(local)} local blocks to fill, the prefill holds {len(pull.block_ids)}"
                )
            pair = self._recv_pair(pull.endpoint(self.tp_rank))
            with pair.lock:
                try:
                    transport = pair.connect()
                    pair.pull(pull.request_id, len(local))
                    stats = transport.recv_blocks(0, pull.request_id, self.specs, local)
                except (KVTransferAborted, KVTransferMismatch, PullRefused):
                    raise  # the channel is still in step
                except Exception:
                    self._drop(pair)
                    raise
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            log.warning(
                "KV pull of %s (prefill %s) failed: %s", task.request_id, pull.request_id, error
            )
        seconds = time.perf_counter() - t0
        self.record(
            "recv",
            task.request_id,
            pull.request_id,
            seconds,
            stats=stats,
            error=error,
            blocks=len(local),
        )
        with self._lock:
            if error is None:
                self._done_recv.add(task.request_id)
            else:
                self._failed_recv.add(task.request_id)
                self._failed_blocks.update(local)

    def _release(self, pull: PullParams) -> None:
        """Tell the prefill worker no pull will come (best effort, fire and forget)."""
        sock = self.ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(pull.endpoint(self.tp_rank))
            sock.send(encode_message(Release(pull.request_id)))
        except zmq.ZMQError as e:
            log.debug("release of %s not sent: %s", pull.request_id, e)
        finally:
            sock.close()

    def shutdown(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=2)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._pairs_lock:
            send, recv = list(self._send_pairs.values()), list(self._recv_pairs.values())
            self._send_pairs.clear()
            self._recv_pairs.clear()
        for p in send:
            p.close()
        for r in recv:
            with contextlib.suppress(Exception):
                r.close()
        self.ctx.destroy(linger=0)
