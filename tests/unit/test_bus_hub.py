"""The Ray bus hub's state without Ray: its logs stay bounded by entries and by bytes, a reader
behind the trim learns what it lost, and resync requests nobody takes are forgotten, so what the
hub holds stays bounded however many engine instances come and go."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from cachemap.events import InstanceEvents, Snapshot, SnapshotBlock, Stored, encode_message
from engines.bus.base import InProcessBus
from engines.bus.ray_bus import RESYNC_TTL_S, BusHub


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_log_is_bounded_by_bytes_and_a_reader_behind_the_trim_learns_how_many_it_lost() -> None:
    log = InProcessBus(maxlen=1000, max_bytes=100)
    for i in range(10):
        assert log.publish_many([b"%030d" % i]) == i  # 30 bytes each: three fit in 100
    assert (len(log), log.bytes) == (3, 90)
    got = log.read(0)
    assert got == ([b"%030d" % i for i in (7, 8, 9)], 10, 7)
    assert log.read(10) == ([], 10, 0) and log.end() == 10
    assert log.publish_many([b"x" * 500]) == 10  # larger than the bound: the newest stays alone
    assert log.read(10) == ([b"x" * 500], 11, 0) and len(log) == 1
    log = InProcessBus(maxlen=2, max_bytes=100)  # and by entries
    log.publish_many([b"a", b"b", b"c"])
    log.publish(b"d")
    assert log.read(0) == ([b"c", b"d"], 4, 2) and log.bytes == 2
    with pytest.raises(ValueError, match="max_bytes"):
        InProcessBus(10, max_bytes=0)


def test_a_resync_request_is_taken_once_within_the_ttl_and_forgotten_after_it() -> None:
    clock = Clock()
    hub = BusHub(clock=clock)
    hub.open("ev", 10)
    hub.request_resync("ev", "live")
    clock.now += RESYNC_TTL_S / 2
    assert hub.take_resync("ev", "live") and not hub.take_resync("ev", "live")
    hub.request_resync("ev", "late")
    clock.now += RESYNC_TTL_S
    assert not hub.take_resync("ev", "late")  # too old: its router asks again if it still needs
    hub.request_resync("ev", "late")
    assert hub.take_resync("ev", "late")


def test_engines_replaced_many_times_leave_the_hub_bounded() -> None:
    """Soak-like churn through the hub class: 2000 engine instances one after another, each
    publishing KV-event batches, load samples and a snapshot, and each asked for a resync just
    before it dies (a request never taken). The hub ends holding at most its logs' bounds and
    the resync requests of the last TTL, not one per dead instance."""
    clock = Clock()
    hub = BusHub(clock=clock)
    hub.open("ev", 500, max_bytes=64 * 1024)
    hub.open("load", 100)
    blocks = [SnapshotBlock(h, h - 1 if h else None, h, ["GPU"]) for h in range(200)]
    for n in range(2000):
        inst = f"engine-{n}"
        for seq in range(20):
            batch = InstanceEvents(inst, seq, 0.0, [Stored("GPU", [seq * 7, seq * 7 + 1], None, 0)])
            hub.publish_many_to(
                [("ev", [encode_message(batch)]), ("load", [b"load-sample-of-" + inst.encode()])]
            )
        if hub.take_resync("ev", inst):  # asked at its start (a gap), answered with a snapshot
            hub.publish_many("ev", [encode_message(Snapshot(inst, 19, blocks))])
        hub.request_resync("ev", f"engine-{n + 1}")
        hub.request_resync("ev", inst)  # asked as it dies: nobody takes it
        clock.now += 5.0  # an engine's life, sped up
    logs = hub.stats()["logs"]
    assert logs["ev"]["entries"] <= 500 and logs["ev"]["bytes"] <= 64 * 1024
    assert logs["load"]["entries"] == 100
    # requests of the last 2 TTLs at most (one scan per TTL), of 2000 dead instances
    assert logs["ev"]["resync"] <= 2 * RESYNC_TTL_S / 5.0 + 2
    assert logs["load"]["resync"] == 0
