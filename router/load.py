"""Live load per instance: engine load snapshots from the bus, combined with this router's own
in-flight accounting (assigned -> prefill done -> finished).

Snapshots arrive every ~100 ms and cover every router replica's requests; this replica's
assignments made after the snapshot was taken are not in it yet, so they are added on top.
Without a fresh snapshot (engine silent for ``stale_after_s``) the local accounting alone is
used. Time is an argument (``now``, seconds on the same clock as ``LoadSnapshot.ts``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(slots=True)
class _Local:
    """This router's in-flight requests on one instance, kept up to date as they progress so
    ``views`` does not go over every request in flight on every placement."""

    unprefilled: dict[str, Assignment] = field(default_factory=dict)  # in assignment order
    unprefilled_tokens: int = 0
    prefilled: int = 0
    # assigned_at never decreases along ``unprefilled`` (true unless the clock went back)
    in_time_order: bool = True

    def add(self, request_id: str, a: Assignment) -> None:
        if self.unprefilled:
            last = next(reversed(self.unprefilled.values()))
            self.in_time_order = self.in_time_order and a.assigned_at >= last.assigned_at
        self.unprefilled[request_id] = a
        self.unprefilled_tokens += a.prefill_tokens

    def discard(self, request_id: str) -> None:
        a = self.unprefilled.pop(request_id)
        self.unprefilled_tokens -= a.prefill_tokens
        if not self.unprefilled:
            self.in_time_order = True

    def newer(self, since: float) -> tuple[int, int]:
        """(requests, prefill tokens) of the unprefilled ones assigned after ``since``."""
        n = tokens = 0
        if self.in_time_order:  # only the tail is newer: stop at the first older one
            for a in reversed(self.unprefilled.values()):
                if a.assigned_at <= since:
                    break
                n, tokens = n + 1, tokens + a.prefill_tokens
            return n, tokens
        for a in self.unprefilled.values():
            if a.assigned_at > since:
                n, tokens = n + 1, tokens + a.prefill_tokens
        return n, tokens


class LoadTracker:
    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        self.stale_after_s = stale_after_s
        self._instances: dict[str, _Instance] = {}
        self._requests: dict[str, Assignment] = {}
        # NOTE: keyed by the assignment's instance whether or not it is registered: an instance
        # removed and registered again sees the requests still in flight on it.
        self._local: dict[str, _Local] = {}

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
        self.finished(request_id)  # a request id assigned again replaces its old assignment
        a = Assignment(instance_id, prefill_tokens, now, placement)
        self._requests[request_id] = a
        local = self._local.get(instance_id)
        if local is None:
            local = self._local[instance_id] = _Local()
        local.add(request_id, a)

    def prefill_done(self, request_id: str) -> Assignment | None:
        """Mark the request's prefill done; its assignment the first time, else None."""
        a = self._requests.get(request_id)
        if a is None or a.prefilled:
            return None
        a.prefilled = True
        local = self._local[a.instance_id]
        local.discard(request_id)
        local.prefilled += 1
        return a

    def finished(self, request_id: str) -> None:
        a = self._requests.pop(request_id, None)
        if a is None:
            return
        local = self._local[a.instance_id]
        if a.prefilled:
            local.prefilled -= 1
        else:
            local.discard(request_id)
        if not local.prefilled and not local.unprefilled:
            del self._local[a.instance_id]

    def in_flight(self) -> int:
        return len(self._requests)

    def views(self, now: float) -> list[InstanceView]:
        out = []
        local_of = self._local.get
        for iid, inst in self._instances.items():
            local = local_of(iid)
            snap = inst.snapshot
            if snap is not None and now - snap.ts <= self.stale_after_s:  # fresh
                n_newer, newer_tokens = (
                    local.newer(snap.ts) if local is not None and local.unprefilled else (0, 0)
                )
                waiting, running = snap.waiting + n_newer, snap.running
                kv_usage, pending = snap.gpu_kv_usage, snap.queued_prefill_tokens + newer_tokens
            elif local is not None:
                waiting, running = len(local.unprefilled), local.prefilled
                kv_usage, pending = 0.0, local.unprefilled_tokens
            else:
                waiting = running = pending = 0
                kv_usage = 0.0
            out.append(
                InstanceView(
                    iid,
                    inst.block_size,
                    inst.latency,
                    inst.kv_capacity_blocks,
                    waiting=waiting,
                    running=running,
                    gpu_kv_usage=kv_usage,
                    pending_prefill_tokens=pending,
                    healthy=inst.failures == 0,
                )
            )
        return out
