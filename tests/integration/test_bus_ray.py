"""The Ray-actor event bus: the EventBus contract across processes, ordering, trimming, resync."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import pytest

pytest.importorskip("ray")

import ray

from cachemap.events import InstanceEvents, Stored, encode_message
from cachemap.hashing import BlockHasher
from cachemap.ingest import CacheMapIngestor
from cachemap.map import CacheMap
from engines.bus.base import BusConsumer
from engines.bus.ray_bus import RayEventBus

pytestmark = [pytest.mark.integration, pytest.mark.ray]


@pytest.fixture
def bus(request) -> Iterator[RayEventBus]:
    b = RayEventBus(f"test-{request.node.name}", maxlen=5)
    yield b
    b.kill()


def test_publish_read_end_and_trim(bus: RayEventBus) -> None:
    assert bus.end() == 0
    assert bus.read(0) == ([], 0, 0)
    assert bus.publish_sync(b"a") == 0
    for p in (b"b", b"c"):
        assert bus.publish(p) == -1  # fire-and-forget
    bus.flush()
    assert bus.end() == 3
    assert bus.read(1) == ([b"b", b"c"], 3, 0)
    assert bus.read(0, max_items=2) == ([b"a", b"b"], 2, 0)
    for i in range(4):
        bus.publish(b"x%d" % i)
    bus.flush()
    got = bus.read(0)  # maxlen 5: offsets 0 and 1 are gone
    assert got.lost == 2 and got.cursor == 7 and got.items[0] == b"c"
    assert bus.publish_many([b"y0", b"y1"]) == -1  # one fire-and-forget call for both
    bus.flush()
    assert bus.read(7) == ([b"y0", b"y1"], 9, 0)


def test_remote_publisher_keeps_order_and_the_client_pickles(bus: RayEventBus) -> None:
    @ray.remote(num_cpus=0)
    def publish(b: RayEventBus, n: int) -> None:
        for i in range(n):
            b.publish(str(i).encode())
        b.flush()

    clone = pickle.loads(pickle.dumps(bus))
    assert clone.name == bus.name
    ray.get(publish.remote(bus, 5))
    assert bus.read(0).items == [b"0", b"1", b"2", b"3", b"4"]


def test_messages_from_another_process_reach_a_cache_map() -> None:
    bus = RayEventBus("test-map", maxlen=1000)
    try:
        hashes = BlockHasher("m", 4)(list(range(12)))

        @ray.remote(num_cpus=0)
        def engine_side(b: RayEventBus) -> None:
            b.publish(
                encode_message(InstanceEvents("i1", 0, 0.0, [Stored("GPU", hashes, None, 0)]))
            )
            b.flush()

        ray.get(engine_side.remote(bus))
        ingestor = CacheMapIngestor(CacheMap())
        assert BusConsumer(bus, ingestor).pump() == 1
        assert ingestor.map.match(hashes)["i1"].gpu_blocks == 3
    finally:
        bus.kill()


def test_a_sync_client_returns_offsets() -> None:
    bus = RayEventBus("test-sync", maxlen=10, sync=True)
    try:
        assert [bus.publish(b"%d" % i) for i in range(3)] == [0, 1, 2]
        assert pickle.loads(pickle.dumps(bus)).publish(b"x") == 3
        assert bus.publish_many([b"y", b"z"]) == 5
    finally:
        bus.kill()


def test_resync_requests_are_taken_once(bus: RayEventBus) -> None:
    assert not bus.take_resync("i1")
    bus.request_resync("i1")
    assert bus.take_resync("i1")
    assert not bus.take_resync("i1")


def test_two_logs_on_one_hub_keep_their_own_offsets_bounds_and_resyncs() -> None:
    events = RayEventBus("test-events", hub="test-hub", maxlen=100, sync=True)
    loads = RayEventBus("test-loads", hub="test-hub", maxlen=3, sync=True)
    other = RayEventBus("test-elsewhere", maxlen=10, sync=True)  # a hub of its own
    try:
        assert [events.publish(b"e%d" % i) for i in range(4)] == [0, 1, 2, 3]
        assert [loads.publish(b"l%d" % i) for i in range(5)] == [0, 1, 2, 3, 4]
        assert other.publish(b"o") == 0
        assert events.read_pair(1, loads, 0) == (events.read(1), loads.read(0))
        assert loads.read(0) == ([b"l2", b"l3", b"l4"], 5, 2)  # maxlen 3
        assert events.read_pair(4, other, 0) == (([], 4, 0), ([b"o"], 1, 0))  # two calls
        assert events.publish_pair([b"e4"], loads, [b"l5", b"l6"]) == (4, 6)  # one call
        assert events.publish_pair([], other, [b"o1"]) == (-1, 1)  # another hub: its own call
        assert events.read(4) == ([b"e4"], 5, 0) and loads.read(5) == ([b"l5", b"l6"], 7, 0)
        clone = pickle.loads(pickle.dumps(loads))
        assert (clone.name, clone.hub) == ("test-loads", "test-hub")
        assert clone.publish(b"l7") == 7 and events.end() == 5
        events.request_resync("i1")
        assert not loads.take_resync("i1") and events.take_resync("i1")
    finally:
        events.kill()
        loads.kill()  # the same hub: already gone
        other.kill()
    with pytest.raises(ValueError, match="no hub actor 'test-hub'"):
        RayEventBus("test-events", hub="test-hub", create=False)


def test_two_fire_and_forget_logs_of_one_hub_publish_in_one_call() -> None:
    events = RayEventBus("test-pair-events", hub="test-pair-hub")
    loads = RayEventBus("test-pair-loads", hub="test-pair-hub")
    try:
        assert events.publish_pair([b"e0", b"e1"], loads, [b"l0"]) == (-1, -1)
        assert events._last is not None and events._last is loads._last  # one actor call
        loads.flush()  # waits for that call: both logs have their messages
        assert events.read(0) == ([b"e0", b"e1"], 2, 0) and loads.read(0) == ([b"l0"], 1, 0)
    finally:
        events.kill()


def test_a_log_nobody_opened_is_named_in_the_error(bus: RayEventBus) -> None:
    stray = RayEventBus("never-opened", hub=bus.hub, create=False)
    with pytest.raises(KeyError, match="no log 'never-opened'"):
        stray.read(0)


def test_the_hub_bounds_a_log_by_bytes_and_reports_what_it_holds() -> None:
    """Through the real actor: a log past ``max_bytes`` drops its oldest entries (a reader
    behind learns how many), and a resync request for an instance that never takes it is one
    pending entry (forgotten after ``RESYNC_TTL_S``: tests/unit/test_bus_hub.py)."""
    events = RayEventBus("test-bytes-events", hub="test-bytes-hub", maxlen=1000, max_bytes=100)
    loads = RayEventBus("test-bytes-loads", hub="test-bytes-hub", maxlen=3, sync=True)
    try:
        events.publish_many([b"%030d" % i for i in range(10)])  # 30 bytes each
        events.flush()
        assert events.read(0) == ([b"%030d" % i for i in (7, 8, 9)], 10, 7)
        assert pickle.loads(pickle.dumps(events)).max_bytes == 100
        for i in range(5):
            loads.publish(b"l%d" % i)
        events.request_resync("gone")
        stats = events.stats()  # the same hub: every log on it
        assert stats["logs"] == {
            "test-bytes-events": {"entries": 3, "bytes": 90, "resync": 1},
            "test-bytes-loads": {"entries": 3, "bytes": 6, "resync": 0},
        }
    finally:
        events.kill()
    with pytest.raises(ValueError, match="max_bytes"):
        RayEventBus("test-bytes-bad", max_bytes=0)
