"""kvroute's vLLM scheduler: vLLM's own, reporting its load from the engine core.

vLLM 0.32 lets an engine name its scheduler class (``SchedulerConfig.scheduler_cls``, resolved by
qualified name in the engine core process). kvroute's vLLM engine names ``make_scheduler``,
which builds vLLM's ``Scheduler``, or ``AsyncScheduler`` where vLLM turned async scheduling on,
with ``_Reporting`` mixed in. Nothing of vLLM's scheduling changes: the mixin wraps four calls
to keep a ``CoreReport`` (``engines.core_report``) true and publish it.

Why a scheduler class and not vLLM's stat loggers: those run in the front end, on the stats
the engine core sends with its outputs, so they stop when nothing is output and carry counts
only (no prompt tokens left, no cached prefixes). Why not a KV connector: it sees the
scheduler's requests only through its own hooks. The scheduler holds the truth.

Cost on the step: two passes over the unfinished requests per step, before and after its
output is processed (a few attribute reads each: tens of microseconds at a few hundred
requests, against a step of tens of milliseconds; ``benchmarks/load_report_bench.py``), one
msgpack record and one non-blocking ZMQ send that drops the report when the
subscribers are behind. A request not yet scheduled has its cached prefix looked up once
(vLLM's own lookup, without its hit statistics); the step that schedules it replaces that with
the hit it found. The heartbeat is a thread of its own that only re-stamps the last report.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, TextIO

import msgspec
import zmq
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from engines.core_report import ENDPOINT_ENV, HEARTBEAT_S, TRACE_ENV, CoreReport, encode

log = logging.getLogger(__name__)


class _Reporter:
    """The engine core's end of the report: the state, its socket and its heartbeat (where
    there is an ``endpoint``), and its trace file (where there is a ``trace``)."""

    def __init__(
        self, endpoint: str | None, trace: str | None, heartbeat_s: float = HEARTBEAT_S
    ) -> None:
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        if endpoint:
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.PUB)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDHWM, 64)
            self._sock.bind(endpoint)
        self._lock = threading.Lock()  # the socket and ``last``, between the core and heartbeat
        self.seq = 0
        self.last: CoreReport | None = None  # the state now, while ``dirty`` is clear
        self.sent_ts = 0.0  # when the last report sent held
        # set before anything that may move the state, cleared by the report after it: while
        # it is clear the last report still holds, and the heartbeat may re-stamp it
        self.dirty = True
        self.hits: dict[str, int] = {}  # cached prefix of requests without a first token
        self.steps: dict[int, tuple[float, int]] = {}  # id(scheduler output): start, tokens
        self.step = (0, 0.0, 0.0)  # the last step done: tokens, start, end
        self.inputs_ts = 0.0  # when the core last took its input (the last schedule's start)
        self.sends = self.dropped = self.lookup_errors = 0
        self._trace: TextIO | None = open(trace, "a") if trace else None  # noqa: SIM115
        self.cost_s = 0.0  # what the last state cost to take (timed where it is traced)
        self._stop = threading.Event()
        self._heartbeat_s = heartbeat_s
        self._thread: threading.Thread | None = None
        if self._sock is not None:
            self._thread = threading.Thread(
                target=self._beat, name="kvroute-core-report", daemon=True
            )
            self._thread.start()

    @property
    def tracing(self) -> bool:
        return self._trace is not None

    # -- state -------------------------------------------------------------------------------

    def _hit(self, sched: Any, request: Any) -> int:
        """``request``'s cached prefix as a lookup finds it now (it is not scheduled yet)."""
        try:
            mgr = sched.kv_cache_manager
            if not mgr.prefix_cache_lookup_enabled(request):
                return 0
            _, hit, _ = mgr.coordinator.find_longest_cache_hit(
                request.block_hashes, request.num_tokens - 1
            )
            return int(hit)
        except Exception as e:  # a vLLM change must not stop the engine: report it uncached
            if not self.lookup_errors:
                log.warning("core report: prefix lookup failed, counting prompts uncached: %s", e)
            self.lookup_errors += 1
            return 0

    def state(self, sched: Any, ts: float) -> CoreReport:
        hits = self.hits
        queued = left = 0
        for rid, r in sched.requests.items():
            if r.num_output_tokens or r.is_finished():
                continue
            hit = hits.get(rid)
            if hit is None:
                hit = hits[rid] = self._hit(sched, r)
            prompt = r.num_prompt_tokens
            queued += prompt - hit
            left += max(prompt - max(r.num_computed_tokens, hit), 0)
        context = sum(r.num_computed_tokens for r in sched.running if r.num_output_tokens)
        if len(hits) > len(sched.requests):  # requests ended without a first token
            self.hits = {k: v for k, v in hits.items() if k in sched.requests}
        running, waiting = sched.get_request_counts()
        tokens, start, end = self.step
        return CoreReport(
            self.seq,
            ts,
            waiting,
            running,
            queued,
            left,
            context,
            float(sched.get_kv_cache_usage()),
            tokens,
            start,
            end,
            self.inputs_ts or ts,
        )

    def now(self, sched: Any) -> CoreReport:
        """The state now (``state`` at the wall clock), timed into ``cost_s`` when tracing."""
        if self._trace is None:
            return self.state(sched, time.time())
        t0 = time.perf_counter()
        report = self.state(sched, time.time())
        self.cost_s = time.perf_counter() - t0
        return report

    def traced(self, s: CoreReport, added: str = "") -> None:
        """Write state ``s`` to the trace file, where there is one (benchmarks only), with the
        id of the request just added (vLLM's, which ends in ``-`` and 8 characters)."""
        if self._trace is not None:
            row: list[Any] = [s.ts, s.waiting, s.running, s.queued_prefill_tokens]
            row += [s.prefill_tokens_left, s.step_tokens, s.step_start, s.step_end, self.cost_s]
            self._trace.write(json.dumps([*row, added]) + "\n")

    # -- sending -----------------------------------------------------------------------------

    def publish(self, sched: Any, settled: bool = True) -> None:
        """Send the state now. ``settled=False``: the state a step's outputs leave from, sent
        before they are processed (its first tokens not out yet: a router that sees one after
        this report's ``ts`` rightly takes that prompt out of it); ``settle`` follows."""
        with self._lock:
            self.seq += 1
            report = self.now(sched)
            if settled:
                self.last, self.dirty = report, False
            self.sent_ts = report.ts
            self._send(report)
        if settled:
            self.traced(report)

    def settle(self, sched: Any) -> None:
        """Keep the state now for the heartbeat, unsent: it is true from now on, but a router
        may not have seen the first tokens it left out yet (they go out after it)."""
        with self._lock:
            report = self.last = self.now(sched)
            self.dirty = False
        self.traced(report)

    def _send(self, report: CoreReport) -> None:
        if self._sock is None:
            return
        try:
            self._sock.send(encode(report), zmq.NOBLOCK)
            self.sends += 1
        except zmq.ZMQError:  # subscribers behind: a newer report follows
            self.dropped += 1

    def _beat(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            now = time.time()
            # NOTE: read after ``now``: clear then means nothing had moved the state by ``now``
            if self.dirty:
                continue
            with self._lock:
                last = self.last
                if last is None or now - self.sent_ts < 0.5 * self._heartbeat_s:
                    continue
                self.seq += 1
                # NOTE: idle, the core takes a request as it comes (and marks the state dirty)
                report = msgspec.structs.replace(last, seq=self.seq, ts=now, inputs_ts=now)
                self.last, self.sent_ts = report, now
                self._send(report)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * self._heartbeat_s)
        with self._lock:
            if self._sock is not None:
                self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
        if self._trace is not None:
            self._trace.close()


class _Reporting:
    """Mixed into vLLM's scheduler classes: keeps the engine core's ``CoreReport``. Inert
    unless ``ENDPOINT_ENV`` names where to publish it or ``TRACE_ENV`` where to trace it."""

    _kvroute_report: _Reporter | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        endpoint, trace = os.environ.get(ENDPOINT_ENV), os.environ.get(TRACE_ENV)
        if endpoint or trace:
            self._kvroute_report = _Reporter(endpoint, trace)
            log.info("kvroute: engine core reports its load on %s", endpoint or "no socket")

    def add_request(self, request: Any) -> None:
        rep = self._kvroute_report
        if rep is not None:
            rep.dirty = True
        super().add_request(request)  # type: ignore[misc]
        if rep is not None and rep.tracing:
            rep.traced(rep.now(self), request.request_id)

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        rep = self._kvroute_report
        if rep is not None:
            rep.dirty = True
        out = super().finish_requests(request_ids, finished_status)  # type: ignore[misc]
        if rep is not None:
            rep.publish(self)
        return out

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        rep = self._kvroute_report
        start = time.time()
        if rep is not None:  # the core took its input queue just before
            rep.inputs_ts = start
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if rep is not None and out.total_num_scheduled_tokens:
            rep.dirty = True  # NOTE: vLLM already counts the scheduled tokens computed
            rep.steps[id(out)] = (start, out.total_num_scheduled_tokens)
            for new in out.scheduled_new_reqs:  # the cached prefix the schedule found
                rep.hits[new.req_id] = new.num_computed_tokens
            if rep.tracing:
                rep.traced(rep.now(self))
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        rep = self._kvroute_report
        changed = False  # nothing moved the state: the last report still holds, none is due
        if rep is not None:
            step = rep.steps.pop(id(scheduler_output), None)
            if step is not None:
                rep.step = (step[1], step[0], time.time())
            changed = step is not None or rep.dirty
            if changed:
                # NOTE: before the outputs: a report dated after a first token that a router
                # sees later would have that prompt taken out twice (``router.load``)
                rep.publish(self, settled=False)
        out = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if rep is not None and changed:
            rep.settle(self)
        return out

    def shutdown(self) -> None:
        rep, self._kvroute_report = self._kvroute_report, None
        if rep is not None:
            rep.close()
        super().shutdown()  # type: ignore[misc]


class ReportingScheduler(_Reporting, Scheduler):  # type: ignore[misc]
    """vLLM's ``Scheduler`` with the load report."""


class ReportingAsyncScheduler(_Reporting, AsyncScheduler):  # type: ignore[misc]
    """vLLM's ``AsyncScheduler`` with the load report."""


def make_scheduler(*args: Any, **kwargs: Any) -> Any:
    """What ``SchedulerConfig.scheduler_cls`` names: vLLM calls it as the class it would have
    chosen, with the same arguments; it builds that class with the report mixed in."""
    config = kwargs.get("vllm_config")
    async_ = bool(config is not None and config.scheduler_config.async_scheduling)
    cls = ReportingAsyncScheduler if async_ else ReportingScheduler
    return cls(*args, **kwargs)


SCHEDULER_QUALNAME = f"{__name__}.make_scheduler"
