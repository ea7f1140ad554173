"""Live load per instance: engine load snapshots from the bus, combined with this router's own
in-flight accounting (assigned -> prefill done -> finished).

Snapshots arrive every ~100 ms and cover every router replica's requests. A snapshot is read
as of now, not as of when it was taken: this replica's assignments made after it are added on
top (after the time the engine had taken its requests by, where it says: ``taken_by``); its
prompts that had their first token after it are taken out (an engine counts a prompt as
queued until its first token, ``LoadSnapshot.queued_prefill_tokens``, and this replica sees that
token come); and the prefill step an engine is computing, which a report may leave out, is priced
from this replica's own backlog there (``LoadTracker._with_backlog``).
Without a fresh snapshot (engine silent for ``stale_after_s``) the local accounting alone is
used. Time is an argument (``now``, seconds on the same clock as ``LoadSnapshot.ts``).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from engines.base import LoadSnapshot
from engines.bus.liveness import STALE_AFTER_S
from engines.profile import LatencyProfile
from router.placement import InstanceView, Placement


@dataclass(slots=True)
class Assignment:
    instance_id: str
    prefill_tokens: int
    assigned_at: float
    placement: Placement | None = None
    prefilled: bool = False
    engine_s: float = 0.0  # its prefill on an idle engine there, as this router prices it


@dataclass(slots=True)
class _Instance:
    block_size: int
    latency: LatencyProfile
    kv_capacity_blocks: int
    snapshot: LoadSnapshot | None = None
    failures: int = 0
    # prompt tokens per second its latency model computes in full steps (0: unknown), what a
    # backlog in seconds is worth in queued tokens (``LoadTracker._with_backlog``)
    step_rate: float = 0.0
    # this router's prompts whose first token came after the snapshot was taken, in the order
    # it came: (when, the prefill tokens the snapshot counted of it), and those tokens summed
    # (``LoadTracker._view`` takes them out of the snapshot)
    first_tokens: deque[tuple[float, int]] = field(default_factory=deque)
    first_token_tokens: int = 0
    # other router replicas' prompts sent here after the snapshot was taken, as they shared
    # them (``LoadTracker.peer_assigned``): (when, prefill tokens), and those tokens summed
    peers: deque[tuple[float, int]] = field(default_factory=deque)
    peer_tokens: int = 0

    def drop_first_tokens(self, until: float, sent_until: float | None = None) -> None:
        """Forget the first tokens that came at ``until`` or before, and the peers' prompts
        sent by ``sent_until`` (default ``until``): a snapshot taken at ``until``, of an engine
        that had taken the requests sent by ``sent_until``, counts them."""
        done = self.first_tokens
        while done and done[0][0] <= until:
            self.first_token_tokens -= done.popleft()[1]
        peers = self.peers
        sent = until if sent_until is None else sent_until
        while peers and peers[0][0] <= sent:
            self.peer_tokens -= peers.popleft()[1]

    def __post_init__(self) -> None:
        step = self.latency.max_num_batched_tokens
        step_s = self.latency.ttft_s(step)
        self.step_rate = step / step_s if step_s > 0 else 0.0


@dataclass(slots=True)
class _Local:
    """This router's in-flight requests on one instance, kept up to date as they progress so
    ``views`` does not go over every request in flight on every placement."""

    unprefilled: dict[str, Assignment] = field(default_factory=dict)  # in assignment order
    unprefilled_tokens: int = 0
    prefilled: int = 0
    # when the engine finishes the prefill of ``unprefilled``, as this router prices it: each
    # one's ``engine_s``, one after another, none before it was sent (-inf: none in flight)
    busy_until: float = -float("inf")
    # assigned_at never decreases along ``unprefilled`` (true unless the clock went back)
    in_time_order: bool = True

    def add(self, request_id: str, a: Assignment) -> None:
        if self.unprefilled:
            last = next(reversed(self.unprefilled.values()))
            self.in_time_order = self.in_time_order and a.assigned_at >= last.assigned_at
        self.unprefilled[request_id] = a
        self.unprefilled_tokens += a.prefill_tokens
        self.busy_until = max(self.busy_until, a.assigned_at) + a.engine_s

    def discard(self, request_id: str) -> None:
        a = self.unprefilled.pop(request_id)
        self.unprefilled_tokens -= a.prefill_tokens
        if not self.unprefilled:
            self.in_time_order = True
        until = -float("inf")
        for b in self.unprefilled.values():
            until = max(until, b.assigned_at) + b.engine_s
        self.busy_until = until

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
    """Every registered instance's ``InstanceView``. ``views`` keeps the view of an instance
    whose state did not change since the last call (the same object: scorers may cache what
    they derived from it), so a placement among hundreds of mostly quiet engines rebuilds only
    the views of those that moved. Callers must not modify the views they get."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        self.stale_after_s = stale_after_s
        self._instances: dict[str, _Instance] = {}
        self._requests: dict[str, Assignment] = {}
        # NOTE: keyed by the assignment's instance whether or not it is registered: an instance
        # removed and registered again sees the requests still in flight on it.
        self._local: dict[str, _Local] = {}
        self._registered: dict[str, None] = {}  # since the last ``take_registered``
        # the views of the last ``views`` call, in registration order (None: rebuild all),
        # the instances whose view may have changed since, and for each view built from a
        # fresh snapshot that snapshot's time (it goes stale as ``now`` moves on)
        self._order: list[InstanceView] | None = None
        self._pos: dict[str, int] = {}
        self._dirty: set[str] = set()
        self._fresh_ts: dict[str, float] = {}
        self._oldest_fresh = float("inf")  # at most the oldest of ``_fresh_ts``
        self._last_now = -float("inf")
        # instances whose view the backlog raised (``_with_backlog``): the report it raised,
        # which only the backlog's shrinking changes until the instance is marked dirty
        self._busy: dict[str, int] = {}

    def register(
        self,
        instance_id: str,
        block_size: int,
        latency: LatencyProfile,
        kv_capacity_blocks: int = 0,
    ) -> None:
        self._instances[instance_id] = _Instance(block_size, latency, kv_capacity_blocks)
        self._registered[instance_id] = None
        self._order = None

    def remove(self, instance_id: str) -> None:
        if self._instances.pop(instance_id, None) is not None:
            self._order = None

    def instance_ids(self) -> list[str]:
        return list(self._instances)

    def knows(self, instance_id: str) -> bool:
        """Whether ``instance_id`` is a registered instance."""
        return instance_id in self._instances

    def take_registered(self) -> list[str]:
        """The instances registered since the last call (which have no snapshot yet, unless
        one was given since)."""
        out = list(self._registered)
        self._registered.clear()
        return out

    def on_snapshot(self, snap: LoadSnapshot) -> None:
        iid = snap.instance_id
        inst = self._instances.get(iid)
        if inst is not None and (inst.snapshot is None or snap.ts >= inst.snapshot.ts):
            # NOTE: only a newer sample clears failures: the same one applied again says nothing
            # of the engine since the failure
            newer = inst.snapshot is None or snap.ts > inst.snapshot.ts
            inst.snapshot = snap
            inst.drop_first_tokens(snap.ts, taken_by(snap))  # the snapshot counts them
            if inst.failures and newer:
                inst.failures = 0
            self._dirty.add(iid)

    def peer_assigned(self, instance_id: str, prefill_tokens: int, at: float) -> None:
        """Another router replica sent a prompt of ``prefill_tokens`` uncached tokens to
        ``instance_id`` at ``at`` (its reservation, shared between replicas): counted in the
        instance's view until a snapshot taken after ``at`` counts it itself. Without it a
        replica sees another's prompts only from the engine's next report, and replicas that
        each see an engine idle all send to it (herding)."""
        inst = self._instances.get(instance_id)
        if inst is None or (inst.snapshot is not None and at <= taken_by(inst.snapshot)):
            return
        bisect.insort(inst.peers, (at, prefill_tokens))  # by time, though they may come late
        inst.peer_tokens += prefill_tokens
        self._dirty.add(instance_id)

    def mark_failed(self, instance_id: str) -> None:
        """A call to the instance failed; it is skipped until its next load snapshot."""
        inst = self._instances.get(instance_id)
        if inst is not None:
            inst.failures += 1
            self._dirty.add(instance_id)

    def assigned(
        self,
        request_id: str,
        instance_id: str,
        prefill_tokens: int,
        now: float,
        placement: Placement | None = None,
    ) -> None:
        self.finished(request_id)  # a request id assigned again replaces its old assignment
        inst = self._instances.get(instance_id)
        engine_s = inst.latency.ttft_s(prefill_tokens) if inst and prefill_tokens > 0 else 0.0
        a = Assignment(instance_id, prefill_tokens, now, placement, engine_s=engine_s)
        self._requests[request_id] = a
        local = self._local.get(instance_id)
        if local is None:
            local = self._local[instance_id] = _Local()
        local.add(request_id, a)
        self._dirty.add(instance_id)

    def prefill_done(self, request_id: str, now: float) -> Assignment | None:
        """Mark the request's prefill done (its first token came at ``now``); its assignment
        the first time, else None."""
        a = self._requests.get(request_id)
        if a is None or a.prefilled:
            return None
        a.prefilled = True
        inst = self._instances.get(a.instance_id)
        # NOTE: only a snapshot taken before the first token counts the prompt; one fresh
        # from now on is at most stale_after_s old, so older first tokens say nothing to it
        if inst is not None and a.prefill_tokens:
            snap = inst.snapshot
            inst.drop_first_tokens(now - self.stale_after_s)
            if snap is None or now > snap.ts:
                inst.first_tokens.append((now, a.prefill_tokens))
                inst.first_token_tokens += a.prefill_tokens
        local = self._local[a.instance_id]
        local.discard(request_id)
        local.prefilled += 1
        self._dirty.add(a.instance_id)
        return a

    def finished(self, request_id: str) -> Assignment | None:
        """The request ended: its assignment, forgotten (None: none was known)."""
        a = self._requests.pop(request_id, None)
        if a is None:
            return None
        local = self._local[a.instance_id]
        if a.prefilled:
            local.prefilled -= 1
        else:
            local.discard(request_id)
        if not local.prefilled and not local.unprefilled:
            del self._local[a.instance_id]
        self._dirty.add(a.instance_id)
        return a

    def in_flight(self) -> int:
        return len(self._requests)

    def views(self, now: float) -> list[InstanceView]:
        order, dirty, fresh_ts = self._order, self._dirty, self._fresh_ts
        if order is None or now < self._last_now:  # new members, or the clock went back
            fresh_ts.clear()
            self._busy.clear()  # every view is redone, and says again where a backlog binds
            self._oldest_fresh = float("inf")
            self._pos = {iid: i for i, iid in enumerate(self._instances)}
            order = [self._view(iid, inst, now, None) for iid, inst in self._instances.items()]
            self._order = order
        else:
            # NOTE: ``now - ts`` only shrinks as ts grows, so while the oldest fresh snapshot
            # is within ``stale_after_s`` all are, and no view went stale by time alone.
            expired = now - self._oldest_fresh > self.stale_after_s
            if expired:
                dirty.update(i for i, ts in fresh_ts.items() if now - ts > self.stale_after_s)
            pos, instances = self._pos, self._instances
            for iid in dirty:
                i = pos.get(iid)
                if i is not None:
                    order[i] = self._view(iid, instances[iid], now, order[i])
            # the rest of those the backlog raised: only its part changes with time
            for iid, base in [b for b in self._busy.items() if b[0] not in dirty]:
                i = pos.get(iid)
                if i is not None:
                    order[i] = self._rebacklogged(iid, base, now, order[i])
            if expired:
                self._oldest_fresh = min(fresh_ts.values(), default=float("inf"))
        dirty.clear()
        self._last_now = now
        return list(order)

    def view(self, instance_id: str) -> InstanceView | None:
        """The view the last ``views`` call gave of ``instance_id`` (None: it gave none)."""
        order = self._order
        i = self._pos.get(instance_id)
        return order[i] if order is not None and i is not None else None

    @staticmethod
    def _with_backlog(inst: _Instance, local: _Local | None, pending: int, now: float) -> int:
        """``pending`` (a snapshot's queued prefill tokens plus newer assignments), raised to
        this router's own backlog on the instance where that is more, by at most one step.

        A report of what an engine has still to schedule (vLLM's scheduler counts a prompt's
        tokens as computed when it schedules them; the sim engine with
        ``queued_until_first_token=false``) leaves out the step in flight: up to
        ``max_num_batched_tokens`` tokens, hundreds of ms of prefill, so an engine busy for
        most of a step reads as idle. The router knows when it sent each prompt and what that
        prompt costs there; what of it is not done yet by that pricing (``_Local.busy_until``,
        in tokens at the full-step rate) stands in for the missing step, never for more than
        one: the snapshot covers the rest, and other router replicas' requests. kvroute's
        engines (the vLLM engine; the sim engine by default) count a prompt until its first
        token, step in flight included: there the backlog exceeds the report mostly when the
        report is older than its own prompts' first tokens."""
        if local is None or local.busy_until <= now or not inst.step_rate:
            return pending
        backlog = round((local.busy_until - now) * inst.step_rate)
        return max(pending, min(backlog, pending + inst.latency.max_num_batched_tokens))

    def _rebacklogged(self, iid: str, base: int, now: float, old: InstanceView) -> InstanceView:
        """``old`` (``iid``'s view, unchanged but for time since) with the backlog as of now
        over ``base``, the report without it: what ``_view`` would give, without redoing the
        rest."""
        inst = self._instances[iid]
        pending = self._with_backlog(inst, self._local.get(iid), base, now)
        if pending <= base:
            del self._busy[iid]
        return _kept_or_new(
            iid, inst, old, old.waiting, old.running, old.gpu_kv_usage, pending, old.healthy
        )

    def _view(
        self, iid: str, inst: _Instance, now: float, old: InstanceView | None
    ) -> InstanceView:
        """``iid``'s view now; ``old`` (its previous view) when nothing in it changed."""
        local = self._local.get(iid)
        snap = inst.snapshot
        if snap is not None and now - snap.ts <= self.stale_after_s:  # fresh
            n_newer, newer_tokens = (
                local.newer(taken_by(snap)) if local is not None and local.unprefilled else (0, 0)
            )
            waiting, running = snap.waiting + n_newer + len(inst.peers), snap.running
            kv_usage = snap.gpu_kv_usage
            # prompts the snapshot counted that have had their first token since
            queued = max(snap.queued_prefill_tokens - inst.first_token_tokens, 0)
            base = queued + newer_tokens + inst.peer_tokens
            pending = self._with_backlog(inst, local, base, now)
            # the backlog raises the report now; it only shrinks as time passes, so once it
            # does not it will not again until the instance changes (and is marked dirty)
            timed = pending > base
            self._fresh_ts[iid] = snap.ts
            self._oldest_fresh = min(self._oldest_fresh, snap.ts)
        else:
            self._fresh_ts.pop(iid, None)
            timed, base = False, 0
            if local is not None:
                waiting, running = len(local.unprefilled), local.prefilled
                kv_usage, pending = 0.0, local.unprefilled_tokens
            else:
                waiting = running = pending = 0
                kv_usage = 0.0
        # NOTE: a backlog that raises the report changes the view as time passes: its part is
        # redone at every ``views`` until it no longer does (``_rebacklogged``; a clock that
        # steps back rebuilds every view)
        if timed:
            self._busy[iid] = base
        else:
            self._busy.pop(iid, None)
        healthy = inst.failures == 0
        return _kept_or_new(iid, inst, old, waiting, running, kv_usage, pending, healthy)


def taken_by(snap: LoadSnapshot) -> float:
    """The time by which ``snap``'s engine had taken every request sent to it: a request sent
    later is not in the snapshot (``LoadSnapshot.inputs_ts``, where the engine says; else the
    snapshot's time, as a front end that counts what it was sent does)."""
    inputs = snap.inputs_ts
    return inputs if 0.0 < inputs < snap.ts else snap.ts


def _kept_or_new(
    iid: str,
    inst: _Instance,
    old: InstanceView | None,
    waiting: int,
    running: int,
    kv_usage: float,
    pending: int,
    healthy: bool,
) -> InstanceView:
    """``old`` where it holds these figures (a view kept is the same object), else a new view."""
    if (
        old is not None
        and old.waiting == waiting
        and old.running == running
        and old.gpu_kv_usage == kv_usage
        and old.pending_prefill_tokens == pending
        and old.healthy == healthy
    ):
        return old
    return InstanceView(
        iid,
        inst.block_size,
        inst.latency,
        inst.kv_capacity_blocks,
        waiting=waiting,
        running=running,
        gpu_kv_usage=kv_usage,
        pending_prefill_tokens=pending,
        healthy=healthy,
    )
