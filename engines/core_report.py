"""Load reported from inside an engine's scheduler, every step and on a heartbeat when idle.

An engine's front end sees only its own requests: it cannot tell a prompt's cached prefix before
the scheduler finds it, nor the chunks a step computes. kvroute's vLLM engine therefore runs a
scheduler that publishes a ``CoreReport`` from vLLM's engine core process
(``engines.vllm_scheduler``) as every step's output comes back, before vLLM turns it into
first tokens (a router takes a prompt out of a report when it sees the prompt's first token after
the report's ``ts``: the report must still count it then), and, while no step runs and nothing
has changed, sends the state after the step, stamped with the time again, every ``HEARTBEAT_S``
(a report is as old as ``ts`` says: what it describes held then). It travels beside the KV
events: a ZMQ PUB socket on loopback, bound by the engine core at the address the front end
chose (``ENDPOINT_ENV``), which the front end (``CoreReportReader``, read by the engine's
``load()``) and the KV-event forwarder (woken by it, to publish the sample at once) subscribe to.

``TRACE_ENV`` names a file where the engine core also writes the state after every change that
could move it (a request added or finished, a step scheduled or done) as JSON lines: the
scheduler's truth at any instant, for ``benchmarks/load_report_bench.py``. Off unless set.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import zmq

log = logging.getLogger(__name__)

ENDPOINT_ENV = "KVROUTE_CORE_REPORT_ENDPOINT"
TRACE_ENV = "KVROUTE_CORE_REPORT_TRACE"
# seconds between two reports of an idle engine (the same as the front end's load samples)
HEARTBEAT_S = 0.1


class CoreReport(msgspec.Struct, array_like=True, frozen=True, tag="core"):
    """An engine scheduler's state at ``ts`` (wall clock, ``time.time()``), as its scheduler
    holds it: no estimate in it.

    ``queued_prefill_tokens`` is ``LoadSnapshot``'s: the uncached prompt tokens of the requests
    without a first token yet, their cached prefix as the scheduler found it (for one not yet
    scheduled, as a lookup finds it now). ``prefill_tokens_left``: the prompt tokens of those
    requests not yet scheduled (vLLM counts a chunk computed when it schedules it).
    ``step_*``: the last step's scheduled tokens and its start and end (0 before the first).
    ``decode_context_tokens``: the context of the running requests past their first token.
    ``inputs_ts``: when the engine core last took the requests sent to it (it takes them
    between steps): one sent later may not be in the report yet, though ``ts`` is later."""

    seq: int
    ts: float
    waiting: int
    running: int
    queued_prefill_tokens: int
    prefill_tokens_left: int
    decode_context_tokens: int
    kv_usage: float
    step_tokens: int
    step_start: float
    step_end: float
    inputs_ts: float


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(CoreReport)


def encode(report: CoreReport) -> bytes:
    return _encoder.encode(report)


def decode(payload: bytes) -> CoreReport:
    """Raises ``msgspec.DecodeError``/``ValidationError`` on a malformed frame."""
    return _decoder.decode(payload)


def subscriber(endpoint: str) -> zmq.Socket[bytes]:
    """A SUB socket on ``endpoint`` that keeps only the newest frame (``CONFLATE``)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CONFLATE, 1)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


class CoreReportReader:
    """The newest ``CoreReport`` an engine core published on ``endpoint``, read without a
    thread: ``latest`` takes what arrived since the last call. A malformed frame is dropped,
    counted in ``malformed`` and logged once; a report older than the one held (by ``seq``: the
    engine core numbers them) is dropped too, counted in ``stale``."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._sock = subscriber(endpoint)
        self._latest: CoreReport | None = None
        self.received = 0
        self.malformed = 0
        self.stale = 0

    def latest(self) -> CoreReport | None:
        sock = self._sock
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return self._latest
            except zmq.ZMQError:  # closed
                return self._latest
            self._take(frame)

    def _take(self, frame: bytes) -> None:
        try:
            report = decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            if not self.malformed:
                log.warning("core report on %s: malformed frame dropped: %s", self.endpoint, e)
            self.malformed += 1
            return
        held = self._latest
        if held is None or report.seq > held.seq or report.seq == 0:  # 0: a restarted core
            self._latest = report
            self.received += 1
        else:
            self.stale += 1

    def close(self) -> None:
        self._sock.close(0)

    def __enter__(self) -> CoreReportReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
