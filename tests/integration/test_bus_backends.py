"""One contract suite over every event-bus backend: offsets, cursors, trimming and loss,
concurrent publishers, and a full translator -> bus -> CacheMap round trip."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cachemap import CacheMap, Match, Tier, block_hashes, salt_hash
from cachemap.events import BlockStored, KVEventBatch, encode_message, encode_vllm_batch
from cachemap.ingest import CacheMapIngestor, EngineEventTranslator
from engines.bus.base import BusConsumer, EventBus, InProcessBus

BusFactory = Callable[[int], EventBus]


@pytest.fixture(params=["inprocess", "redis"])
def make_bus(request: pytest.FixtureRequest) -> Iterator[BusFactory]:
    made: list[EventBus] = []
    if request.param == "inprocess":

        def factory(maxlen: int) -> EventBus:
            return InProcessBus(maxlen)
    else:
        from engines.bus.redis_bus import RedisStreamBus

        url = request.getfixturevalue("redis_url")

        def factory(maxlen: int) -> EventBus:
            bus = RedisStreamBus(url, stream=f"test:{uuid.uuid4().hex}", maxlen=maxlen)
            made.append(bus)
            return bus

    yield factory
    for bus in made:
        bus.close()  # type: ignore[attr-defined]


def test_offsets_and_cursor_reads(make_bus: BusFactory) -> None:
    bus = make_bus(1000)
    assert bus.end() == 0
    assert bus.read(0).items == []
    offsets = [bus.publish(f"m{i}".encode()) for i in range(10)]
    assert offsets == list(range(10))
    assert bus.end() == 10
    first = bus.read(0, max_items=4)
    assert first.items == [b"m0", b"m1", b"m2", b"m3"] and first.cursor == 4 and first.lost == 0
    rest = bus.read(first.cursor)
    assert rest.items == [f"m{i}".encode() for i in range(4, 10)] and rest.cursor == 10
    assert bus.read(10) == ([], 10, 0)


def test_publish_many_appends_in_order_and_returns_the_last_offset(make_bus: BusFactory) -> None:
    bus = make_bus(1000)
    assert bus.publish(b"a") == 0
    assert bus.publish_many([b"b", b"c", b"d"]) == 3
    assert bus.publish(b"e") == 4
    assert bus.read(0) == ([b"a", b"b", b"c", b"d", b"e"], 5, 0)


def test_trimmed_entries_are_reported_lost(make_bus: BusFactory) -> None:
    bus = make_bus(5)
    for i in range(500):
        bus.publish(str(i).encode())
    got = bus.read(0, max_items=10_000)
    assert got.lost > 0
    assert got.lost + len(got.items) == 500 and got.cursor == 500
    assert got.items[-1] == b"499"
    # Entries arrive in order and contiguous after the loss.
    assert [int(x) for x in got.items] == list(range(got.lost, 500))


def test_concurrent_publishers_get_distinct_dense_offsets(make_bus: BusFactory) -> None:
    bus = make_bus(100_000)
    results: list[list[int]] = [[] for _ in range(4)]

    def run(k: int) -> None:
        for i in range(200):
            results[k].append(bus.publish(f"{k}:{i}".encode()))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    offsets = sorted(o for r in results for o in r)
    assert offsets == list(range(800))
    items = bus.read(0, max_items=10_000).items
    for k in range(4):  # each publisher's own order is kept
        mine = [int(x.split(b":")[1]) for x in items if x.startswith(f"{k}:".encode())]
        assert mine == list(range(200))


def test_a_reader_polling_while_others_publish_loses_nothing(make_bus: BusFactory) -> None:
    """Reads race publishes (a router polls while engines publish): every entry is read once, in
    order, and none is reported lost (the log is far from full)."""
    bus = make_bus(100_000)
    done = threading.Event()

    def publish() -> None:
        for i in range(1_500):
            bus.publish(str(i).encode())
        done.set()

    writer = threading.Thread(target=publish)
    writer.start()
    seen: list[int] = []
    cursor = lost = 0
    while True:
        finished = done.is_set()
        got = bus.read(cursor, max_items=64)
        seen += [int(x) for x in got.items]
        cursor, lost = got.cursor, lost + got.lost
        if finished and not got.items:
            break
    writer.join()
    assert lost == 0
    assert seen == list(range(1_500))


def test_read_pair_is_both_reads(make_bus: BusFactory) -> None:
    a, b = make_bus(1000), make_bus(1000)
    a.publish_many([b"a0", b"a1", b"a2"])
    b.publish_many([b"b0", b"b1"])
    assert (
        a.read_pair(1, b, 0)
        == (a.read(1), b.read(0))
        == (([b"a1", b"a2"], 3, 0), ([b"b0", b"b1"], 2, 0))
    )
    assert a.read_pair(3, b, 2, max_items=1) == (([], 3, 0), ([], 2, 0))


def count_round_trips(client: Any) -> list[int]:
    """``[n]``: the pipelines (one round trip each) ``client`` sends from now on."""
    trips = [0]
    pipeline = client.pipeline

    def counted(*args: object, **kwargs: object) -> object:
        trips[0] += 1
        return pipeline(*args, **kwargs)

    client.pipeline = counted
    return trips


def test_publish_pair_is_both_publishes(make_bus: BusFactory) -> None:
    a, b = make_bus(1000), make_bus(1000)
    a.publish(b"a0")
    assert a.publish_pair([b"a1", b"a2"], b, [b"b0"]) == (2, 0)
    assert a.publish_pair([], b, [b"b1"]) == (-1, 1)
    assert a.publish_pair([b"a3"], b, []) == (3, -1)
    assert a.read(0).items == [b"a0", b"a1", b"a2", b"a3"]
    assert b.read(0).items == [b"b0", b"b1"]


def test_two_redis_streams_on_one_client_are_published_in_one_round_trip(redis_url: str) -> None:
    """Even with the server's script cache flushed in between: the script is loaded once more
    and each stream gets its messages once, in order."""
    import redis

    from engines.bus.redis_bus import RedisStreamBus

    client = redis.Redis.from_url(redis_url)
    stream = f"test:{uuid.uuid4().hex}"
    events = RedisStreamBus(redis_url, stream=stream, client=client)
    loads = RedisStreamBus(redis_url, stream=stream + ":loads", client=client)
    trips = count_round_trips(client)
    assert events.publish_pair([b"e0", b"e1"], loads, [b"l0"]) == (1, 0)
    assert trips == [1]
    client.script_flush()
    assert events.publish_pair([b"e2"], loads, [b"l1", b"l2"]) == (2, 2)
    assert trips == [3]  # the flushed script: loaded, then the pair published again
    assert events.read(0) == ([b"e0", b"e1", b"e2"], 3, 0)
    assert loads.read(0) == ([b"l0", b"l1", b"l2"], 3, 0)
    client.close()


def test_two_redis_streams_on_one_client_are_read_in_one_round_trip(redis_url: str) -> None:
    import redis

    from engines.bus.redis_bus import RedisStreamBus

    client = redis.Redis.from_url(redis_url)
    stream = f"test:{uuid.uuid4().hex}"
    events = RedisStreamBus(redis_url, stream=stream, client=client)
    loads = RedisStreamBus(redis_url, stream=stream + ":loads", maxlen=10, client=client)
    events.publish_many([b"e0", b"e1"])
    for i in range(40):
        loads.publish(b"l%d" % i)
    trips = count_round_trips(client)
    got_events, got_loads = events.read_pair(0, loads, 0)
    assert trips == [1]
    assert got_events == ([b"e0", b"e1"], 2, 0)
    assert got_loads.cursor == 40 and got_loads.items[-1] == b"l39"
    assert got_loads.lost + len(got_loads.items) == 40  # maxlen 10: the head was trimmed
    client.close()


def test_a_redis_publish_is_one_round_trip_and_survives_a_flushed_script_cache(
    redis_url: str,
) -> None:
    """The publish script is called by its SHA: no ``SCRIPT EXISTS`` before every publish, and a
    server that lost its scripts (a restart, ``SCRIPT FLUSH``) gets it loaded again, with the
    messages published once each, in order."""
    import redis

    from engines.bus.redis_bus import RedisStreamBus

    admin = redis.Redis.from_url(redis_url)
    bus = RedisStreamBus(redis_url, stream=f"test:{uuid.uuid4().hex}")
    admin.script_flush()
    admin.config_resetstat()
    assert bus.publish_many([b"a", b"b"]) == 1
    admin.script_flush()
    assert bus.publish(b"c") == 2
    assert bus.publish_many([b"d", b"e", b"f"]) == 5
    assert bus.read(0) == ([b"a", b"b", b"c", b"d", b"e", b"f"], 6, 0)
    calls = admin.info("commandstats")
    assert "cmdstat_script|exists" not in calls
    assert calls["cmdstat_script|load"]["calls"] == 2  # once per flushed cache
    bus.close()
    admin.close()


def test_translator_to_cachemap_round_trip(make_bus: BusFactory) -> None:
    bus = make_bus(1000)
    tokens = list(range(64))
    tr = EngineEventTranslator("e0", "m", 16)
    ev = BlockStored(
        block_hashes=[1, 2, 3, 4],
        parent_block_hash=None,
        token_ids=tokens,
        block_size=16,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    msg = tr.feed(encode_vllm_batch(KVEventBatch(ts=0.0, events=[ev])), 0, 0.0)
    assert msg is not None
    bus.publish(encode_message(msg))
    cmap = CacheMap()
    BusConsumer(bus, CacheMapIngestor(cmap)).pump()
    assert cmap.match(block_hashes(tokens, 16, salt_hash("m"))) == {"e0": Match(0, 4)}
    assert cmap.count("e0", Tier.CPU) == 4


def test_a_redis_log_that_starts_again_is_read_from_its_head_and_reported_lost(
    redis_url: str,
) -> None:
    """A Redis restarted without its data starts the log at offset 0 again: a reader past the
    new log's end must not wait, blind, for it to catch up (it would skip its first entries)."""
    import redis

    from engines.bus.redis_bus import RedisStreamBus

    stream = f"test:{uuid.uuid4().hex}"
    writer, reader = RedisStreamBus(redis_url, stream), RedisStreamBus(redis_url, stream)
    for i in range(5):
        writer.publish(f"old{i}".encode())
    first = reader.read(0)
    assert first.cursor == 5 and first.lost == 0
    admin = redis.Redis.from_url(redis_url)
    admin.delete(stream, f"{stream}:next", f"{stream}:epoch")  # what a restart without data does
    for i in range(2):
        writer.publish(f"new{i}".encode())
    again = reader.read(first.cursor)
    assert again.items == [b"new0", b"new1"] and again.cursor == 2 and again.lost > 0
    assert reader.read(again.cursor) == ([], 2, 0)
    admin.close()
