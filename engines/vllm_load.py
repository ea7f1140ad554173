"""The load kvroute's vLLM engine reports (``LoadSnapshot``), from the best source it has.

1. The engine core's ``CoreReport`` (``engines.core_report``), published by kvroute's scheduler
   every step and on a heartbeat when idle: exact (the cached prefixes the scheduler found), and
   dated when the scheduler held it, so a router reads its age.
2. Until the first report, or where the engine runs vLLM's own scheduler: this front end's own
   accounting of its requests in flight, with vLLM's scheduler stats (a stat logger on the front
   end) for the counts while it steps. The cached prefix of a request not yet started is the
   router's estimate (``EngineRequest.expected_cached_tokens``) there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engines.base import LoadSnapshot
from engines.core_report import CoreReportReader


@dataclass(slots=True)
class InFlight:
    prompt_tokens: int
    expected_cached: int = 0  # the router's estimate (EngineRequest.expected_cached_tokens)
    generated: int = 0
    started: bool = False  # first output seen: prefill done


@dataclass(slots=True)
class _EngineStats:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    ts: float = 0.0


class VllmLoad:
    """One vLLM engine's load sources. The engine keeps ``inflight`` up to date, gives its
    ``stat_logger_factory`` to vLLM and sets ``reports`` when its engine core reports."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.inflight: dict[str, InFlight] = {}
        self.reports: CoreReportReader | None = None
        self._stats = _EngineStats()

    def close(self) -> None:
        if self.reports is not None:
            self.reports.close()
            self.reports = None

    def stat_logger_factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self._stats

        # vLLM is not followed by mypy (pyproject): its base class is Any here
        class _Sampler(StatLoggerBase):  # type: ignore[misc]
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *a: Any, **k: Any) -> None:
                if scheduler_stats is not None:
                    stats.running = scheduler_stats.num_running_reqs
                    stats.waiting = scheduler_stats.num_waiting_reqs
                    stats.kv_usage = scheduler_stats.kv_cache_usage
                    stats.ts = time.monotonic()

            def log_engine_initialized(self) -> None:
                pass

        return _Sampler(vllm_config, engine_index)

    def snapshot(self) -> LoadSnapshot:
        report = self.reports.latest() if self.reports is not None else None
        if report is not None:
            return LoadSnapshot(
                instance_id=self.instance_id,
                ts=report.ts,  # what the scheduler held then: its age is the router's to read
                waiting=report.waiting,
                running=report.running,
                gpu_kv_usage=report.kv_usage,
                cpu_kv_usage=0.0,
                queued_prefill_tokens=report.queued_prefill_tokens,
                running_context_tokens=report.decode_context_tokens,
                prefill_tokens_left=report.prefill_tokens_left,
                step_tokens=report.step_tokens,
                step_start=report.step_start,
                step_end=report.step_end,
                inputs_ts=report.inputs_ts,
            )
        return self._accounted()

    def _accounted(self) -> LoadSnapshot:
        """The front end's own accounting (source 2)."""
        inflight = list(self.inflight.values())
        # NOTE: vLLM finds the cached prefix only when it schedules; until then the router's
        # estimate stands in for it.
        queued = sum(r.prompt_tokens - r.expected_cached for r in inflight if not r.started)
        context = sum(r.prompt_tokens + r.generated for r in inflight if r.started)
        s = self._stats
        if inflight and s.ts:
            # NOTE: vLLM reports stats only while it steps; with nothing in flight they are
            # stale, so our own accounting (zero) wins then.
            waiting, running, kv = s.waiting, s.running, s.kv_usage
        else:
            started = sum(r.started for r in inflight)
            waiting, running, kv = len(inflight) - started, started, 0.0
        return LoadSnapshot(
            instance_id=self.instance_id,
            ts=time.time(),
            waiting=waiting,
            running=running,
            gpu_kv_usage=float(kv),
            cpu_kv_usage=0.0,
            queued_prefill_tokens=queued,
            running_context_tokens=context,
        )
