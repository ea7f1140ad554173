"""The routing core of one router replica: its copy of the cache map (fed by KV events through
the ingestion path), live load (load samples + its own in-flight accounting), liveness, the
scorer and admission.

``RouterCore`` reads no clock, starts no thread and opens no file: every method that needs time
takes ``now`` (seconds, on the clock of the engines' ``LoadSnapshot.ts``), and placements go to
an injected ``router.recorder.PlacementRecorder``. The production router (``router.state``'s
shell) and the cluster simulator (``simulation.cluster``, virtual time) run this same object.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from cachemap import CacheMap
from cachemap.ingest import CacheMapIngestor
from engines.bus.base import BusRead, EventBus
from engines.bus.liveness import EngineWatcher
from engines.pool.link import PoolLink
from engines.profile import LatencyProfile
from router.inflight import InFlightPrompts
from router.load import LoadTracker
from router.pd import PdPlanner
from router.placement import (
    NoInstanceError,
    Placement,
    PlacementRequest,
    Scorer,
)
from router.pools import DEFAULT_POOL, Pool, Role, check_pools
from router.recorder import PlacementRecorder, placement_record
from router.settings import DEFAULTS, RouterSettings

# another replica's request in this replica's in-flight prompts (no client id looks like it)
_PEER = "\x00peer/"


@dataclass(frozen=True, slots=True)
class SharedAssignment:
    """One replica's assignment as the other replicas count it (``RouterCore.peer_assigned``):
    ``prefill_tokens`` uncached tokens sent to ``instance_id`` at ``at``, whose prompt
    (``block_hashes``) is computed on ``first_instance`` (its prefill leg's, when split)."""

    request_id: str
    instance_id: str
    prefill_tokens: int
    at: float
    first_instance: str
    block_hashes: Sequence[int]


class AssignmentChannel(Protocol):
    """Where a router replica shares its assignments with the others (herding: a replica
    otherwise sees another's prompts only in the engines' next reports)."""

    def sent(self, assignment: SharedAssignment) -> None: ...

    def done(self, request_id: str, at: float) -> None:
        """The request had its first token at ``at`` (or ended without one)."""


class RouterCore:
    def __init__(
        self,
        settings: RouterSettings = DEFAULTS,
        latency: LatencyProfile | None = None,
        *,
        scorer: Scorer | None = None,
        kv_bus: EventBus | None = None,
        load_bus: EventBus | None = None,
        recorder: PlacementRecorder | None = None,
        pools: Sequence[Pool] | None = None,
        planner: PdPlanner | None = None,
        kv_pool: PoolLink | None = None,
    ) -> None:
        """``settings``: the router's configuration, whole (``router.settings``); ``scorer``:
        a scorer built by the caller, in place of the one ``settings`` names. ``kv_bus`` and
        ``load_bus`` come together (or neither: the caller then drives the core by hand); an
        instance silent on the load bus for ``settings.stale_after_s`` is dropped. After a
        sequence gap the event bus's own ``request_resync`` (where it has one) asks the
        instance's forwarder for a snapshot.

        ``pools``: the deployment's engine pools (``router.pools``); the first is the default
        pool, where instances go that name no pool. None: one pool of role ``both`` named
        ``DEFAULT_POOL`` from ``latency`` and the settings' ``block_size`` and
        ``kv_capacity_blocks``. ``planner``: places the two legs of a request when there are
        prefill or decode pools (``router.pd``, ``RouterSettings.pd_planner``; ``place`` then
        plans both). ``kv_pool``: every engine's link to the cluster KV pool, whose residency
        the map holds as ``cachemap.POOL_INSTANCE`` (None: no pool, or the router does not
        price it)."""
        self.settings = settings
        self.cache_map = CacheMap(stride=settings.event_stride)
        self.kv_pool = kv_pool
        # where this replica's assignments are shared with the other router replicas
        # (``peer_assigned`` and ``peer_done`` there); None: they are not
        self.share: AssignmentChannel | None = None
        self._scorer = scorer if scorer is not None else settings.create_scorer()
        self._scorer.attach(self.cache_map)
        self._scorer.attach_pool(kv_pool)
        if pools is None:
            bs, capacity = settings.block_size, settings.kv_capacity_blocks
            pools = (Pool(DEFAULT_POOL, "both", bs, latency, capacity),)
        self.pools: dict[str, Pool] = {p.name: p for p in pools}
        check_pools(tuple(pools))
        self.default_pool = pools[0]
        self.block_size = self.default_pool.block_size
        self._pool_of: dict[str, Pool] = {}  # instance -> its pool
        self.planner = planner
        # prefill or decode pools: a request may go in two legs (``planner`` places them)
        self.disaggregated = any(p.role != "both" for p in pools)
        self.ingestor = CacheMapIngestor(self.cache_map)
        self.load = LoadTracker(settings.stale_after_s)
        # prompts sent whose KV the map does not show yet (``router.inflight``)
        self.inflight = InFlightPrompts() if settings.inflight_prompts else None
        self.admission = settings.admission()
        self.recorder = recorder
        if (kv_bus is None) != (load_bus is None):
            raise ValueError("kv_bus and load_bus go together: give both or neither")
        self.watcher = (
            EngineWatcher(
                kv_bus,
                load_bus,
                self.ingestor,
                timeout_s=settings.stale_after_s,
                request_resync=getattr(kv_bus, "request_resync", None),
            )
            if kv_bus is not None and load_bus is not None
            else None
        )

    @property
    def scorer(self) -> Scorer:
        return self._scorer

    @scorer.setter
    def scorer(self, scorer: Scorer) -> None:
        scorer.attach(self.cache_map)
        scorer.attach_pool(self.kv_pool)
        self._scorer = scorer

    # -- membership ------------------------------------------------------------------------------

    def sync_instances(self, instance_ids: Iterable[str], pool: str | None = None) -> None:
        """Make the known instances of ``pool`` (default: the default pool) exactly
        ``instance_ids`` (Serve's live replica set of that pool's deployment); an instance
        that left is dropped from the cache map too, and other pools are untouched. New
        instances are registered in sorted order, so scorers that break ties by position see
        the same order in every process (router replicas, repeated simulations), not a set's
        hash order. An instance known in another pool moves to this one."""
        target = self._pool(pool)
        want = set(instance_ids)
        have = {iid for iid, p in self._pool_of.items() if p is target}
        for iid in sorted(want - have):
            self.add_instance(iid, target.name)
        for iid in sorted(have - want):
            self.remove_instance(iid)

    def _pool(self, name: str | None) -> Pool:
        if name is None:
            return self.default_pool
        pool = self.pools.get(name)
        if pool is None:
            raise ValueError(f"unknown pool {name!r}; pools: {', '.join(self.pools)}")
        return pool

    def add_instance(self, iid: str, pool: str | None = None) -> None:
        """Register ``iid`` as an instance of ``pool`` (default: the default pool)."""
        p = self._pool(pool)
        if p.latency is None:
            raise RuntimeError("the router needs a latency model to add instances")
        self.load.register(iid, p.block_size, p.latency, p.kv_capacity_blocks)
        self._pool_of[iid] = p

    def pool_of(self, iid: str) -> Pool | None:
        """The pool of a known instance (None: not known)."""
        return self._pool_of.get(iid)

    def role_of(self, iid: str) -> Role:
        """The role of ``iid``'s pool (an unknown instance: the default pool's)."""
        pool = self._pool_of.get(iid)
        return pool.role if pool is not None else self.default_pool.role

    def members(self, roles: Iterable[Role] | None = None) -> list[str]:
        """The known instances (of the given roles), in registration order."""
        if roles is None:
            return list(self._pool_of)
        want = set(roles)
        return [iid for iid, p in self._pool_of.items() if p.role in want]

    def remove_instance(self, iid: str) -> None:
        self._pool_of.pop(iid, None)
        self.load.remove(iid)
        self.cache_map.drop_instance(iid)
        if self.inflight is not None:
            self.inflight.drop_instance(iid)
        if self.watcher is not None:
            self.watcher.forget(iid)

    # -- the buses -------------------------------------------------------------------------------

    def fetch(self) -> tuple[BusRead, BusRead] | None:
        """Read both buses (the I/O half of ``pump``; touches no routing state)."""
        return self.watcher.fetch() if self.watcher is not None else None

    def apply(self, fetched: tuple[BusRead, BusRead] | None, now: float) -> None:
        """Apply what ``fetch`` read: events, load samples, liveness, resync requests."""
        if self.watcher is None or fetched is None:
            return
        dropped = self.watcher.apply(fetched, now)
        for iid in dropped:
            self.load.remove(iid)
            self._pool_of.pop(iid, None)
            if self.inflight is not None:
                self.inflight.drop_instance(iid)
        loads, load = self.watcher.loads, self.load
        # NOTE: every instance with a sample is known and holds its latest sample afterwards (a
        # newer sample clears its failures). Only the ones sampled, or registered, since the
        # last call can lack it (an instance leaves the load table only with its sample:
        # ``remove_instance``, or dropped as silent): the others are not visited (hundreds of
        # engines, each pump).
        sampled = self.watcher.take_sampled()
        pools = self.pools
        for iid in sampled:  # in sample order: the order of registration
            sample = loads.get(iid)
            if sample is not None and not load.knows(iid):
                self.add_instance(iid, sample.pool if sample.pool in pools else None)
        for iid in (*sampled, *load.take_registered()):
            latest = loads.get(iid)
            if latest is not None:
                load.on_snapshot(latest)

    def pump(self, now: float) -> None:
        self.apply(self.fetch(), now)

    # -- decisions -------------------------------------------------------------------------------

    def place(
        self,
        request: PlacementRequest,
        now: float,
        candidates: Sequence[str] | None = None,
        exclude: Iterable[str] = (),
        rerun: bool = False,
    ) -> Placement:
        """Choose an instance among ``candidates`` (default: all known) minus ``exclude``."""
        placement, entry = self.decide(request, now, candidates, exclude, rerun)
        if entry is not None and self.recorder is not None:
            self.recorder.record(entry)
        return placement

    def decide(
        self,
        request: PlacementRequest,
        now: float,
        candidates: Sequence[str] | None = None,
        exclude: Iterable[str] = (),
        rerun: bool = False,
    ) -> tuple[Placement, dict[str, Any] | None]:
        """``place`` without recording: the placement, and its ``placement_record`` entry when
        there is a recorder to give it to (the caller records it, e.g. outside a lock).

        With prefill or decode pools (and no ``candidates``) the planner places both legs: the
        placement is the decode engine's, with its ``prefill`` leg (None: colocated).
        ``rerun``: a request whose hand-over or decode failed, placed whole on a decode-capable
        engine (which recomputes its prompt)."""
        excluded = set(exclude)
        allowed = set(candidates) if candidates is not None else None
        views = self.load.views(now)
        if excluded or allowed is not None:
            views = [
                v
                for v in views
                if v.instance_id not in excluded and (allowed is None or v.instance_id in allowed)
            ]
        match = self.cache_map.match(request.block_hashes)
        if self.inflight is not None:
            # NOTE: every instance's view, not only the candidates': like the cache map's own
            # answer, the match may name instances that are no candidate, which scorers skip
            match = self.inflight.extend(request.block_hashes, match, self.load.view)
        plan = None
        if self.disaggregated and candidates is None:
            if self.planner is None:
                raise RuntimeError("a deployment with prefill or decode pools needs a PdPlanner")
            plan = self.planner.plan(self.scorer, self.role_of, request, views, match, rerun)
            placement = replace(
                plan.decode, prefill=plan.prefill, transfer_tokens=plan.transfer_tokens
            )
        else:
            if not views:
                raise NoInstanceError("no engine instance available")
            placement = self.scorer.place(request, views, match)
        if self.recorder is None:
            return placement, None
        entry = placement_record(now, request, views, match, placement)
        if plan is not None:
            entry["pd"] = plan.record()
        return placement, entry

    def cached_tokens(self, request: PlacementRequest, placement: Placement) -> int:
        """Prompt tokens ``placement`` expects its instance to spare ``request``."""
        return request.cached_tokens(placement.cached_blocks, self.block_size)

    def assigned(self, request: PlacementRequest, placement: Placement, now: float) -> None:
        """``request`` was sent where ``placement`` says; the decode leg of a split request
        (``placement.prefill``) computes only the prompt's last token once its KV arrives."""
        if placement.prefill is not None:
            uncached = 1
        else:
            uncached = request.prompt_tokens - self.cached_tokens(request, placement)
        self.load.assigned(request.request_id, placement.instance_id, uncached, now, placement)
        first = placement.prefill or placement
        if self.share is not None:
            self.share.sent(
                SharedAssignment(
                    request.request_id,
                    placement.instance_id,
                    uncached,
                    now,
                    first.instance_id,
                    request.block_hashes,
                )
            )
        if self.inflight is not None:
            self.inflight.sent(request.request_id, first.instance_id, request.block_hashes)

    def peer_assigned(self, a: SharedAssignment) -> None:
        """Another router replica sent a prompt: counted in its instance's load
        (``LoadTracker.peer_assigned``) and, with ``inflight_prompts``, as a prompt in flight to
        its ``first_instance`` until ``peer_done``."""
        self.load.peer_assigned(a.instance_id, a.prefill_tokens, a.at)
        if self.inflight is not None:
            self.inflight.sent(_PEER + a.request_id, a.first_instance, a.block_hashes)

    def peer_done(self, request_id: str) -> None:
        """Another replica's prompt had its first token (or ended)."""
        if self.inflight is not None:
            self.inflight.done(_PEER + request_id)

    def first_token(self, request_id: str, now: float, observed: bool = True) -> None:
        """The request's first output arrived; ``observed``: at its first token (a stream), so
        its TTFT teaches the scorer (an output delivered whole arrives at the end)."""
        a = self.load.prefill_done(request_id, now)
        if self.inflight is not None:
            self.inflight.done(request_id)
        if self.share is not None:
            self.share.done(request_id, now)
        if observed and a is not None and a.placement is not None:
            self.scorer.on_first_token(a.placement, now - a.assigned_at)

    def finished(self, request: PlacementRequest, instance_id: str) -> None:
        a = self.load.finished(request.request_id)
        if self.inflight is not None:
            self.inflight.done(request.request_id)
        if self.share is not None and a is not None and not a.prefilled:
            self.share.done(request.request_id, a.assigned_at)  # ended without a first token
        self.scorer.on_finished(request, instance_id)

    def failed(self, instance_id: str) -> None:
        self.load.mark_failed(instance_id)
