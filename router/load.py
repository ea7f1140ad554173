"""Live load per instance: engine load snapshots from the bus, combined with this router's own
in-flight accounting (assigned -> prefill done -> finished).

Snapshots arrive every ~100 ms and cover every router replica's requests; this replica's
assignments made after the snapshot was taken are not in it yet, so they are added on top.
Without a fresh snapshot (engine silent for ``stale_after_s``) the local accounting alone is
used. Time is an argument (``now``, seconds on the same clock as ``LoadSnapshot.ts``).
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.base import LoadSnapshot
from engines.liveness import STALE_AFTER_S
from router.placement import InstanceView, LatencyModel, Placement


@dataclass(slots=True)
class Assignment:
    instance_id: str
    prefill_tokens: int
    assigned_at: float
    placement: Placement | None = None
    prefilled: bool = False


@dataclass(slots=True)
class _Instance:
    block_size: int
    latency: LatencyModel
    kv_capacity_blocks: int
    snapshot: LoadSnapshot | None = None
    failures: int = 0


class LoadTracker:
    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        self.stale_after_s = stale_after_s
        self._instances: dict[str, _Instance] = {}
        self._requests: dict[str, Assignment] = {}

    def register(
        self, instance_id: str, block_size: int, latency: LatencyModel, kv_capacity_blocks: int = 0
    ) -> None:
        self._instances[instance_id] = _Instance(block_size, latency, kv_capacity_blocks)

    def remove(self, instance_id: str) -> None:
        self._instances.pop(instance_id, None)

    def instance_ids(self) -> list[str]:
        return list(self._instances)

    def on_snapshot(self, snap: LoadSnapshot) -> None:
        inst = self._instances.get(snap.instance_id)
        if inst is not None and (inst.snapshot is None or snap.ts >= inst.snapshot.ts):
            inst.snapshot = snap
            inst.failures = 0

    def mark_failed(self, instance_id: str) -> None:
        """A call to the instance failed; it is skipped until its next load snapshot."""
        inst = self._instances.get(instance_id)
        if inst is not None:
            inst.failures += 1

    def assigned(
        self,
        request_id: str,
        instance_id: str,
        prefill_tokens: int,
        now: float,
        placement: Placement | None = None,
    ) -> None:
        self._requests[request_id] = Assignment(instance_id, prefill_tokens, now, placement)

    def prefill_done(self, request_id: str) -> Assignment | None:
        """Mark the request's prefill done; its assignment the first time, else None."""
        a = self._requests.get(request_id)
        if a is None or a.prefilled:
            return None
        a.prefilled = True
        return a

    def finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def in_flight(self) -> int:
        return len(self._requests)

    def views(self, now: float) -> list[InstanceView]:
        local: dict[str, list[Assignment]] = {i: [] for i in self._instances}
        for a in self._requests.values():
            if a.instance_id in local:
                local[a.instance_id].append(a)
        out = []
        for iid, inst in self._instances.items():
            mine = local[iid]
            snap = inst.snapshot
            fresh = snap is not None and now - snap.ts <= self.stale_after_s
            since = snap.ts if fresh and snap is not None else float("-inf")
            newer = [a for a in mine if not a.prefilled and a.assigned_at > since]
            view = InstanceView(
                iid,
                inst.block_size,
                inst.latency,
                inst.kv_capacity_blocks,
                healthy=inst.failures == 0,
            )
            if fresh and snap is not None:
                view.waiting = snap.waiting + len(newer)
                view.running = snap.running
                view.gpu_kv_usage = snap.gpu_kv_usage
                view.pending_prefill_tokens = snap.queued_prefill_tokens
            else:
                view.waiting = len(newer)
                view.running = sum(1 for a in mine if a.prefilled)
            view.pending_prefill_tokens += sum(a.prefill_tokens for a in newer)
            out.append(view)
        return out
