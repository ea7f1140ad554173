"""One router replica's view of the cluster, in two layers.

``RouterCore`` is the routing core: its copy of the cache map (fed by KV events through the
ingestion path), live load (load samples + its own in-flight accounting), liveness, the scorer
and admission. It reads no clock, starts no thread and opens no file: every method that needs
time takes ``now`` (seconds, on the clock of the engines' ``LoadSnapshot.ts``), and placements
go to an injected ``PlacementRecorder``. The production router and the cluster simulator
(``loadgen.simulator``, virtual time) run this same object.

``RouterState`` is the production shell around one core: a lock shared by the ingress and the
Serve request router of one process, the wall clock, and a pump thread that applies the buses
every few milliseconds (bus reads happen outside the lock). Instances are known from Serve's
replica set (``sync_instances``) and from live load samples; one whose samples stop is dropped.
Bus trouble degrades routing quality (stale map, local-only load) but never fails a request:
errors are logged once and counted.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol, TextIO

from cachemap import CacheMap, Match
from cachemap.bus import BusRead, EventBus
from cachemap.ingest import CacheMapIngestor
from engines.liveness import STALE_AFTER_S, EngineWatcher
from router.admission import Admission
from router.load import LoadTracker
from router.pd import PdPlanner
from router.placement import (
    InstanceView,
    LatencyModel,
    NoInstanceError,
    Placement,
    PlacementRequest,
    Scorer,
    create_scorer,
)
from router.pools import DEFAULT_POOL, Pool, Role, check_pools

log = logging.getLogger(__name__)

# Seconds between two reads of the KV-event and load buses by a running RouterState: what a
# KV event waits on the bus, at most, before it reaches this router's map. With the engines'
# ``PUBLISH_INTERVAL_S`` a block reaches the map at most ~150 ms after the engine stored it,
# which the cluster simulator prices at nothing measurable (see ``PUBLISH_INTERVAL_S``).
BUS_POLL_S = 0.05


# -- placement records -------------------------------------------------------------------------


class PlacementRecorder(Protocol):
    """Receives every placement as a ``placement_record`` entry: the record to read when routing
    looks wrong. Called outside the router's lock; must not raise."""

    def record(self, entry: dict[str, Any]) -> None: ...


def placement_record(
    now: float,
    request: PlacementRequest,
    views: Sequence[InstanceView],
    match: Mapping[str, Match],
    placement: Placement,
) -> dict[str, Any]:
    """One placement as a JSON-able dict: the request, every candidate's load view and cached
    blocks, the choice and its estimate."""
    return {
        "ts": now,
        "request": request.request_id,
        "prompt_tokens": request.prompt_tokens,
        "blocks": len(request.block_hashes),
        "chosen": placement.instance_id,
        "estimated_ttft_s": placement.estimated_ttft_s,
        "cached_blocks": placement.cached_blocks,
        "candidates": {
            v.instance_id: {
                "pending_prefill_tokens": v.pending_prefill_tokens,
                "waiting": v.waiting,
                "running": v.running,
                "gpu_kv_usage": round(v.gpu_kv_usage, 4),
                "cached_blocks": match[v.instance_id].total_blocks if v.instance_id in match else 0,
            }
            for v in views
        },
    }


class JsonlRecorder:
    """Appends one ``placement_record`` JSON line per placement to ``path`` (opened on the first
    placement, line-buffered). A write error is logged once; it never fails a request."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: TextIO | None = None
        self._lock = threading.Lock()
        self.errors = 0

    def record(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry) + "\n"
        with self._lock:
            try:
                if self._file is None:
                    self._file = open(self.path, "a", buffering=1)  # noqa: SIM115
                self._file.write(line)
            except OSError as e:
                if not self.errors:
                    log.warning("placement log %s: %s", self.path, e)
                self.errors += 1

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class MemoryRecorder:
    """Keeps every ``placement_record`` entry in ``records`` (tests, simulated runs)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def record(self, entry: dict[str, Any]) -> None:
        self.records.append(entry)


# -- the routing core --------------------------------------------------------------------------


class RouterCore:
    def __init__(
        self,
        scorer: Scorer | str = "kv_ttft",
        latency: LatencyModel | None = None,
        block_size: int = 16,
        kv_capacity_blocks: int = 0,
        kv_bus: EventBus | None = None,
        load_bus: EventBus | None = None,
        admission: Admission | None = None,
        stale_after_s: float = STALE_AFTER_S,
        recorder: PlacementRecorder | None = None,
        pools: Sequence[Pool] | None = None,
        planner: PdPlanner | None = None,
        event_stride: int = 1,
    ) -> None:
        """``kv_bus`` and ``load_bus`` come together (or neither: the caller then drives the
        core by hand); an instance silent on the load bus for ``stale_after_s`` is dropped.
        After a sequence gap the event bus's own ``request_resync`` (where it has one) asks the
        instance's forwarder for a snapshot.

        ``pools``: the deployment's engine pools (``router.pools``); the first is the default
        pool, where instances go that name no pool. None: one pool of role ``both`` named
        ``DEFAULT_POOL`` from ``latency``, ``block_size`` and ``kv_capacity_blocks``.
        ``planner``: places the two legs of a request when there are prefill or decode pools
        (``router.pd``; ``place`` then plans both). ``event_stride``: the engines' KV events
        keep every ``event_stride``-th block (``EngineConfig.event_stride``; the map's
        ``stride``)."""
        self.cache_map = CacheMap(stride=event_stride)
        self._scorer = create_scorer(scorer) if isinstance(scorer, str) else scorer
        self._scorer.attach(self.cache_map)
        if pools is None:
            pools = (Pool(DEFAULT_POOL, "both", block_size, latency, kv_capacity_blocks),)
        self.pools: dict[str, Pool] = {p.name: p for p in pools}
        check_pools(tuple(pools))
        self.default_pool = pools[0]
        self.block_size = self.default_pool.block_size
        self._pool_of: dict[str, Pool] = {}  # instance -> its pool
        self.planner = planner
        # prefill or decode pools: a request may go in two legs (``planner`` places them)
        self.disaggregated = any(p.role != "both" for p in pools)
        self.ingestor = CacheMapIngestor(self.cache_map)
        self.load = LoadTracker(stale_after_s)
        self.admission = admission or Admission()
        self.recorder = recorder
        if (kv_bus is None) != (load_bus is None):
            raise ValueError("kv_bus and load_bus go together: give both or neither")
        self.watcher = (
            EngineWatcher(
                kv_bus,
                load_bus,
                self.ingestor,
                timeout_s=stale_after_s,
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
        loads, load = self.watcher.loads, self.load
        # NOTE: every instance with a sample is known and holds its latest sample afterwards (a
        # newer sample clears its failures). Only the ones sampled, or registered, since the
        # last call can lack it: the others are not visited (hundreds of engines, each pump).
        if not load.knows_all(loads):
            known = set(load.instance_ids())
            pools = self.pools
            for iid, sample in loads.items():  # in sample order: the order of registration
                if iid not in known:
                    self.add_instance(iid, sample.pool if sample.pool in pools else None)
        for iid in (*self.watcher.take_sampled(), *load.take_registered()):
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
        plan = None
        if self.disaggregated and candidates is None:
            if self.planner is None:
                raise RuntimeError("a deployment with prefill or decode pools needs a PdPlanner")
            plan = self.planner.plan(self, request, views, match, colocate=rerun)
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

    def first_token(self, request_id: str, now: float, observed: bool = True) -> None:
        """The request's first output arrived; ``observed``: at its first token (a stream), so
        its TTFT teaches the scorer (an output delivered whole arrives at the end)."""
        a = self.load.prefill_done(request_id)
        if observed and a is not None and a.placement is not None:
            self.scorer.on_first_token(a.placement, now - a.assigned_at)

    def finished(self, request: PlacementRequest, instance_id: str) -> None:
        self.load.finished(request.request_id)
        self.scorer.on_finished(request, instance_id)

    def failed(self, instance_id: str) -> None:
        self.load.mark_failed(instance_id)


# -- the production shell ----------------------------------------------------------------------


class RouterState:
    """A ``RouterCore`` behind a lock, on the wall clock, with a bus pump thread. Takes the
    core's arguments; ``now`` defaults to ``clock()`` where a caller may pass it."""

    def __init__(self, *args: Any, clock: Callable[[], float] = time.time, **kwargs: Any) -> None:
        self.core = RouterCore(*args, **kwargs)
        self.clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # NOTE: not ``_thread``: compiled (deploy/native.py), that field is C's ``__thread``
        self._pump_thread: threading.Thread | None = None
        self.bus_errors = 0

    # what the ingress, the Serve router and /metrics read of the core
    @property
    def scorer(self) -> Scorer:
        return self.core.scorer

    @scorer.setter
    def scorer(self, scorer: Scorer) -> None:
        with self._lock:
            self.core.scorer = scorer

    @property
    def cache_map(self) -> CacheMap:
        return self.core.cache_map

    @property
    def load(self) -> LoadTracker:
        return self.core.load

    @property
    def admission(self) -> Admission:
        return self.core.admission

    @property
    def block_size(self) -> int:
        return self.core.block_size

    def sync_instances(self, instance_ids: Iterable[str], pool: str | None = None) -> None:
        with self._lock:
            self.core.sync_instances(instance_ids, pool)

    def pool_name(self, iid: str | None) -> str:
        """The pool of instance ``iid``; the default pool's for an unknown one or None."""
        p = self.core.pool_of(iid) if iid is not None else None
        return (p or self.core.default_pool).name

    def pump(self, now: float | None = None) -> None:
        """Apply what the buses hold now: events, load samples, liveness, resync requests."""
        try:
            # NOTE: bus reads (a Ray actor call, a Redis round trip) happen outside the lock
            # that placement needs; only applying them holds it.
            fetched = self.core.fetch()
            if fetched is None:
                return
            with self._lock:
                self.core.apply(fetched, self.clock() if now is None else now)
        except Exception as e:  # a broken bus must not stop routing
            if not self.bus_errors:
                log.warning("event bus read failed; routing on stale state: %s", e)
            self.bus_errors += 1
            if self.core.watcher is not None:
                with self._lock:  # engines are not silent while we cannot hear them
                    self.core.watcher.unreadable(self.clock() if now is None else now)

    def start(self, interval_s: float = BUS_POLL_S) -> None:
        """Pump the buses every ``interval_s`` in a thread of its own (each pump reads both
        buses in one round trip, ``EventBus.read_pair``: over the Ray bus, one actor call of
        ~1 ms of CPU, caller and hub, whether or not anything is new; at the 50 ms default and
        the engines' 100 ms publish interval the Ray hub spends 0.32-0.34 ms per
        ``ingress_bench`` request, against 0.57-0.70 ms at 20 and 50 ms)."""
        if self._pump_thread is not None or self.core.watcher is None:
            return

        def run() -> None:
            while not self._stop.is_set():
                self.pump()
                watcher = self.core.watcher
                if watcher is None or not watcher.consumer.full:  # behind: read on at once
                    self._stop.wait(interval_s)

        self._pump_thread = threading.Thread(target=run, name="kvroute-bus-pump", daemon=True)
        self._pump_thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._pump_thread is not None:
            self._pump_thread.join(timeout=5)
            self._pump_thread = None

    def place(
        self,
        request: PlacementRequest,
        candidates: Sequence[str] | None = None,
        exclude: Iterable[str] = (),
        now: float | None = None,
        rerun: bool = False,
    ) -> Placement:
        """Choose an instance among ``candidates`` (default: all known) minus ``exclude``
        (``rerun``: see ``RouterCore.decide``)."""
        now = self.clock() if now is None else now
        with self._lock:
            placement, entry = self.core.decide(request, now, candidates, exclude, rerun)
        if entry is not None and self.core.recorder is not None:  # outside the lock: a file write
            self.core.recorder.record(entry)
        return placement

    @property
    def disaggregated(self) -> bool:
        return self.core.disaggregated

    def cached_tokens(self, request: PlacementRequest, placement: Placement) -> int:
        return self.core.cached_tokens(request, placement)

    def observe(
        self, block_hashes: Sequence[int], now: float | None = None
    ) -> tuple[list[InstanceView], Mapping[str, Match]]:
        """What placement would see for a prompt, without placing it: every instance's load
        view and the cache map's match (the KV control API's lookup and warm)."""
        now = self.clock() if now is None else now
        with self._lock:
            return self.core.load.views(now), self.core.cache_map.match(block_hashes)

    def assigned(self, request: PlacementRequest, placement: Placement) -> None:
        now = self.clock()
        with self._lock:
            self.core.assigned(request, placement, now)

    def first_token(self, request_id: str, observed: bool = True) -> None:
        now = self.clock()
        with self._lock:
            self.core.first_token(request_id, now, observed)

    def finished(self, request: PlacementRequest, instance_id: str) -> None:
        with self._lock:
            self.core.finished(request, instance_id)

    def failed(self, instance_id: str) -> None:
        with self._lock:
            self.core.failed(instance_id)

    def needs_resync(self) -> set[str]:
        with self._lock:
            return set(self.core.ingestor.needs_resync)

    def views(self, now: float | None = None) -> list[InstanceView]:
        """Every instance's load as placement sees it now (the engine's last sample plus this
        router's requests since)."""
        with self._lock:
            return self.core.load.views(self.clock() if now is None else now)


# key -> the RouterState request routers with that ``state_key`` use in this process. It lives
# here, not in router.serve_router: Serve pickles that module by value (see its docstring).
_REGISTRY: dict[str, RouterState] = {}


def register_state(key: str, state: RouterState) -> None:
    """Make ``state`` the one request routers with ``state_key=key`` use in this process."""
    _REGISTRY[key] = state


def unregister_state(key: str, state: RouterState | None = None) -> None:
    """Forget ``key`` (only if it still maps to ``state``, when given)."""
    if state is None or _REGISTRY.get(key) is state:
        _REGISTRY.pop(key, None)


def registered_state(key: str) -> RouterState | None:
    return _REGISTRY.get(key)
