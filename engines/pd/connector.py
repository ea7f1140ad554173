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

Modules. This one is the facade vLLM loads by module path; it checks the config and hands each
call to its role's side: ``connector_scheduler.SchedulerSide`` in the engine core,
``connector_worker.WorkerSide`` in the workers. What the two sides share (the per-step
metadata, the transfer stats) is in ``connector_records``; neither side imports this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from engines.pd.connector_records import KvrouteConnectorMetadata, KvrouteConnectorStats
from engines.pd.connector_scheduler import SchedulerSide
from engines.pd.connector_worker import WorkerSide
from engines.pd.protocol import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    ConnectorSettings,
    kv_transfer_config,
)

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
    "kv_transfer_config",
]


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
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(vllm_config, self.settings, self.engine_id)
        else:
            self._worker = WorkerSide(self.settings, self.engine_id, pc.tensor_parallel_size)

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
