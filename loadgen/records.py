"""The record of one request, shared by HTTP runs and simulated ones, so ``loadgen.metrics`` and
``loadgen.report`` serve both."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestRecord:
    """What one request did, over HTTP (``loadgen.client``) or in the cluster simulator
    (``simulation.cluster``). Times are seconds since the run's start (``perf_counter`` based, or
    virtual); ``intended_s`` is the schedule's send time, latencies are measured from it.

    ``itl_s`` holds every inter-token gap where the client saw them (HTTP streams); a simulated
    run skips decode steps in closed form and leaves it empty, so ``tpot_s`` is the mean gap
    from first token to done. ``instance``, ``cpu_cached_tokens``, ``preemptions`` and
    ``scheduled_s`` (when an engine step first scheduled it: vLLM's queue time ends there) are
    known only where the engine says (the simulator; None/0/NaN over HTTP). For a split
    request they are its decode leg's."""

    index: int
    category: str
    chat_id: int | None
    input_tokens: int
    max_tokens: int
    intended_s: float
    sent_s: float = math.nan
    scheduled_s: float = math.nan
    first_token_s: float = math.nan
    done_s: float = math.nan
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    error_detail: str | None = None
    status: int = 0
    cap_delayed: bool = False
    reply: str = ""
    instance: str | None = None
    cpu_cached_tokens: int | None = None
    preemptions: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and not math.isnan(self.done_s)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.intended_s

    @property
    def e2e_s(self) -> float:
        return self.done_s - self.intended_s

    @property
    def send_lag_s(self) -> float:
        return self.sent_s - self.intended_s

    def meets(self, ttft_s: float, tpot_s: float | None = None) -> bool:
        """Completed within the SLO: TTFT <= ``ttft_s`` and mean TPOT <= ``tpot_s`` (None: no
        TPOT goal; one output token has no TPOT, so it cannot miss one)."""
        if not self.ok or self.ttft_s > ttft_s:
            return False
        return tpot_s is None or not self.tpot_s > tpot_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (NaN with fewer than two tokens)."""
        if self.itl_s:
            return sum(self.itl_s) / len(self.itl_s)
        if self.output_tokens < 2 or not self.ok:
            return math.nan
        return (self.done_s - self.first_token_s) / (self.output_tokens - 1)
