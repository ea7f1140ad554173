"""The ingress's request histograms and token counters (``router.metrics``): what a streamed, a
whole and an ``n`` request observe, vLLM's buckets, and the replica's labels on every series."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.base import EngineOutput, Usage
from engines.tiny_model import build_tiny_model
from router.api import ChatCompletionRequest, CompletionRequest
from router.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    RouterMetrics,
    placement_reason,
    request_tokens_buckets,
)
from router.placement import Placement
from router.responses import ResponseBuilder
from router.tokenizer import PromptTokenizer

TOKENIZER = PromptTokenizer(build_tiny_model())


def _builder(n: int = 1, stream: bool = True, chat: bool = False) -> ResponseBuilder:
    body: dict[str, Any] = {"model": "m", "max_tokens": 8, "n": n, "stream": stream}
    if chat:
        req: ChatCompletionRequest | CompletionRequest = ChatCompletionRequest.model_validate(
            {**body, "messages": [{"role": "user", "content": "hi"}]}
        )
    else:
        req = CompletionRequest.model_validate({**body, "prompt": "hi"})
    return ResponseBuilder(req, chat, TOKENIZER, "cmpl-x", 5)


def _out(ids: list[int], finished: bool = False) -> EngineOutput:
    out = EngineOutput("r", ids, finished=finished, finish_reason="length" if finished else None)
    if finished:
        out.usage = Usage(5, 0, 2)
    return out


def _value(m: RouterMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def test_a_streamed_request_observes_its_ttft_then_one_itl_per_later_output() -> None:
    m, b = RouterMetrics("m", "r1", 2048), _builder(chat=True)
    timer = m.admitted(b, time.monotonic(), token_times=True)
    b.add(0, _out([11, 12]), "sim-0")  # the first output: two tokens
    assert _value(m, "kvroute_time_to_first_token_seconds_count", instance="sim-0") == 1
    assert _value(m, "kvroute_inter_token_latency_seconds_count", instance="sim-0") == 0
    b.add(0, _out([13]), "sim-0")
    b.add(0, _out([14, 15], finished=True), "sim-0")
    assert _value(m, "kvroute_time_to_first_token_seconds_count", instance="sim-0") == 1
    assert _value(m, "kvroute_inter_token_latency_seconds_count", instance="sim-0") == 2
    assert _value(m, "kvroute_generation_tokens_total", instance="sim-0") == 5
    assert timer.first is not None
    m.finished(b)
    assert _value(m, "kvroute_e2e_request_latency_seconds_count", instance="sim-0") == 1
    assert _value(m, "kvroute_request_time_per_output_token_seconds_count", instance="sim-0") == 1
    assert _value(m, "kvroute_request_queue_time_seconds_count") == 1
    assert _value(m, "kvroute_request_prompt_tokens_sum") == 5
    assert _value(m, "kvroute_request_generation_tokens_sum") == 5
    assert _value(m, "kvroute_prompt_tokens_total", instance="sim-0") == 5
    assert _value(m, "kvroute_cached_prompt_tokens_total", instance="sim-0") == 2
    assert _value(m, "kvroute_request_success_total", finished_reason="length") == 1


def test_the_latencies_are_measured_from_arrival_on_the_ingress_clock() -> None:
    """TTFT = first token - arrival; ITL = the gap since the choice's previous output; time per
    output token = (last - first) / (tokens - 1); e2e = end - arrival; queue = admitted - queued."""
    m, b = RouterMetrics("m", "r1"), _builder()
    b.arrived = 100.0
    timer = m.admitted(b, time.monotonic() - 0.25, token_times=True)
    assert 0.25 <= _value(m, "kvroute_request_queue_time_seconds_sum") < 60
    timer.tokens(0, 1, "sim-1", now=100.5)
    timer.tokens(0, 2, "sim-1", now=100.7)
    timer.tokens(0, 1, "sim-1", now=101.1)
    timer.finished("sim-1", now=101.5)

    def s(name: str) -> float:
        return _value(m, name, instance="sim-1")

    assert s("kvroute_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert s("kvroute_inter_token_latency_seconds_sum") == pytest.approx(0.2 + 0.4)
    assert s("kvroute_inter_token_latency_seconds_count") == 2
    assert s("kvroute_request_time_per_output_token_seconds_sum") == pytest.approx(0.6 / 3)
    assert s("kvroute_e2e_request_latency_seconds_sum") == pytest.approx(1.5)
    # the buckets place each sample: TTFT 0.5 in le=0.5, not in le=0.25
    bucket = "kvroute_time_to_first_token_seconds_bucket"
    assert _value(m, bucket, instance="sim-1", le="0.5") == 1
    assert _value(m, bucket, instance="sim-1", le="0.25") == 0


def test_a_response_delivered_whole_is_timed_from_its_engines_first_token() -> None:
    """A non-streamed request whose engine sends its output whole (issue 59): its first token
    came ``first_token_age_s`` (the engine's interval) before the output did; TTFT (from the
    earliest choice) and time per output token at the end, no ITL (no gaps were seen)."""
    m, b = RouterMetrics("m", "r1"), _builder(n=2, stream=False)
    b.arrived = 100.0
    timer = m.admitted(b, time.monotonic(), token_times=False)
    timer.tokens(1, 3, "sim-0", now=101.0, first_token_age_s=0.2)  # its first token at 100.8
    timer.tokens(0, 5, "sim-0", now=101.5, first_token_age_s=0.8)  # 100.7: the request's first
    assert _value(m, "kvroute_time_to_first_token_seconds_count", instance="sim-0") == 0
    timer.finished("sim-0", now=101.6)

    def s(name: str) -> float:
        return _value(m, name, instance="sim-0")

    assert s("kvroute_time_to_first_token_seconds_count") == 1
    assert s("kvroute_time_to_first_token_seconds_sum") == pytest.approx(0.7)
    assert s("kvroute_inter_token_latency_seconds_count") == 0
    assert s("kvroute_request_time_per_output_token_seconds_sum") == pytest.approx(0.8 / 4 + 0.1)
    assert s("kvroute_e2e_request_latency_seconds_sum") == pytest.approx(1.6)
    assert s("kvroute_generation_tokens_total") == 8


def test_a_whole_output_without_the_engines_interval_dates_its_tokens_at_arrival() -> None:
    """An engine that does not say when its first token came: the output's arrival bounds it;
    an age longer than the request's life is cut at its arrival."""
    m, b = RouterMetrics("m", "r1"), _builder(stream=False)
    m.admitted(b, time.monotonic(), token_times=False)
    b.add(0, _out([11, 12, 13], finished=True), "sim-0")
    m.finished(b)
    assert _value(m, "kvroute_time_to_first_token_seconds_count", instance="sim-0") == 1
    assert _value(m, "kvroute_inter_token_latency_seconds_count", instance="sim-0") == 0
    assert _value(m, "kvroute_e2e_request_latency_seconds_count", instance="sim-0") == 1
    assert _value(m, "kvroute_generation_tokens_total", instance="sim-0") == 3
    timer = m.admitted(b, time.monotonic(), token_times=False)
    timer.tokens(0, 2, "sim-0", now=b.arrived + 1.0, first_token_age_s=5.0)
    timer.finished("sim-0", now=b.arrived + 1.0)
    ttft = _value(m, "kvroute_time_to_first_token_seconds_sum", instance="sim-0")
    assert ttft == pytest.approx(0.0, abs=0.05)  # the first request's few µs, and 0


def test_n_choices_share_one_ttft_and_each_has_its_own_itl_and_time_per_token() -> None:
    m, b = RouterMetrics("m", "r1"), _builder(n=2)
    m.admitted(b, time.monotonic(), token_times=True)
    b.add(0, _out([11]), "sim-0")
    b.add(1, _out([21]), "sim-0")  # the second choice's first output: not an ITL sample
    b.add(1, _out([22], finished=True), "sim-0")
    b.add(0, _out([12], finished=True), "sim-0")
    m.finished(b)
    assert _value(m, "kvroute_time_to_first_token_seconds_count", instance="sim-0") == 1
    assert _value(m, "kvroute_inter_token_latency_seconds_count", instance="sim-0") == 2
    assert _value(m, "kvroute_request_time_per_output_token_seconds_count", instance="sim-0") == 2
    assert _value(m, "kvroute_request_success_total", finished_reason="length") == 2
    assert _value(m, "kvroute_request_generation_tokens_sum") == 4


def test_every_series_carries_the_replica_and_model_labels() -> None:
    """Existing series too: two replicas behind one address are two series, not one that
    resets."""
    m, b = RouterMetrics("tiny", "host:42"), _builder()
    m.placed(Placement("sim-0", estimated_ttft_s=0.1, cached_blocks=2))
    m.admitted(b, time.monotonic(), token_times=True)
    b.add(0, _out([11, 12], finished=True), "sim-0")
    m.finished(b)
    m.errors.labels("404").inc()
    samples = [s for f in text_string_to_metric_families(m.render().decode()) for s in f.samples]
    names = {s.name for s in samples}
    for name in (
        "kvroute_requests_total",
        "kvroute_errors_total",
        "kvroute_placement_cached_blocks_count",
        "kvroute_estimated_ttft_seconds_bucket",
        "kvroute_time_to_first_token_seconds_bucket",
        "kvroute_placements_total",
    ):
        assert name in names
    for s in samples:
        assert s.labels["router"] == "host:42" and s.labels["model_name"] == "tiny", s


def test_the_buckets_are_vllms() -> None:
    buckets = pytest.importorskip("vllm.v1.metrics.buckets")
    assert list(TTFT_BUCKETS) == buckets.histogram_buckets("time_to_first_token")
    assert list(ITL_BUCKETS) == buckets.histogram_buckets("inter_token_latency")
    assert list(REQUEST_LATENCY_BUCKETS) == buckets.histogram_buckets("request_latency")
    for n in (1, 9, 2048, 131072):
        assert request_tokens_buckets(n) == buckets.histogram_buckets("request_tokens", n)


def test_placement_reasons() -> None:
    assert placement_reason(Placement("a")) == "no_cached_prefix"
    assert placement_reason(Placement("a", cached_blocks=3)) == "cached_prefix"
    assert placement_reason(Placement("a", prefill=Placement("p"))) == "pd_split"
    assert placement_reason(Placement("a", detail={"ray_branch": "pow2"})) == "ray_pow2"
