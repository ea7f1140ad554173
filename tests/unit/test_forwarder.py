"""The KV-event forwarder gathers a busy engine's batches into one bus call per interval.

A real ZMQ publisher sends vLLM-format batches to a real ``KvEventForwarder``; the bus is an
``InProcessBus`` that counts the calls made to it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import pytest
import zmq

from cachemap.events import (
    BlockStored,
    InstanceEvents,
    InstanceGone,
    KVEventBatch,
    LastSeq,
    Snapshot,
    decode_message,
    encode_vllm_batch,
)
from cachemap.ingest import EngineEventTranslator
from engines.base import LoadSnapshot
from engines.bus.base import EventBus, InProcessBus
from engines.bus.forwarder import KvEventForwarder, decode_load, encode_load
from tests.support import free_port, wait_for

BLOCK = 16


class CountingBus(InProcessBus):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def publish(self, payload: bytes) -> int:
        self.calls += 1
        return super().publish(payload)

    def publish_many(self, payloads: Sequence[bytes]) -> int:
        self.calls += 1
        return super().publish_many(payloads)


class Engine:
    """A ZMQ publisher of vLLM-format batches, one stored block each."""

    def __init__(self) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self.seq = 0

    def send(self) -> None:
        block = BlockStored(
            block_hashes=[self.seq + 1],
            parent_block_hash=None,
            token_ids=[self.seq] * BLOCK,
            block_size=BLOCK,
            lora_id=None,
            medium=None,
            lora_name=None,
        )
        payload = encode_vllm_batch(KVEventBatch(ts=time.time(), events=[block]))
        self.sock.send_multipart((b"", self.seq.to_bytes(8, "big"), payload))
        self.seq += 1


def messages(bus: InProcessBus) -> list[object]:
    return [decode_message(p) for p in bus.read(0).items]


@pytest.fixture
def rig(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, CountingBus, KvEventForwarder]]:
    interval: float = request.param
    engine, bus = Engine(), CountingBus()
    fwd = KvEventForwarder(
        EngineEventTranslator("e0", "m", BLOCK), bus, engine.endpoint, publish_interval_s=0
    )
    fwd.start()
    # ZMQ's slow joiner: send until the subscription is through (those batches are published)
    assert wait_for(lambda: engine.send() or bus.end() > 0)
    assert wait_for(lambda: fwd.next_engine_seq == engine.seq)  # every probe sent is in
    fwd.publish_interval_s = interval
    try:
        yield engine, bus, fwd
    finally:
        fwd.stop(gone=False)
        engine.sock.close(0)


@pytest.mark.parametrize("rig", [30.0], indirect=True)
def test_a_burst_goes_to_the_bus_in_few_calls_each_batch_its_own_message(rig) -> None:
    engine, bus, fwd = rig
    before_msgs, before_calls, received = bus.end(), bus.calls, fwd.batches
    engine.send()  # after a quiet spell: published at once, not at the interval's end
    assert wait_for(lambda: bus.end() == before_msgs + 1)
    for _ in range(19):  # within the interval: gathered until its end
        engine.send()
    assert wait_for(lambda: fwd.batches == received + 20)  # all in the forwarder's hands
    assert (bus.end(), bus.calls) == (before_msgs + 1, before_calls + 1)  # none published yet
    fwd._next_flush = 0.0  # the interval ends now (not 30 s from the first batch)
    assert wait_for(lambda: bus.end() == before_msgs + 20)
    assert bus.calls == before_calls + 2  # the 19 went in one call
    events = [m for m in messages(bus) if isinstance(m, InstanceEvents)]
    seqs = [m.seq for m in events]
    assert seqs == list(range(len(events)))  # in order, no gap: one sequence number per batch
    assert fwd.published == bus.end() and fwd.publish_calls == bus.calls


@pytest.mark.parametrize("rig", [0.0], indirect=True)
def test_interval_zero_publishes_every_batch_on_its_own(rig) -> None:
    engine, bus, _ = rig
    before_msgs, before_calls = bus.end(), bus.calls
    for _ in range(10):
        engine.send()
    assert wait_for(lambda: bus.end() == before_msgs + 10)
    assert bus.calls - before_calls == 10


@pytest.mark.parametrize("rig", [30.0], indirect=True)
def test_a_snapshot_and_a_clean_stop_publish_the_gathered_batches_first(rig) -> None:
    engine, bus, fwd = rig
    start, received = bus.end(), fwd.batches
    engine.send()
    assert wait_for(lambda: bus.end() == start + 1)
    engine.send()
    engine.send()  # both wait for the interval's end, 30 s away
    assert wait_for(lambda: fwd.batches == received + 3)
    assert bus.end() == start + 1
    fwd.publish_snapshot()
    tail = messages(bus)[start:]
    assert [type(m) for m in tail] == [InstanceEvents, InstanceEvents, InstanceEvents, Snapshot]
    assert tail[-1].seq == tail[-2].seq  # type: ignore[attr-defined]
    engine.send()
    assert wait_for(lambda: fwd.batches == received + 4)
    fwd.stop(gone=True)
    tail = messages(bus)[start:]
    assert [type(m) for m in tail[-2:]] == [InstanceEvents, InstanceGone]


class PairBus(InProcessBus):
    """Logs each call under its name in a list shared with its partner; ``publish_pair`` with
    the partner is one call ("pair"), as for two logs of one Ray hub or two streams of one
    Redis client."""

    def __init__(self, name: str, calls: list[str]) -> None:
        super().__init__()
        self.name, self.calls = name, calls

    def publish(self, payload: bytes) -> int:
        self.calls.append(self.name)
        return super().publish(payload)

    def publish_many(self, payloads: Sequence[bytes]) -> int:
        self.calls.append(self.name)
        return super().publish_many(payloads)

    def publish_pair(
        self, payloads: Sequence[bytes], other: EventBus, other_payloads: Sequence[bytes]
    ) -> tuple[int, int]:
        assert isinstance(other, PairBus)
        self.calls.append("pair")
        return InProcessBus.publish_many(self, payloads), InProcessBus.publish_many(
            other, other_payloads
        )


def test_a_busy_engines_load_samples_ride_in_its_event_calls_and_a_quiet_ones_go_alone() -> None:
    """Busy, samples ride the event calls; quiet, the first one carries the ``LastSeq`` mark of
    the last batch (one call for both) and the rest go alone."""
    calls: list[str] = []
    events, loads = PairBus("events", calls), PairBus("loads", calls)
    engine = Engine()
    fwd = KvEventForwarder(
        EngineEventTranslator("e0", "m", BLOCK),
        events,
        engine.endpoint,
        load_bus=loads,
        load_fn=lambda: LoadSnapshot("e0", time.time(), 0, 1, 0.1, 0.0, 0),
        load_interval_s=0.2,
        publish_interval_s=0.05,
    )
    fwd.start()
    try:
        assert wait_for(lambda: engine.send() or events.end() > 0)  # ZMQ's slow joiner
        first, samples = len(calls), loads.end()
        # busy: a batch every ~10 ms (the engine's pace: every flush has events) until four
        # samples rode an event call
        assert wait_for(lambda: engine.send() or calls[first:].count("pair") >= 4, 10.0, 0.01)
        during = calls[first:]
        assert loads.end() - samples == during.count("pair") + during.count("loads")
        assert during.count("loads") < during.count("pair"), during  # most of them rode
        # quiet: once every batch sent is published, samples go alone on their own schedule
        assert wait_for(
            lambda: (
                fwd.next_engine_seq == engine.seq
                and events.end() == fwd.batches + fwd.marks
                and fwd._marked == fwd.translator.seq
            )
        ), "the last batches were never flushed, or no mark followed them"
        mark = decode_message(events.read(0).items[-1])
        assert mark == LastSeq("e0", fwd.translator.seq)
        quiet_start, quiet_samples, marks = len(calls), loads.end(), fwd.marks
        assert wait_for(lambda: calls[quiet_start:].count("loads") >= 2), "no sample alone"
        quiet = calls[quiet_start:]
        assert "pair" not in quiet and "events" not in quiet, quiet
        assert quiet.count("loads") == loads.end() - quiet_samples  # one call each
        assert fwd.marks == marks  # nothing new since: no second mark
        assert fwd.load_samples == loads.end() == calls.count("pair") + calls.count("loads")
        for payload in loads.read(0).items:
            assert decode_load(payload).instance_id == "e0"
    finally:
        fwd.stop(gone=False)
        engine.sock.close(0)


def test_a_sample_meant_to_ride_a_flush_another_thread_emptied_goes_alone() -> None:
    """The thread takes a load sample for a flush it saw batches for; if the engine replica's
    ``publish_snapshot`` took those batches in between, the flush finds none and publishes the
    sample on its own rather than dropping it."""
    calls: list[str] = []
    events, loads = PairBus("events", calls), PairBus("loads", calls)
    fwd = KvEventForwarder(
        EngineEventTranslator("e0", "m", BLOCK),
        events,
        "tcp://127.0.0.1:1",  # never started: no socket
        load_bus=loads,
        load_fn=lambda: LoadSnapshot("e0", 1.0, 0, 1, 0.1, 0.0, 0),
    )
    sample = encode_load(LoadSnapshot("e0", 2.0, 3, 4, 0.5, 0.0, 0))
    with fwd._lock:
        fwd._flush(sample)  # nothing pending
    assert calls == ["loads"] and fwd.load_samples == 1
    assert decode_load(loads.read(0).items[0]).waiting == 3
