"""``EngineWatcher``: load samples keep instances alive, silence drops them, gaps ask a resync."""

from __future__ import annotations

import pytest

from cachemap.events import InstanceEvents, Stored, encode_message
from cachemap.hashing import BlockHasher
from cachemap.ingest import CacheMapIngestor
from cachemap.map import CacheMap
from engines.base import LoadSnapshot
from engines.bus.base import InProcessBus
from engines.bus.forwarder import encode_load
from engines.bus.liveness import FUTURE_S, EngineWatcher

pytestmark = pytest.mark.integration

HASHES = BlockHasher("m", 4)(list(range(8)))


def _load(inst: str, running: int = 0) -> bytes:
    return encode_load(LoadSnapshot(inst, 0.0, 0, running, 0.1, 0.0, 0))


def _stored(inst: str, seq: int) -> bytes:
    return encode_message(InstanceEvents(inst, seq, 0.0, [Stored("GPU", HASHES, None, 0)]))


def test_silent_instances_are_dropped_and_live_ones_kept() -> None:
    events, loads = InProcessBus(), InProcessBus()
    w = EngineWatcher(events, loads, CacheMapIngestor(CacheMap()), timeout_s=2.0)
    for inst in ("a", "b"):
        events.publish(_stored(inst, 0))
        loads.publish(_load(inst))
    assert w.pump(0.0) == []
    assert w.live() == ["a", "b"] and set(w.ingestor.map.match(HASHES)) == {"a", "b"}
    loads.publish(_load("a", running=3))
    assert w.pump(1.5) == []
    assert w.loads["a"].running == 3
    assert w.pump(2.5) == ["b"]  # b's last sample was read at 0.0
    assert w.live() == ["a"] and set(w.ingestor.map.match(HASHES)) == {"a"}
    assert "b" not in w.loads and w.dropped == 1
    # b comes back (it was only slow): its next batch has a gap, so a resync is due.
    loads.publish(_load("b"))
    events.publish(_stored("b", 1))
    assert w.pump(3.0) == []
    assert "b" in w.live() and "b" in w.ingestor.needs_resync


def test_an_idle_instance_that_returns_is_resynced() -> None:
    """Dropped as silent (its residency forgotten), then back without a new batch: an idle
    engine would never show a gap, so its return alone asks for a snapshot."""
    asked: list[str] = []
    events, loads = InProcessBus(), InProcessBus()
    w = EngineWatcher(
        events, loads, CacheMapIngestor(CacheMap()), timeout_s=2.0, request_resync=asked.append
    )
    events.publish(_stored("a", 0))
    loads.publish(_load("a"))
    w.pump(0.0)
    assert w.pump(2.5) == ["a"] and not w.ingestor.map.match(HASHES)
    loads.publish(_load("a"))
    w.pump(3.0)
    assert "a" in w.ingestor.needs_resync and asked == ["a"]


def test_time_the_buses_could_not_be_read_is_not_silence() -> None:
    events, loads = InProcessBus(), InProcessBus()
    w = EngineWatcher(events, loads, CacheMapIngestor(CacheMap()), timeout_s=2.0)
    loads.publish(_load("a"))
    assert w.pump(0.0) == []
    w.unreadable(0.5)  # the bus went away at 0.5 ...
    w.unreadable(1.0)  # (still away: the first failure counts)
    assert w.pump(5.0) == []  # ... and came back at 5.0: 0.5 s of silence, not 5
    assert w.pump(6.6) == ["a"]  # truly silent since: dropped 2 s later


def test_gaps_ask_for_a_resync_at_most_once_per_interval() -> None:
    events, loads = InProcessBus(), InProcessBus()
    asked: list[str] = []
    w = EngineWatcher(
        events,
        loads,
        CacheMapIngestor(CacheMap()),
        resync_interval_s=1.0,
        request_resync=asked.append,
    )
    events.publish(_stored("a", 5))  # expected seq 0: a gap
    w.pump(0.0)
    w.pump(0.5)
    assert asked == ["a"]
    w.pump(1.2)
    assert asked == ["a", "a"]


def test_malformed_load_samples_are_counted_and_skipped() -> None:
    events, loads = InProcessBus(), InProcessBus()
    w = EngineWatcher(events, loads, CacheMapIngestor(CacheMap()))
    loads.publish(b"\xc1junk")
    loads.publish(_load("a"))
    w.pump(0.0)
    assert w.malformed_loads == 1 and w.live() == ["a"]


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        EngineWatcher(InProcessBus(), InProcessBus(), CacheMapIngestor(CacheMap()), timeout_s=0)


def test_load_samples_from_the_future_or_out_of_order_are_dropped() -> None:
    """A sample stamped past the router's clock (over ``FUTURE_S``) or older than the
    instance's latest never replaces it: dropped and counted by reason."""
    events, loads = InProcessBus(), InProcessBus()
    w = EngineWatcher(events, loads, CacheMapIngestor(CacheMap()))

    def sample(ts: float, running: int) -> bytes:
        return encode_load(LoadSnapshot("a", ts, 0, running, 0.1, 0.0, 0))

    loads.publish(sample(100.0, 1))
    w.pump(100.5)
    loads.publish(sample(100.0 + FUTURE_S + 60, 9))  # from the future
    loads.publish(sample(99.0, 7))  # older than the one held
    w.pump(101.0)
    assert w.loads["a"].running == 1
    assert w.dropped_loads == {"malformed": 0, "future": 1, "out_of_order": 1}
    loads.publish(sample(100.9, 2))  # newer, within the clock: taken
    w.pump(101.0)
    assert w.loads["a"].running == 2
