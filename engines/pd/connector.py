"""kvroute's out-of-tree vLLM 0.32 KV connector for prefill/decode disaggregation
(docs/architecture.md).

vLLM loads it with ``KVTransferConfig(kv_connector="KvrouteConnector",
kv_connector_module_path="engines.pd.connector", kv_role="kv_both", ...)``; ``kv_transfer_config``
builds that dict. It runs in vLLM's engine-core (scheduler side) and worker processes and imports
neither Ray nor ``router``.

Contract: NixlConnector's ``kv_transfer_params``. The prefill engine gets the request with
``max_tokens=1`` and ``{"do_remote_decode": True}``; ``request_finished`` keeps its blocks and
returns ``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``,
``remote_block_ids``, ``remote_host``, ``remote_port``, ``tp_size``, ``remote_num_tokens``
(and ``transfer_mode``), which the router passes unchanged to the decode engine. Keys it does not
know (the router's ``"kvroute"`` entry, ``policies.hints.PolicyHints``) are ignored.

Decode side. ``get_num_new_matched_tokens`` reports the prompt tokens past the local prefix cache
as loadable asynchronously; vLLM parks the request in ``WAITING_FOR_REMOTE_KVS``, and once the
load is done recomputes the last prompt token itself (``_update_waiting_for_remote_kv``), as
with NIXL. ``update_state_after_alloc`` records the local blocks to fill (the unhashed ones, the
local hit's blocks are not pulled), ``build_connector_meta`` hands them to the worker, whose
pull thread asks the prefill worker over the control channel (``engines.pd.protocol``) and
receives the blocks with ``KVTransport.recv_blocks`` over a two-rank process group of that pair
(Gloo for CPU caches, NCCL for CUDA caches), built on first use through a ``TCPStore`` the
decode worker hosts. A failed pull is reported both ways vLLM 0.32 reads: the request in
``failed_recving`` (and ``finished_recving``) and its blocks in
``get_block_ids_with_load_errors``; vLLM then applies ``kv_load_failure_policy`` ("recompute":
the request runs its prompt locally; "fail": it finishes with an error).

Prefill side. The worker binds the control channel (ROUTER on ``host:port + tp_rank``), keeps
the finished requests' blocks in a ``SendLedger`` and sends them when pulled, in one thread per
decode peer; a request is reported in ``finished_sending`` (vLLM frees its blocks) once sent, once
sending failed, once the decode side released it, or when its lease (``lease_s``) expires
without a pull.

Observability. Every transfer (both sides) is a record in the connector's ``KVConnectorStats``
(``KvrouteConnectorStats``; vLLM's periodic "KV Transfer metrics" log line reduces them, and a
stat logger sees them in ``SchedulerStats.kv_connector_stats``), and the decode request's final
output carries a ``policies.hints.TransferReport`` in its ``kv_transfer_params["kvroute"]``
(``PolicyHints.transfer``): ``ok``, ``bytes``, ``blocks``, ``seconds`` (pull wall time: control
round trips, group setup if any, wire and scatter), ``wire_seconds`` (the receive alone),
``error``, and ``prompt_tokens_computed`` (prompt tokens vLLM scheduled on this engine after the
load: 1 when the pull worked).

Limits: one KV cache group (no hybrid/sliding-window models), equal TP sizes on both sides
(decode TP rank r pulls from prefill TP rank r), no pipeline parallelism.
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import zmq
from torch._C._distributed_c10d import TCPStore
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from engines.pd.protocol import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    TRANSFER_MODE,
    Connect,
    ConnectorSettings,
    ConnectReply,
    ParamsError,
    ProtocolError,
    Pull,
    PullParams,
    PullReply,
    Release,
    SendLedger,
    decode_message,
    encode_message,
    kv_transfer_config,
    parse_pull_params,
)
from engines.pd.transfer import (
    KVTransferAborted,
    KVTransferError,
    KVTransferMismatch,
    KVTransport,
    LayerSpec,
    TransferStats,
    layer_specs,
)
from policies.hints import PolicyHints, TransferReport

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "CONNECTOR_MODULE",
    "CONNECTOR_NAME",
    "KvrouteConnector",
    "KvrouteConnectorMetadata",
    "KvrouteConnectorStats",
    "kv_transfer_config",
]

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------ stats, metadata


class PullRefused(KVTransferError):
    """The prefill worker no longer holds the request's blocks (lease expired, already pulled,
    released); the channel is fine."""


@dataclass
class KvrouteConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Transfer records of one interval: ``data["transfers"]`` is a list of dicts (role
    "send"/"recv", request ids, ok, bytes, blocks, seconds, wire_seconds, error)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {"transfers": []}

    def aggregate(self, other: KVConnectorStats) -> KvrouteConnectorStats:
        mine = self.data.setdefault("transfers", [])
        mine.extend(other.data.get("transfers", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        recs = self.data.get("transfers", [])
        ok = [r for r in recs if r.get("ok")]
        total_s = sum(float(r.get("seconds", 0.0)) for r in ok)
        nbytes = sum(int(r.get("bytes", 0)) for r in ok)
        return {
            "transfers": len(recs),
            "failed": len(recs) - len(ok),
            "bytes": nbytes,
            "seconds": round(total_s, 6),
            "avg_ms": round(1000 * total_s / len(ok), 3) if ok else 0.0,
            "MB_per_s": round(nbytes / total_s / 1e6, 1) if total_s > 0 else 0.0,
        }

    def is_empty(self) -> bool:
        return not self.data.get("transfers")


@dataclass
class RecvTask:
    """Pull ``pull``'s blocks into ``local_block_ids`` for local request ``request_id``."""

    request_id: str
    pull: PullParams
    local_block_ids: list[int]


@dataclass
class KvrouteConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker, one step: blocks to hold for pulls (prefill side), pulls to start
    and pulls that will not come (decode side)."""

    to_send: dict[str, list[int]] = field(default_factory=dict)
    to_recv: list[RecvTask] = field(default_factory=list)
    to_release: list[PullParams] = field(default_factory=list)


# ---------------------------------------------------------------------------- connector


class KvrouteConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvroute's PD connector (see the module docstring). One instance per role: the scheduler
    side in the engine core, the worker side in each worker."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra(ktc.kv_connector_extra_config)
        self.engine_id: str = str(ktc.engine_id)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ValueError(
                f"{CONNECTOR_NAME} moves one KV cache group; this model has {len(groups)} "
                "(hybrid or sliding-window attention)"
            )
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size > 1:
            raise ValueError(f"{CONNECTOR_NAME} does not support pipeline parallelism")
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(vllm_config, self.settings, self.engine_id)
        else:
            self._worker = _WorkerSide(self.settings, self.engine_id, pc.tensor_parallel_size)

    # -- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._sched is not None
        self._sched.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return (0,)  # the request's own blocks of the one group

    def reset_cache(self) -> bool | None:
        return True  # nothing cached beyond vLLM's blocks (held ones are freed by lease)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        data = data if data is not None else {"transfers": []}
        return KvrouteConnectorStats(data=data)

    # -- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvrouteConnectorMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous (WAITING_FOR_REMOTE_KVS)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # the prefill's blocks are sent from the cache when pulled

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        return self._worker.transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending, r.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.take_stats() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()


# ------------------------------------------------------------------------ scheduler side


@dataclass(slots=True)
class _Watch:
    """A decode request whose pull ended: prompt tokens vLLM schedules for it afterwards."""

    request: Any
    computed: int = 0


class _SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, settings: ConnectorSettings, engine_id: str):
        self.settings = settings
        self.engine_id = engine_id
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self._to_send: dict[str, list[int]] = {}
        self._to_recv: list[RecvTask] = []
        self._to_release: list[PullParams] = []
        self._info: dict[str, TransferReport] = {}  # decode request -> its pull's report
        self._pulling: dict[str, Any] = {}  # decode request id -> Request, pull under way
        self._watch: dict[str, _Watch] = {}
        self._warned: set[str] = set()

    def _pull_params(self, request: Request) -> PullParams | None:
        """The request's pull, None without one; bad params are logged once and mean none."""
        try:
            pull = parse_pull_params(request.kv_transfer_params)
            if pull is not None and pull.tp_size != self.tp_size:
                raise ParamsError(
                    f"kv_transfer_params['tp_size'] is {pull.tp_size}, this engine's TP size "
                    f"{self.tp_size}: {CONNECTOR_NAME} pulls between equal TP sizes"
                )
            return pull
        except ParamsError as e:
            rid = request.request_id
            if rid not in self._warned:
                self._warned.add(rid)
                log.warning("request %s: no KV pull, computing locally: %s", rid, e)
            self._info[rid] = TransferReport(ok=False, error=str(e))
            return None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        pull = self._pull_params(request)
        if pull is None:
            return 0, False
        total = request.num_prompt_tokens
        if pull.num_tokens is not None:
            total = min(total, pull.num_tokens)
        count = total - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        pull = self._pull_params(request)
        params["do_remote_prefill"] = False  # one pull per request (not again after preemption)
        if pull is None:
            return
        if num_external_tokens > 0:
            local = list(blocks.get_unhashed_block_ids_all_groups()[0])
            self._to_recv.append(RecvTask(request.request_id, pull, local))
            self._pulling[request.request_id] = request
        else:  # all cached here already: the prefill engine may free its copy now
            self._to_release.append(pull)
            self._info[request.request_id] = TransferReport(ok=True, cached=True)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvrouteConnectorMetadata(self._to_send, self._to_recv, self._to_release)
        self._to_send, self._to_recv, self._to_release = {}, [], []
        scheduled = scheduler_output.num_scheduled_tokens
        for rid, w in list(self._watch.items()):
            n = scheduled.get(rid, 0)
            if not n:
                continue
            done = w.request.num_computed_tokens  # before this step
            prompt = w.request.num_prompt_tokens
            w.computed += max(0, min(prompt, done + n) - done)
            if done + n >= prompt:
                report = self._info.get(rid)
                if report is not None:
                    self._info[rid] = msgspec.structs.replace(
                        report, prompt_tokens_computed=w.computed
                    )
                del self._watch[rid]
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        stats = connector_output.kv_connector_stats
        data = getattr(stats, "data", stats) or {}
        for rec in data.get("transfers", []):
            if rec.get("role") == "recv":  # the worker's record (``record``) is a report's superset
                self._info[rec["request_id"]] = msgspec.convert(rec, TransferReport)
            elif not rec.get("ok"):
                log.warning("KV send of %s failed: %s", rec.get("request_id"), rec.get("error"))
        for rid in connector_output.finished_recving or ():
            request = self._pulling.pop(rid, None)
            if request is not None:  # count the prompt tokens vLLM still computes here
                self._watch[rid] = _Watch(request)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        params = request.kv_transfer_params
        self._watch.pop(rid, None)
        self._pulling.pop(rid, None)
        self._warned.discard(rid)
        if not params:
            return False, None
        if params.get("do_remote_decode"):
            done = request.status in (
                RequestStatus.FINISHED_LENGTH_CAPPED,
                RequestStatus.FINISHED_STOPPED,
            )
            if not done or not block_ids:
                return False, None
            if self.settings.port is None:
                log.warning(
                    "request %s asks for a remote decode, but this engine has no control "
                    "port (kv_connector_extra_config['port']): nothing to pull from",
                    rid,
                )
                return False, None
            self._to_send[rid] = list(block_ids)
            return True, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.engine_id,
                "remote_request_id": rid,
                "remote_block_ids": list(block_ids),
                "remote_host": self.settings.host,
                "remote_port": self.settings.port,
                "remote_num_tokens": int(request.num_computed_tokens),
                "tp_size": self.tp_size,
                "transfer_mode": TRANSFER_MODE,
            }
        info = self._info.pop(rid, None)
        if params.get("do_remote_prefill"):
            # ended before its blocks were allocated (aborted while queued): no pull will come
            params["do_remote_prefill"] = False
            pull = self._pull_params(request)
            self._info.pop(rid, None)
            if pull is not None:
                self._to_release.append(pull)
            return False, None
        if info is None:
            return False, None
        return False, _with_report(params, info)


def _with_report(params: dict[str, Any], report: TransferReport) -> dict[str, Any]:
    """The decode request's final ``kv_transfer_params``: its ``PolicyHints`` with ``report``.
    Hints this engine cannot read are not the pull's business: they are left out."""
    try:
        hints = PolicyHints.from_params(params) or PolicyHints()
    except ValueError as e:
        log.warning("dropping unreadable policy hints from the transfer report: %s", e)
        hints = PolicyHints()
    return msgspec.structs.replace(hints, transfer=report).merged_into(None)


# --------------------------------------------------------------------------- worker side


class _SendPair:
    """Prefill side of one decode peer: a thread that joins the peer's store, builds the
    two-rank transport (rank 0) and serves its pulls in order."""

    def __init__(self, worker: _WorkerSide, msg: Connect) -> None:
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

    def __init__(self, worker: _WorkerSide, endpoint: str) -> None:
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


class _WorkerSide:
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
