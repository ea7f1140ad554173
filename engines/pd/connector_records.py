"""The records the PD connector's two sides share: the scheduler's per-step
``KvrouteConnectorMetadata`` for the workers (with its ``RecvTask`` pulls) and the workers'
``KvrouteConnectorStats`` (one record per transfer) that vLLM hands back to the scheduler.

Imported by ``connector`` (the facade vLLM loads), ``connector_scheduler`` and
``connector_worker``; imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from engines.pd.protocol import PullParams

__all__ = ["KvrouteConnectorMetadata", "KvrouteConnectorStats", "RecvTask"]


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
