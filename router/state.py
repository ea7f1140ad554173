"""The production shell of one router replica: a ``router.core.RouterCore`` behind a lock shared
by the ingress and the Serve request router of one process, on the wall clock, with a pump
thread that applies the buses every few milliseconds (bus reads happen outside the lock), and
the process registry the Serve request routers find it in.

Instances are known from Serve's replica set (``sync_instances``) and from live load samples;
one whose samples stop is dropped. Bus trouble degrades routing quality (stale map, local-only
load) but never fails a request: errors are logged once and counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from cachemap import CacheMap, Match
from engines.bus.liveness import EngineWatcher
from engines.profile import LatencyProfile
from router.admission import Admission
from router.core import RouterCore
from router.load import LoadTracker
from router.placement import InstanceView, Placement, PlacementRequest, Scorer
from router.pools import Pool
from router.settings import DEFAULTS, RouterSettings

log = logging.getLogger(__name__)


class RouterState:
    """A ``RouterCore`` behind a lock, on the wall clock, with a bus pump thread. Takes the
    core's arguments; ``now`` defaults to ``clock()`` where a caller may pass it."""

    def __init__(
        self,
        settings: RouterSettings = DEFAULTS,
        latency: LatencyProfile | None = None,
        *,
        clock: Callable[[], float] = time.time,
        **runtime: Any,
    ) -> None:
        """``settings`` and ``latency`` as ``RouterCore`` takes them; ``runtime``: the core's
        keyword arguments (the buses, recorder, pools, planner, scorer, KV pool link)."""
        self.core = RouterCore(settings, latency, **runtime)
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

    @property
    def watcher(self) -> EngineWatcher | None:
        """The core's reader of the buses (None: the core is driven by hand)."""
        return self.core.watcher

    @property
    def pools(self) -> dict[str, Pool]:
        """The engine pools by name; the default pool first."""
        return self.core.pools

    @property
    def event_gaps(self) -> int:
        """KV event sequence gaps the map's ingestor has seen."""
        return self.core.ingestor.gaps

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

    def start(self, interval_s: float | None = None) -> None:
        """Pump the buses every ``interval_s`` (None: the settings' ``bus_poll_s``) in a thread
        of its own (each pump reads both buses in one round trip, ``EventBus.read_pair``: over
        the Ray bus, one actor call of ~1 ms of CPU, caller and hub, whether or not anything is
        new; at the 50 ms default and the engines' 100 ms publish interval the Ray hub spends
        0.32-0.34 ms per ``ingress_bench`` request, against 0.57-0.70 ms at 20 and 50 ms)."""
        if self._pump_thread is not None or self.core.watcher is None:
            return
        wait_s = self.core.settings.bus_poll_s if interval_s is None else interval_s

        def run() -> None:
            while not self._stop.is_set():
                self.pump()
                watcher = self.core.watcher
                if watcher is None or not watcher.consumer.full:  # behind: read on at once
                    self._stop.wait(wait_s)

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
