"""The PD connector's scheduler side (vLLM's engine core): which prompt tokens a decode
request loads from its prefill engine, the per-step metadata for the workers, the prefill's
``kv_transfer_params`` for the decode engine, and the decode request's ``TransferReport``.

``engines.pd.connector`` (see its docstring for the contract) delegates to ``SchedulerSide``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from engines.pd.connector_records import KvrouteConnectorMetadata, RecvTask
from engines.pd.protocol import (
    CONNECTOR_NAME,
    TRANSFER_MODE,
    ConnectorSettings,
    ParamsError,
    PullParams,
    parse_pull_params,
)
from policies.hints import PolicyHints, TransferReport

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Watch:
    """A decode request whose pull ended: prompt tokens vLLM schedules for it afterwards."""

    request: Any
    computed: int = 0


class SchedulerSide:
    """The connector in vLLM's engine core: one per engine, called from the scheduler's loop."""

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

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvrouteConnectorMetadata:
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
