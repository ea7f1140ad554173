"""The KV-event forwarder: one thread per engine, from the engine's ZMQ socket to the event bus.

It subscribes to the engine's vLLM-format publisher (frames ``(topic, seq as 8 big-endian bytes,
msgpack KVEventBatch)``; vLLM and the sim engine alike), feeds every batch to an
``EngineEventTranslator`` and publishes the stamped ``InstanceEvents`` on the bus, a busy
engine's batches gathered into one bus call per ``publish_interval_s`` (each batch stays its own
message: order, sequence numbers and gap detection are those of one call per batch). When vLLM's
sequence skips (a slow-joining subscriber, a full high-water mark), it asks the engine's replay
ROUTER for the missing batches (vLLM's protocol: send ``(b"", start seq)``, receive
``(b"", topic, seq, payload)`` per buffered batch and ``(b"", b"", -1, b"")`` at the end). It
publishes a ``Snapshot`` of the instance's residency on demand (a router's resync), the engine's
``LoadSnapshot`` every ``load_interval_s`` on a separate load bus, a ``LastSeq`` mark on the event
bus with the first sample after a quiet spell that follows a batch (a router that lost the last
batches of a burst sees the gap then, not at the instance's next batch, which may be hours
away), and ``InstanceGone`` when it is stopped cleanly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import zmq

from cachemap.events import InstanceGone, LastSeq, Snapshot, encode_message
from cachemap.ingest import EngineEventTranslator
from engines import core_report
from engines.base import LOAD_INTERVAL_S, PUBLISH_INTERVAL_S, REPORT_INTERVAL_S, LoadSnapshot
from engines.bus.base import EventBus

log = logging.getLogger(__name__)
T = TypeVar("T")
END_SEQ = -1
_load_encoder = msgspec.msgpack.Encoder()
_load_decoder = msgspec.msgpack.Decoder(LoadSnapshot)


def encode_load(snapshot: LoadSnapshot) -> bytes:
    return _load_encoder.encode(snapshot)


def decode_load(payload: bytes) -> LoadSnapshot:
    """Raises ``msgspec.DecodeError``/``ValidationError`` on a malformed payload."""
    return _load_decoder.decode(payload)


class KvEventForwarder:
    """Forwards one engine's KV events (and load) to the buses, on its own daemon thread.

    ``resync_poll`` (optional, called about once a second from the thread) returns True when a
    consumer asked for a snapshot of this instance, e.g. ``RayEventBus.take_resync``.

    ``publish_interval_s``: the first batch after a quiet spell is published at once; batches
    that follow within the interval wait for its end and go in one bus call (0: one call per
    batch). A busy engine costs the bus one call per interval instead of one per step, and a
    router learns of a block at most this much later. Within an interval the thread sleeps and
    takes what came at its end, so a busy engine also wakes it once per interval, not per step.
    A load sample due before the next such call goes in it (``EventBus.publish_pair``: one call
    for both logs where the bus can), so a busy engine's samples cost no calls of their own.

    ``report_endpoint``: where the engine's scheduler publishes its ``CoreReport`` (an engine's
    ``load_report_endpoint``). A new report there makes the thread publish a load sample at
    once (``load_fn`` reads the report), at most one per ``report_interval_s``: the router's
    sample is then as old as a step or two, not up to ``load_interval_s``.
    """

    def __init__(
        self,
        translator: EngineEventTranslator,
        bus: EventBus,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        load_bus: EventBus | None = None,
        load_fn: Callable[[], LoadSnapshot] | None = None,
        load_interval_s: float = LOAD_INTERVAL_S,
        publish_interval_s: float = PUBLISH_INTERVAL_S,
        resync_poll: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.time,
        report_endpoint: str | None = None,
        report_interval_s: float = REPORT_INTERVAL_S,
    ) -> None:
        if load_interval_s <= 0:
            raise ValueError(f"load_interval_s must be > 0, got {load_interval_s}")
        if report_interval_s < 0:
            raise ValueError(f"report_interval_s must be >= 0, got {report_interval_s}")
        if publish_interval_s < 0:
            raise ValueError(f"publish_interval_s must be >= 0, got {publish_interval_s}")
        if (load_bus is None) != (load_fn is None):
            raise ValueError("load_bus and load_fn go together: give both or neither")
        self.translator = translator
        self.instance = translator.instance
        self.bus, self.load_bus, self.load_fn = bus, load_bus, load_fn
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.load_interval_s = load_interval_s
        # the engine's scheduler reports: only with a load sample to publish
        self.report_endpoint = report_endpoint if load_fn is not None else None
        self.report_interval_s = report_interval_s
        self.reports = 0  # reports that woke the thread
        self.publish_interval_s = publish_interval_s
        self.resync_poll = resync_poll
        self.clock = clock
        self.next_engine_seq = 0  # vLLM's next expected frame sequence number
        self.batches = 0  # engine batches received (live or replayed)
        self.replayed = 0  # batches recovered through the replay endpoint
        self.published = 0  # bus messages published (events, snapshots)
        self.publish_calls = 0  # bus calls that carried them
        self.load_samples = 0
        self.marks = 0  # LastSeq marks published
        self._marked = -1  # the sequence number the last mark carried
        self.errors = 0
        self._lock = threading.Lock()  # translator + bus publish order
        self._pending: list[bytes] = []  # encoded batches waiting for the interval's end
        self._next_flush = 0.0  # monotonic time before which a batch waits
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[Any] = zmq.Context.instance()

    # -- control -----------------------------------------------------------------------------

    def start(self, timeout_s: float = 5.0) -> None:
        """Start the thread; returns once the subscription socket is connected."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, name=f"kv-forwarder-{self.instance}", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"forwarder for {self.instance} did not start in {timeout_s} s")

    def stop(self, gone: bool = True, timeout_s: float = 5.0) -> None:
        """Stop the thread; with ``gone``, publish ``InstanceGone`` (a clean scale-down)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        with self._lock:
            if gone:
                self._pending.append(encode_message(InstanceGone(self.instance)))
            self._flush()

    @property
    def alive(self) -> bool:
        """The thread is running (False before ``start`` and after ``stop`` or a crash)."""
        return self._thread is not None and self._thread.is_alive()

    def snapshot(self) -> Snapshot:
        """Everything this instance holds now, consistent with what was published."""
        with self._lock:
            return self.translator.snapshot()

    def publish_snapshot(self) -> int:
        """Publish a ``Snapshot`` of everything this instance holds now; returns its offset."""
        with self._lock:  # NOTE: one hold: no batch may be published between the two
            self._flush()  # the batches the snapshot already holds go first
            offset = self.bus.publish(encode_message(self.translator.snapshot()))
            self.published += 1
            self.publish_calls += 1
            return offset

    # -- thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        rep = core_report.subscriber(self.report_endpoint) if self.report_endpoint else None
        poller = zmq.Poller()
        for sock in (sub, rep) if rep is not None else (sub,):
            poller.register(sock, zmq.POLLIN)
        self._ready.set()
        next_load = next_resync_poll = time.monotonic()
        # a report came that no published sample has read yet; when the last one went
        report_due, reported = False, -float("inf")
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                wait_s = next_load - now if self.load_fn else 0.05
                if report_due:
                    wait_s = min(wait_s, reported + self.report_interval_s - now)
                if now < self._next_flush:
                    # NOTE: a batch that comes within a publish interval waits for its end
                    # anyway: sleep through the interval and take what came then, in one
                    # wake-up instead of one per engine step (a report ends the sleep)
                    timeout = max(0.0, min(wait_s, self._next_flush - now))
                    if rep is None:
                        self._stop.wait(timeout)
                    elif rep.poll(int(timeout * 1000)):
                        report_due |= self._take_reports(rep)
                    self._drain(sub)
                else:
                    ready = dict(poller.poll(max(0, min(int(wait_s * 1000), 50))))
                    if sub in ready:
                        self._drain(sub)
                    if rep is not None and rep in ready:
                        report_due |= self._take_reports(rep)
                now = time.monotonic()
                if report_due and now >= reported + self.report_interval_s:
                    next_load = min(next_load, now)  # a sample now, with a flush due or alone
                if self._pending and now >= self._next_flush:
                    # NOTE: a load sample due before the next flush goes with this one, in the
                    # same bus call, taken up to an interval early; the schedule stays on time
                    load = None
                    if self.load_fn is not None and now >= next_load - self.publish_interval_s:
                        load = self._guard(self._load_payload)
                        next_load += self.load_interval_s
                        if next_load <= now:  # the thread fell behind: no burst of samples
                            next_load = now + self.load_interval_s
                        report_due, reported = False, now
                    with self._lock:
                        self._flush(load)
                if self.resync_poll is not None and now >= next_resync_poll:
                    next_resync_poll = now + 1.0
                    if self._guard(self.resync_poll):
                        self._guard(self.publish_snapshot)
                if self.load_fn is not None and now >= next_load:
                    next_load = now + self.load_interval_s
                    report_due, reported = False, now
                    self._guard(self._publish_quiet_load)
        finally:
            sub.close(0)
            if rep is not None:
                rep.close(0)

    def _take_reports(self, rep: zmq.Socket[bytes]) -> bool:
        """Empty the report socket (it keeps the newest only); whether anything came."""
        came = False
        while True:
            try:
                rep.recv(zmq.NOBLOCK)
            except zmq.Again:
                return came
            came = True
            self.reports += 1

    def _drain(self, sub: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_frames(frames)

    def _guard(self, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except Exception:
            if not self.errors:
                log.exception("forwarder %s: error (logged once)", self.instance)
            self.errors += 1
            return None

    def _load_payload(self) -> bytes:
        assert self.load_fn is not None
        return encode_load(self.load_fn())

    def _publish_quiet_load(self) -> None:
        """A load sample due while no batch waits: with the ``LastSeq`` mark, in one bus call,
        when a batch was published since the last mark."""
        payload = self._load_payload()
        with self._lock:
            seq = self.translator.seq
            if seq == self._marked or self._pending:  # nothing new, or batches follow anyway
                self._publish_load(payload)
                return
            self._pending.append(encode_message(LastSeq(self.instance, seq)))
            # the mark is no batch: the next one is not held back a publish interval for it
            if self._flush(payload, hold=False):
                self._marked = seq
                self.marks += 1

    def _publish_load(self, payload: bytes | None = None) -> None:
        """Publish the load sample ``payload`` (encoded), or a fresh one, on its own."""
        assert self.load_bus is not None
        self.load_bus.publish(payload if payload is not None else self._load_payload())
        self.load_samples += 1

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.errors += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq > self.next_engine_seq and self.replay_endpoint is not None:
            self._guard(lambda: self._replay(self.next_engine_seq))
        self._feed(frames[2], seq)

    def _feed(self, payload: bytes, seq: int) -> None:
        self.batches += 1
        if seq >= self.next_engine_seq:
            self.next_engine_seq = seq + 1
        with self._lock:
            msg = self.translator.feed(payload, seq, self.clock())
            if msg is None:
                return
            self._pending.append(encode_message(msg))
            if not self.publish_interval_s:  # 0: one bus call per batch
                self._flush()

    def _flush(self, load: bytes | None = None, hold: bool = True) -> bool:
        """Publish the pending batches in one bus call, with the encoded load sample ``load``
        when given (the caller holds ``_lock``); ``hold``: the next flush waits a publish
        interval from now. True when the batches reached the bus."""
        if not self._pending:
            # the batches went with a snapshot published from another thread since the caller
            # looked (the engine replica's ``publish_snapshot``): the sample goes alone
            if load is not None:
                self._guard(lambda: self._publish_load(load))
            return False
        if hold:
            self._next_flush = time.monotonic() + self.publish_interval_s
        data, self._pending = self._pending, []
        self.publish_calls += 1
        # NOTE: a bus that is down (Redis restarting) loses these messages, not the thread:
        # their sequence numbers are spent, so consumers see the gap and ask for a snapshot.
        load_bus = self.load_bus
        sent: object
        if load is not None and load_bus is not None:
            sent = self._guard(lambda: self.bus.publish_pair(data, load_bus, [load]))
            self.load_samples += sent is not None
        else:
            sent = self._guard(lambda: self.bus.publish_many(data))
        if sent is None:
            return False
        self.published += len(data)
        return True

    def _replay(self, start: int, timeout_ms: int = 1000) -> None:
        assert self.replay_endpoint is not None
        log.info("forwarder %s: replaying engine batches from %d", self.instance, start)
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while dealer.poll(timeout_ms):
                frames = dealer.recv_multipart()
                if len(frames) != 4:
                    self.errors += 1
                    continue
                _, _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return
                if seq >= self.next_engine_seq:
                    self.replayed += 1
                    self._feed(payload, seq)
            log.warning("forwarder %s: replay timed out", self.instance)
        finally:
            dealer.close(0)
