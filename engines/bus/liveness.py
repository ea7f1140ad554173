"""The consumer side of the engine buses: cache-map events, live load, and engine liveness.

``EngineWatcher`` runs in every router replica. ``pump(now)`` applies new event-bus messages to
its ``CacheMapIngestor``, keeps the latest ``LoadSnapshot`` per instance from the load bus, asks
for a resync of every instance the ingestor flagged (through ``request_resync``, e.g.
``RayEventBus.request_resync``), and drops an instance whose load samples stopped for
``timeout_s``: a crashed replica publishes no ``InstanceGone``, so silence is the signal.
``from_start`` applies to the event bus; the load bus is always read from its tail.

The drop is local (each replica decides from the same samples); if the instance was only slow,
its next event batch arrives with a sequence gap, which flags a resync and restores it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from cachemap.events import InstanceGone
from cachemap.ingest import CacheMapIngestor
from engines.base import LoadSnapshot
from engines.bus.base import BusConsumer, BusRead, EventBus
from engines.bus.forwarder import decode_load

log = logging.getLogger(__name__)

# An instance whose load samples stop for this long is taken for dead (engines publish one every
# ``LOAD_INTERVAL_S``); the router also stops trusting its last sample after it.
STALE_AFTER_S = 2.0
# KV events applied later than this after the engine stamped them mean this router replica is
# behind the cluster (it says so: ``EngineWatcher.behind``, a warning, ``/metrics``); at
# production cadence they arrive within the forwarder's publish interval plus a bus poll
LAG_WARN_S = 1.0
# A load sample stamped more than this after the router's clock is from the future (a skewed
# host clock, a forged frame): dropped, as one older than the instance's latest sample is
FUTURE_S = 5.0


class EngineWatcher:
    """Pumps an event bus and a load bus; ``now`` is the caller's clock in seconds, the one
    engines stamp their load samples with (the wall clock; the simulator's virtual clock): a
    sample stamped over ``FUTURE_S`` past it is dropped."""

    def __init__(
        self,
        events: EventBus,
        loads: EventBus,
        ingestor: CacheMapIngestor,
        *,
        timeout_s: float = STALE_AFTER_S,
        resync_interval_s: float = 1.0,
        request_resync: Callable[[str], None] | None = None,
        from_start: bool = True,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.consumer = BusConsumer(events, ingestor, from_start=from_start)
        self.ingestor = ingestor
        self.loads_bus = loads
        # NOTE: load samples only matter live: history would make long-gone instances look alive.
        # A bus that cannot be reached yet (Redis down, wrong password) must not stop a router
        # from starting: then the cursor starts at the end the first successful fetch sees.
        self.load_cursor: int | None
        try:
            self.load_cursor = loads.end()
        except Exception as e:
            log.warning("load bus unreadable at start; routing without it for now: %s", e)
            self.load_cursor = None
        self.timeout_s, self.resync_interval_s = timeout_s, resync_interval_s
        self.request_resync = request_resync
        self.loads: dict[str, LoadSnapshot] = {}  # latest sample per live instance
        self.last_seen: dict[str, float] = {}  # our clock at its latest sample
        self._resync_asked: dict[str, float] = {}
        # instances sampled since the last ``take_sampled`` (what a load table must update)
        self._sampled: dict[str, None] = {}
        # at most the oldest ``last_seen``: while it is recent, no instance can be silent
        self._oldest_seen = float("inf")
        self.dropped = 0
        # load samples dropped, by why: not a sample, stamped in the future, or older than the
        # instance's latest (each never moves a placement)
        self.dropped_loads = {"malformed": 0, "future": 0, "out_of_order": 0}
        self._load_warned = -float("inf")
        self._blind_since: float | None = None  # when reading the buses started failing
        # how far behind the engines the cache map is: the age (our clock minus the engine's
        # stamp) of the oldest event batch the latest read applied, and whether that read was
        # full, so more was waiting (the map is older than that)
        self.event_lag_s = 0.0
        self.behind = False
        self._lag_warned = -float("inf")
        # events older than this when applied mean we are behind (a caller whose clock only
        # moves when it places, as the cluster simulator's, applies old events by design and
        # sets it to infinity)
        self.lag_warn_s = LAG_WARN_S
        self._forgotten: set[str] = set()  # dropped as silent; a resync is due if they return

    def pump(self, now: float) -> list[str]:
        """Apply what is new; returns the instances dropped as silent by this call."""
        return self.apply(self.fetch(), now)

    def fetch(self) -> tuple[BusRead, BusRead]:
        """Read both buses, in one round trip where they allow it (the I/O half of ``pump``:
        no shared state is touched)."""
        if self.load_cursor is None:
            self.load_cursor = self.loads_bus.end()
        return self.consumer.bus.read_pair(self.consumer.cursor, self.loads_bus, self.load_cursor)

    def unreadable(self, now: float) -> None:
        """A ``fetch`` failed (the bus is down or refuses us): time until the next successful
        read is ours, not the engines' silence, and does not count towards dropping them."""
        if self._blind_since is None:
            self._blind_since = now

    def apply(self, fetched: tuple[BusRead, BusRead], now: float) -> list[str]:
        """Apply what ``fetch`` read; returns the instances dropped as silent."""
        if self._blind_since is not None:
            blind = max(0.0, now - self._blind_since)
            self._blind_since = None
            for inst in self.last_seen:
                self.last_seen[inst] += blind
        events, got = fetched
        consumer = self.consumer
        consumer.apply(events)
        if consumer.oldest_ts is not None:
            self.event_lag_s = max(0.0, now - consumer.oldest_ts)
        elif not events.items:
            self.event_lag_s = 0.0  # caught up: nothing was waiting
        late = self.event_lag_s > self.lag_warn_s
        self.behind = consumer.full or late
        if late and now - self._lag_warned >= 60.0:
            self._lag_warned = now
            log.warning(
                "KV events are %.2f s old when applied%s: the cache map routes on stale state",
                self.event_lag_s,
                " and more are waiting" if consumer.full else "",
            )
        self.load_cursor = got.cursor
        for payload in got.items:
            try:
                sample = decode_load(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self._drop_load("malformed", None, now)
                continue
            inst = sample.instance_id
            held = self.loads.get(inst)
            if sample.ts > now + FUTURE_S:
                self._drop_load("future", sample, now)
                continue
            if held is not None and sample.ts < held.ts:
                self._drop_load("out_of_order", sample, now)
                continue
            if inst in self._forgotten:
                # NOTE: dropped as silent, now back: its residency was forgotten, and an idle
                # engine sends no batch whose gap would ask for it again
                self._forgotten.discard(inst)
                self.ingestor.needs_resync.add(inst)
            self.loads[inst] = sample
            self.last_seen[inst] = now
            self._sampled[inst] = None
            self._oldest_seen = min(self._oldest_seen, now)
        # NOTE: ``now - t`` only shrinks as t grows, so when the oldest is within the timeout
        # every instance is: the scan over all of them is only made when one may be silent.
        scan = now - self._oldest_seen > self.timeout_s
        dropped = [i for i, t in self.last_seen.items() if now - t > self.timeout_s] if scan else []
        for inst in dropped:
            log.warning("instance %s: no load sample for %.1f s, dropping it", inst, self.timeout_s)
            self.forget(inst)
            self._forgotten.add(inst)
            self.dropped += 1
        if scan:
            self._oldest_seen = min(self.last_seen.values(), default=float("inf"))
        if self.request_resync is not None:
            for inst in self.ingestor.needs_resync:
                if now - self._resync_asked.get(inst, -1e18) >= self.resync_interval_s:
                    self._resync_asked[inst] = now
                    self.request_resync(inst)
        return dropped

    @property
    def malformed_loads(self) -> int:
        return self.dropped_loads["malformed"]

    def _drop_load(self, why: str, sample: LoadSnapshot | None, now: float) -> None:
        """Count a load sample dropped for ``why``; a warning at most once a minute."""
        self.dropped_loads[why] += 1
        if now - self._load_warned >= 60.0:
            self._load_warned = now
            log.warning(
                "load sample dropped (%s)%s: %s so far",
                why.replace("_", " "),
                f" from {sample.instance_id!r} stamped {sample.ts:.3f} at {now:.3f}"
                if sample is not None
                else "",
                self.dropped_loads,
            )

    def take_sampled(self) -> list[str]:
        """The instances with a sample applied since the last call (in the order first
        sampled); each one's latest sample is in ``loads`` unless it was forgotten since."""
        out = list(self._sampled)
        self._sampled.clear()
        return out

    def forget(self, instance: str) -> None:
        """Drop ``instance`` from the cache map and the load table."""
        self.ingestor.apply(InstanceGone(instance))
        self.loads.pop(instance, None)
        self.last_seen.pop(instance, None)
        self._resync_asked.pop(instance, None)

    def live(self) -> list[str]:
        return sorted(self.last_seen)
