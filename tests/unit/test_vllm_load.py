"""kvroute's vLLM engine's load, without starting vLLM: the engine core's report where one came
(``engines.core_report``), read from a real ZMQ socket; the front end's accounting before it."""

from __future__ import annotations

import time

import zmq

from engines import core_report
from engines.core_report import CoreReport, CoreReportReader
from engines.ports import free_port
from engines.vllm_load import InFlight, VllmLoad
from tests.support import wait_for


def test_queued_prefill_subtracts_the_routers_cached_estimate() -> None:
    load = VllmLoad("v-0")
    load.inflight.update(
        cold=InFlight(1000),
        warm=InFlight(3000, expected_cached=2900),
        running=InFlight(500, started=True, generated=7),
    )
    snap = load.snapshot()
    assert snap.queued_prefill_tokens == 1000 + 100
    assert snap.running_context_tokens == 507
    assert (snap.waiting, snap.running) == (2, 1)


def _report(seq: int, ts: float, queued: int = 0) -> CoreReport:
    return CoreReport(
        seq, ts, 1, 2, queued, queued // 2, 900, 0.25, 512, ts - 0.03, ts - 0.001, ts - 0.03
    )


def test_the_engine_cores_report_wins_and_keeps_its_age() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    load = VllmLoad("v-0")
    load.inflight["mine"] = InFlight(4000)  # what the front end alone would count
    load.reports = CoreReportReader(endpoint)
    try:
        ts = time.time() - 0.05
        # a slow-joining SUB misses the first frames: send until one lands
        assert wait_for(
            lambda: pub.send(core_report.encode(_report(5, ts, 1200))) or load.snapshot().ts == ts,
            timeout_s=3,
        )
        snap = load.snapshot()
        assert (snap.waiting, snap.running, snap.queued_prefill_tokens) == (1, 2, 1200)
        assert (snap.prefill_tokens_left, snap.running_context_tokens) == (600, 900)
        assert (snap.step_tokens, snap.gpu_kv_usage) == (512, 0.25)
        assert snap.step_start < snap.step_end < snap.ts == ts  # dated when the core held it
        assert snap.inputs_ts == snap.step_start  # it took the requests sent by then
        # a malformed frame and an older report are dropped; the held one stands (the socket
        # keeps the newest frame only: each is read before the next is sent)
        reader = load.reports
        pub.send(b"\x93garbage")
        assert wait_for(lambda: reader.latest() is not None and reader.malformed == 1, 3)
        pub.send(core_report.encode(_report(4, ts + 1, 7)))
        assert wait_for(lambda: reader.latest() is not None and reader.stale == 1, 3)
        assert load.snapshot().queued_prefill_tokens == 1200
        pub.send(core_report.encode(_report(6, ts + 0.01, 300)))
        assert wait_for(lambda: load.snapshot().queued_prefill_tokens == 300, 3)
    finally:
        load.close()
        pub.close(0)
