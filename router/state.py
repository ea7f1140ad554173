"""One router replica's view of the cluster: its copy of the cache map (fed by the KV event
bus), live load (load bus + own accounting), the scorer and admission.

The ingress and the Serve request router of one process share one ``RouterState``; a pump
thread applies bus messages every few milliseconds. Bus trouble degrades routing quality (stale
map, local-only load) but never fails a request: errors are logged once and counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence

import msgspec

from cachemap import CacheMap
from cachemap.bus import BusConsumer, EventBus
from cachemap.ingest import CacheMapIngestor
from engines.base import LoadSnapshot
from router.admission import Admission
from router.load import LoadTracker
from router.placement import (
    LatencyModel,
    NoInstanceError,
    Placement,
    PlacementRequest,
    Scorer,
    create_scorer,
)

log = logging.getLogger(__name__)
_load_decoder = msgspec.msgpack.Decoder(LoadSnapshot)


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
        self.scorer = create_scorer(scorer) if isinstance(scorer, str) else scorer
        self.latency = latency
        self.block_size = block_size
        self.kv_capacity_blocks = kv_capacity_blocks
        self.cache_map = CacheMap()
        self.ingestor = CacheMapIngestor(self.cache_map)
        self.load = LoadTracker(stale_after_s)
        self.admission = admission or Admission()
        self._lock = threading.Lock()
        self._kv = BusConsumer(kv_bus, self.ingestor) if kv_bus is not None else None
        self._load_bus = load_bus
        self._load_cursor = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bus_errors = 0
        self.decisions = 0

    # -- membership ------------------------------------------------------------------------------

    def sync_instances(self, instance_ids: Iterable[str]) -> None:
        """Make the known instances exactly ``instance_ids`` (Serve's live replica set); an
        instance that left is dropped from the cache map too."""
        want = set(instance_ids)
        with self._lock:
            have = set(self.load.instance_ids())
            for iid in want - have:
                if self.latency is None:
                    raise RuntimeError("RouterState needs a latency model to add instances")
                self.load.register(iid, self.block_size, self.latency, self.kv_capacity_blocks)
            for iid in have - want:
                self.load.remove(iid)
                self.cache_map.drop_instance(iid)

    # -- the bus ---------------------------------------------------------------------------------

    def pump(self, max_items: int = 4096) -> int:
        """Apply what the buses hold now; returns the number of messages read."""
        n = 0
        try:
            if self._kv is not None:
                with self._lock:
                    n += self._kv.pump(max_items)
            if self._load_bus is not None:
                got = self._load_bus.read(self._load_cursor, max_items)
                self._load_cursor = got.cursor
                with self._lock:
                    for payload in got.items:
                        try:
                            self.load.on_snapshot(_load_decoder.decode(payload))
                        except (msgspec.DecodeError, msgspec.ValidationError):
                            self.bus_errors += 1
                n += len(got.items)
        except Exception as e:  # a broken bus must not stop routing
            if not self.bus_errors:
                log.warning("event bus read failed; routing on stale state: %s", e)
            self.bus_errors += 1
        return n

    def start(self, interval_s: float = 0.005) -> None:
        if self._thread is not None:
            return
        if self._load_bus is not None:
            self._load_cursor = self._load_bus.end()  # only fresh load samples matter

        def run() -> None:
            while not self._stop.is_set():
                if self.pump() == 0:
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
            self.decisions += 1
        return placement

    def assigned(self, request: PlacementRequest, placement: Placement) -> None:
        uncached = max(0, request.prompt_tokens - placement.cached_blocks * self.block_size)
        with self._lock:
            self.load.assigned(request.request_id, placement.instance_id, uncached, time.time())

    def first_token(self, request_id: str) -> None:
        with self._lock:
            self.load.prefill_done(request_id)

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
