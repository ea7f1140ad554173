"""One router replica's view of the cluster: its copy of the cache map (fed by the KV event
bus), live load (load bus + own accounting), the scorer and admission.

The ingress and the Serve request router of one process share one ``RouterState``; a pump
thread runs an ``EngineWatcher`` over the buses every few milliseconds. Instances are known
from Serve's replica set (``sync_instances``) and from live load samples; one whose samples stop
is dropped. Bus trouble degrades routing quality (stale map, local-only load) but never fails a
request: errors are logged once and counted.

Setting ``KVROUTE_PLACEMENT_LOG`` to a file path appends one JSON line per placement (the
request, every candidate's load view and cached blocks, the choice and its estimate): the
record to read when routing looks wrong.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TextIO

from cachemap import CacheMap, Match
from cachemap.bus import EventBus
from cachemap.ingest import CacheMapIngestor
from engines.liveness import EngineWatcher
from router.admission import Admission
from router.load import LoadTracker
from router.placement import (
    InstanceView,
    LatencyModel,
    NoInstanceError,
    Placement,
    PlacementRequest,
    Scorer,
    create_scorer,
)

log = logging.getLogger(__name__)
_PLACEMENT_LOG = os.environ.get("KVROUTE_PLACEMENT_LOG", "")
_placement_log_file: TextIO | None = None  # opened on the first placement, line-buffered


def _log_placement(
    now: float,
    request: PlacementRequest,
    views: Sequence[InstanceView],
    match: Mapping[str, Match],
    placement: Placement,
) -> None:
    record = {
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
    global _placement_log_file
    try:
        if _placement_log_file is None:
            _placement_log_file = open(_PLACEMENT_LOG, "a", buffering=1)  # noqa: SIM115
        _placement_log_file.write(json.dumps(record) + "\n")
    except OSError as e:  # never fail a request over the debug log
        log.warning("placement log %s: %s", _PLACEMENT_LOG, e)


class RouterState:
    def __init__(
        self,
        scorer: Scorer | str = "kv_ttft",
        latency: LatencyModel | None = None,
        block_size: int = 16,
        kv_capacity_blocks: int = 0,
        kv_bus: EventBus | None = None,
        load_bus: EventBus | None = None,
        admission: Admission | None = None,
        stale_after_s: float = 2.0,
    ) -> None:
        """``kv_bus`` and ``load_bus`` come together (or neither: tests drive the state by hand);
        an instance silent on the load bus for ``stale_after_s`` is dropped."""
        self.scorer = create_scorer(scorer) if isinstance(scorer, str) else scorer
        self.latency = latency
        self.block_size = block_size
        self.kv_capacity_blocks = kv_capacity_blocks
        self.cache_map = CacheMap()
        self.ingestor = CacheMapIngestor(self.cache_map)
        self.load = LoadTracker(stale_after_s)
        self.admission = admission or Admission()
        self._lock = threading.Lock()
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
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bus_errors = 0

    # -- membership ------------------------------------------------------------------------------

    def sync_instances(self, instance_ids: Iterable[str]) -> None:
        """Make the known instances exactly ``instance_ids`` (Serve's live replica set); an
        instance that left is dropped from the cache map too."""
        want = set(instance_ids)
        with self._lock:
            have = set(self.load.instance_ids())
            for iid in want - have:
                self._add(iid)
            for iid in have - want:
                self._remove(iid)

    def _add(self, iid: str) -> None:
        if self.latency is None:
            raise RuntimeError("RouterState needs a latency model to add instances")
        self.load.register(iid, self.block_size, self.latency, self.kv_capacity_blocks)

    def _remove(self, iid: str) -> None:
        self.load.remove(iid)
        self.cache_map.drop_instance(iid)
        if self.watcher is not None:
            self.watcher.forget(iid)

    # -- the buses -------------------------------------------------------------------------------

    def pump(self, now: float | None = None) -> None:
        """Apply what the buses hold now: events, load samples, liveness, resync requests."""
        if self.watcher is None:
            return
        try:
            # NOTE: bus reads (a Ray actor call, a Redis round trip) happen outside the lock
            # that placement needs; only applying them holds it.
            fetched = self.watcher.fetch()
            now = time.time() if now is None else now
            with self._lock:
                dropped = self.watcher.apply(fetched, now)
                for iid in dropped:
                    self.load.remove(iid)
                known = set(self.load.instance_ids())
                for iid, sample in self.watcher.loads.items():
                    if iid not in known:
                        self._add(iid)
                    self.load.on_snapshot(sample)
        except Exception as e:  # a broken bus must not stop routing
            if not self.bus_errors:
                log.warning("event bus read failed; routing on stale state: %s", e)
            self.bus_errors += 1

    def start(self, interval_s: float = 0.005) -> None:
        if self._thread is not None or self.watcher is None:
            return

        def run() -> None:
            while not self._stop.is_set():
                self.pump()
                self._stop.wait(interval_s)

        self._thread = threading.Thread(target=run, name="kvroute-bus-pump", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # -- decisions -------------------------------------------------------------------------------

    def place(
        self,
        request: PlacementRequest,
        candidates: Sequence[str] | None = None,
        exclude: Iterable[str] = (),
        now: float | None = None,
    ) -> Placement:
        """Choose an instance among ``candidates`` (default: all known) minus ``exclude``."""
        now = time.time() if now is None else now
        excluded = set(exclude)
        with self._lock:
            views = self.load.views(now)
            allowed = set(candidates) if candidates is not None else None
            views = [
                v
                for v in views
                if v.instance_id not in excluded and (allowed is None or v.instance_id in allowed)
            ]
            if not views:
                raise NoInstanceError("no engine instance available")
            match = self.cache_map.match(request.block_hashes)
            placement = self.scorer.place(request, views, match)
        if _PLACEMENT_LOG:
            _log_placement(now, request, views, match, placement)
        return placement

    def cached_tokens(self, request: PlacementRequest, placement: Placement) -> int:
        """Prompt tokens ``placement`` expects its instance to spare ``request``."""
        return request.cached_tokens(placement.cached_blocks, self.block_size)

    def assigned(self, request: PlacementRequest, placement: Placement) -> None:
        uncached = request.prompt_tokens - self.cached_tokens(request, placement)
        now = time.time()
        with self._lock:
            self.load.assigned(request.request_id, placement.instance_id, uncached, now, placement)

    def first_token(self, request_id: str) -> None:
        now = time.time()
        with self._lock:
            a = self.load.prefill_done(request_id)
            if a is not None and a.placement is not None:
                self.scorer.on_first_token(a.placement, now - a.assigned_at)

    def finished(self, request: PlacementRequest, instance_id: str) -> None:
        with self._lock:
            self.load.finished(request.request_id)
            self.scorer.on_finished(request, instance_id)

    def failed(self, instance_id: str) -> None:
        with self._lock:
            self.load.mark_failed(instance_id)

    def needs_resync(self) -> set[str]:
        with self._lock:
            return set(self.ingestor.needs_resync)


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
