"""Prometheus metrics of one router replica (its own registry, so several apps can coexist in
one process, as in tests).

Every series carries the replica's ``router`` label (``IngressConfig.router_id``, the
``x-kvroute-router`` header's value) and the served ``model_name``: several replicas behind one
address (Ray Serve's proxy) stay apart as series instead of one series whose counters reset
whenever another replica answers a scrape.

The request-level histograms and token counters are vLLM's (``vllm/v1/metrics/loggers.py``),
measured at the ingress, with vLLM's suffixes and buckets under the ``kvroute_`` prefix, so a
vLLM dashboard or autoscaler reads them with ``vllm:`` replaced by ``kvroute_``:

- ``kvroute_time_to_first_token_seconds``: ``vllm:time_to_first_token_seconds``
  (``dynamo_frontend_time_to_first_token_seconds``)
- ``kvroute_inter_token_latency_seconds``: ``vllm:inter_token_latency_seconds``
  (``dynamo_frontend_inter_token_latency_seconds``)
- ``kvroute_request_time_per_output_token_seconds``: ``vllm:request_time_per_output_token_seconds``
- ``kvroute_e2e_request_latency_seconds``: ``vllm:e2e_request_latency_seconds``
  (``dynamo_frontend_request_duration_seconds``)
- ``kvroute_request_queue_time_seconds``: ``vllm:request_queue_time_seconds``
- ``kvroute_prompt_tokens_total``: ``vllm:prompt_tokens_total``
- ``kvroute_generation_tokens_total``: ``vllm:generation_tokens_total``
  (``dynamo_frontend_output_tokens_total``)
- ``kvroute_request_prompt_tokens``, ``kvroute_request_generation_tokens``: vLLM's per-request
  histograms (``dynamo_frontend_input_sequence_tokens``, ``..._output_sequence_tokens``)
- ``kvroute_request_success_total{finished_reason}``: ``vllm:request_success_total``

What the ingress sees: TTFT runs from the request's arrival (tokenized; before admission) to
its first token of any choice, so it includes the admission queue, placement and the engine's
queue and prefill (a prefill/decode split: both legs); the inter-token latency is one sample
per output of a choice after its first (the gap since that choice's previous output, as vLLM
samples one per engine step); the queue time is the wait in admission before dispatch. TTFT
counts every request that made a token. One whose engine output streams (every streamed request;
a non-streamed one when the ingress applies stop strings) is timed at its first token's arrival.
One the engine delivers whole (a non-streamed request) is timed when it ends: its first token
came ``EngineOutput.first_token_age_s`` before its final output, an interval on the engine's own
clock (no clock is compared across processes or machines; what the ingress adds is the
response's way back, which a streamed first token takes too), and its time per output token
comes from the same interval. Inter-token samples come only from outputs that stream to the
ingress: a response delivered whole has no gaps that the ingress or its client sees (vLLM's
server samples them from its engine core's per-step timestamps, which it receives for every
request; kvroute's ingress receives one output).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from router.placement import Placement

if TYPE_CHECKING:
    from router.dispatch import Dispatcher
    from router.responses import ResponseBuilder


# vLLM 0.32's default buckets (vllm/v1/metrics/buckets.py), kept equal to them by a unit test
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50 ... up to ``max_model_len``."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(float(m * scale))
        scale *= 10


def placement_reason(p: Placement) -> str:
    """Why a request went where it did, as ``kvroute_placements_total`` counts it:
    ``pd_split`` (its prompt is computed on a prefill engine, then handed over), Ray's
    PrefixCacheAffinityRouter's branch (``ray_prefix``, ``ray_smallest``, ``ray_pow2``), else
    ``cached_prefix`` (the chosen engine holds a leading run of its blocks) or
    ``no_cached_prefix``."""
    if p.prefill is not None:
        return "pd_split"
    branch = p.detail.get("ray_branch") if p.detail else None
    if branch:
        return f"ray_{branch}"
    return "cached_prefix" if p.cached_blocks > 0 else "no_cached_prefix"


class _Labelled:
    """A collector that is ``registry`` with ``labels`` added to every sample (last, in order)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry, self.labels = registry, labels

    def collect(self) -> Iterator[Metric]:
        extra = self.labels
        for family in self.registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**s.labels, **extra}) for s in family.samples]
            yield out


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str = "", router_id: str = "", max_model_len: int = 131072) -> None:
        """``model``, ``router_id``: the ``model_name`` and ``router`` labels of every series;
        ``max_model_len`` bounds the per-request token-count buckets."""
        self.registry = r = CollectorRegistry()
        self.exposed = _Labelled(r, {"model_name": model, "router": router_id})
        self.requests = Counter("kvroute_requests", "Requests completed", ["instance"], registry=r)
        self.errors = Counter("kvroute_errors", "Client-visible errors", ["status"], registry=r)
        self.prompt_tokens = Counter(
            "kvroute_prompt_tokens", "Prompt tokens of completed requests", ["instance"], registry=r
        )
        self.cached_tokens = Counter(
            "kvroute_cached_prompt_tokens",
            "Prompt tokens of completed requests served from cache",
            ["instance"],
            registry=r,
        )
        self._request_series(r, max_model_len)
        self._routing_series(r)
        self._pd_series(r)
        self._engine_series(r)
        self._autoscale_series(r)

    def _request_series(self, r: CollectorRegistry, max_model_len: int) -> None:
        """vLLM's request series at the ingress: tokens, latencies, sizes, outcomes."""
        # -- vLLM's request series, at the ingress ---------------------------------------------
        self.generation_tokens = Counter(
            "kvroute_generation_tokens",
            "Output tokens sent to clients (counted as they arrive)",
            ["instance"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvroute_time_to_first_token_seconds",
            "Time from the request's arrival at the ingress to its first token",
            ["instance"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvroute_inter_token_latency_seconds",
            "Time between consecutive outputs of a choice (one sample per output)",
            ["instance"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "kvroute_request_time_per_output_token_seconds",
            "Per choice: (last token time - first token time) / (output tokens - 1)",
            ["instance"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvroute_e2e_request_latency_seconds",
            "Time from the request's arrival at the ingress to its last output",
            ["instance"],
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "kvroute_request_queue_time_seconds",
            "Time a request waited in admission before dispatch",
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        token_buckets = request_tokens_buckets(max_model_len)
        self.request_prompt_tokens = Histogram(
            "kvroute_request_prompt_tokens",
            "Prompt tokens per completed request",
            buckets=token_buckets,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "kvroute_request_generation_tokens",
            "Output tokens per completed request (all its choices)",
            buckets=token_buckets,
            registry=r,
        )
        self.request_success = Counter(
            "kvroute_request_success",
            "Choices completed, by finish reason",
            ["finished_reason"],
            registry=r,
        )

    def _routing_series(self, r: CollectorRegistry) -> None:
        """The router's decisions: placements, admission, the cache map, failovers."""
        self.placements = Counter(
            "kvroute_placements",
            "Placements by reason (router.metrics.placement_reason)",
            ["reason"],
            registry=r,
        )
        self.admission_running = Gauge(
            "kvroute_admission_running", "Requests holding an admission slot", registry=r
        )
        self.admission_rejected = Gauge(
            "kvroute_admission_rejected",
            "Requests admission refused (429): over the TTFT SLO, or the queue full or too slow",
            ["reason"],
            registry=r,
        )
        self.predicted_cached_blocks = Histogram(
            "kvroute_placement_cached_blocks",
            "Leading cached blocks at the chosen instance",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=r,
        )
        self.estimated_ttft = Histogram(
            "kvroute_estimated_ttft_seconds",
            "Placement TTFT estimate",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.cache_map_blocks = Gauge("kvroute_cache_map_blocks", "Blocks in the map", registry=r)
        self.in_flight = Gauge("kvroute_in_flight", "Requests in flight", registry=r)
        self.queued = Gauge("kvroute_admission_queued", "Requests waiting", registry=r)
        self.failovers = Gauge(
            "kvroute_failovers", "Retries on another engine before the first token", registry=r
        )
        self.migrations = Gauge(
            "kvroute_migrations",
            "Requests moved to another engine after their first token (prompt + tokens so far)",
            registry=r,
        )
        self.category_overflow = Gauge(
            "kvroute_category_overflow",
            "Requests whose new category was past router.max_categories (carried as 'other')",
            registry=r,
        )
        self.overrides = Gauge(
            "kvroute_placement_overrides",
            "Requests Serve delivered to another engine than placement chose",
            registry=r,
        )

    def _pd_series(self, r: CollectorRegistry) -> None:
        """Prefill/decode splits and the pools' queues."""
        self.pd_requests = Gauge(
            "kvroute_pd_requests",
            "Prefill/decode pools: requests split (prefill engine, then decode engine), run "
            "whole on a decode engine (colocated: skipped the prefill pool), or recomputed on a "
            "decode engine after a failed hand-over",
            ["path"],
            registry=r,
        )
        self.pd_prefill_seconds = Gauge(
            "kvroute_pd_prefill_seconds",
            "Total seconds of prefill legs that handed their KV over (per request: divide by "
            "kvroute_pd_requests{path='split'})",
            registry=r,
        )
        self.pd_handed_tokens = Gauge(
            "kvroute_pd_handed_tokens",
            "Total prompt tokens whose KV was handed from a prefill to a decode engine (bytes: "
            "times the model's KV bytes per token)",
            registry=r,
        )
        self.pd_pulls = Gauge(
            "kvroute_pd_pulls",
            "KV pulls decode engines reported (kvroute's connector), by outcome",
            ["ok"],
            registry=r,
        )
        self.pd_pull_bytes = Gauge(
            "kvroute_pd_pull_bytes", "Total KV bytes decode engines pulled", registry=r
        )
        self.pd_pull_seconds = Gauge(
            "kvroute_pd_pull_seconds", "Total seconds decode engines spent pulling KV", registry=r
        )
        self.pd_decode_prompt_tokens = Gauge(
            "kvroute_pd_decode_prompt_tokens",
            "Total prompt tokens decode engines computed after their pulls (1 per pull when the "
            "hand-over worked: the last token, which vLLM recomputes)",
            registry=r,
        )
        self.pool_waiting = Gauge(
            "kvroute_pool_waiting", "Requests waiting, summed over a pool", ["pool"], registry=r
        )
        self.pool_running = Gauge(
            "kvroute_pool_running", "Requests running, summed over a pool", ["pool"], registry=r
        )

    def _engine_series(self, r: CollectorRegistry) -> None:
        """The buses, calibration, event lag, and each engine's load."""
        self.bus_errors = Gauge("kvroute_bus_errors", "Event bus read errors", registry=r)
        self.ttft_calibration = Gauge(
            "kvroute_ttft_calibration",
            "kv_ttft's online fit: observed TTFT ~ a*profile + b*running + d*waiting + c",
            ["coef"],
            registry=r,
        )
        self.resync_pending = Gauge(
            "kvroute_resync_pending", "Instances awaiting resync", registry=r
        )
        self.kv_event_gaps = Gauge(
            "kvroute_kv_event_gaps",
            "Gaps seen in the engines' KV event sequences since start (each asks the engine "
            "for a snapshot; a gap at a burst's end is seen by the LastSeq mark after it)",
            registry=r,
        )
        self.kv_event_lag = Gauge(
            "kvroute_kv_event_lag_seconds",
            "Age of the oldest KV event batch the latest bus read applied (engine stamp to "
            "now): how stale the cache map is",
            registry=r,
        )
        self.load_samples_dropped = Gauge(
            "kvroute_load_samples_dropped",
            "Engine load samples this replica dropped, by reason: malformed, future (stamped "
            "over engines.bus.liveness.FUTURE_S past its clock), out_of_order (older than the "
            "instance's latest)",
            ["reason"],
            registry=r,
        )
        self.kv_events_behind = Gauge(
            "kvroute_kv_events_behind",
            "1 while this replica is behind the engines' KV events (the latest read was full, "
            "or its events were over engines.bus.liveness.LAG_WARN_S old)",
            registry=r,
        )
        # per engine instance, as placement sees it (its load sample plus this router's newer
        # requests); the labels of an instance that left go with it
        self.instance_waiting = Gauge(
            "kvroute_instance_waiting", "Requests waiting on the engine", ["instance"], registry=r
        )
        self.instance_running = Gauge(
            "kvroute_instance_running", "Requests running on the engine", ["instance"], registry=r
        )
        self.instance_kv_usage = Gauge(
            "kvroute_instance_gpu_kv_usage",
            "Fraction of the engine's GPU KV blocks in use",
            ["instance"],
            registry=r,
        )
        # online autoscaling (deploy/autoscaling.py): the decisions Serve's controller took for
        # each autoscaled pool, as this replica last read them (none: no pool autoscales)

    def _autoscale_series(self, r: CollectorRegistry) -> None:
        """The autoscaler's decisions per pool."""
        self.autoscale_target = Gauge(
            "kvroute_autoscale_target_replicas",
            "The replica count the pool's latest autoscaling decision set",
            ["pool"],
            registry=r,
        )
        self.autoscale_replicas = Gauge(
            "kvroute_autoscale_replicas",
            "The pool's replicas when it was last decided: counted (serving or starting, the "
            "target before the decision) and ready (serving)",
            ["pool", "state"],
            registry=r,
        )
        self.autoscale_decisions = Gauge(
            "kvroute_autoscale_decisions_total",
            "Autoscaling decisions by direction (up, down, hold) and reason class (model, "
            "backlog, delay, clamped, idle)",
            ["pool", "direction", "reason"],
            registry=r,
        )
        self.autoscale_last = Gauge(
            "kvroute_autoscale_last_decision_timestamp_seconds",
            "Unix time of the pool's latest autoscaling decision",
            ["pool"],
            registry=r,
        )
        self.autoscale_info = Gauge(
            "kvroute_autoscale_last_decision_info",
            "1, labelled with the pool's latest autoscaling decision and its reason in full",
            ["pool", "direction", "reason"],
            registry=r,
        )

    def placed(self, p: Placement) -> None:
        self.predicted_cached_blocks.observe(p.cached_blocks)
        self.placements.labels(placement_reason(p)).inc()
        if p.estimated_ttft_s is not None:
            self.estimated_ttft.observe(p.estimated_ttft_s)

    def admitted(self, b: ResponseBuilder, queued_at: float, token_times: bool) -> RequestTimer:
        """``b``'s request left admission (it queued at ``queued_at``, ``time.monotonic()``);
        ``token_times``: its engine output streams, so outputs arrive as tokens are made. The
        request's timer, attached to ``b`` (which reports its outputs to it)."""
        b.timer = timer = RequestTimer(self, b.arrived, len(b.choices), token_times)
        self.queue_time.observe(max(time.monotonic() - queued_at, 0.0))
        return timer

    def finished(self, b: ResponseBuilder) -> None:
        instance = b.instance_id or ""
        self.requests.labels(instance).inc()
        self.prompt_tokens.labels(instance).inc(b.prompt_tokens)
        self.cached_tokens.labels(instance).inc(b.cached_tokens)
        self.request_prompt_tokens.observe(b.prompt_tokens)
        self.request_generation_tokens.observe(b.completion_tokens)
        for c in b.choices:
            self.request_success.labels(c.finish_reason or "abort").inc()
        if b.timer is not None:
            b.timer.finished(instance)

    def observe(self, dispatcher: Dispatcher) -> None:
        state = dispatcher.state
        self.failovers.set(dispatcher.failovers)
        self.migrations.set(dispatcher.migrations)
        self.overrides.set(dispatcher.overrides)
        self.cache_map_blocks.set(len(state.cache_map))
        self.in_flight.set(state.load.in_flight())
        admission = state.admission
        self.queued.set(admission.queued)
        self.admission_running.set(admission.running)
        self.admission_rejected.labels("slo").set(admission.rejected_slo)
        self.admission_rejected.labels("queue").set(admission.rejected_queue)
        self.bus_errors.set(state.bus_errors)
        self.resync_pending.set(len(state.needs_resync()))
        self.kv_event_gaps.set(state.event_gaps)
        watcher = state.watcher
        if watcher is not None:
            self.kv_event_lag.set(watcher.event_lag_s)
            for why, n in watcher.dropped_loads.items():
                self.load_samples_dropped.labels(why).set(n)
            self.kv_events_behind.set(int(watcher.behind))
        if state.disaggregated:
            pd = dispatcher.pd
            self.pd_requests.labels("split").set(pd.split)
            self.pd_requests.labels("colocated").set(pd.colocated)
            self.pd_requests.labels("recomputed").set(pd.recomputed)
            self.pd_prefill_seconds.set(pd.prefill_s)
            self.pd_handed_tokens.set(pd.handed_tokens)
            self.pd_pulls.labels("true").set(pd.pulls - pd.pull_failures)
            self.pd_pulls.labels("false").set(pd.pull_failures)
            self.pd_pull_bytes.set(pd.pull_bytes)
            self.pd_pull_seconds.set(pd.pull_s)
            self.pd_decode_prompt_tokens.set(pd.decode_prompt_tokens)
        per_instance = (self.instance_waiting, self.instance_running, self.instance_kv_usage)
        for gauge in (*per_instance, self.pool_waiting, self.pool_running):
            gauge.clear()
        pools: dict[str, list[int]] = {name: [0, 0] for name in state.pools}
        for v in state.views():
            self.instance_waiting.labels(v.instance_id).set(v.waiting)
            self.instance_running.labels(v.instance_id).set(v.running)
            self.instance_kv_usage.labels(v.instance_id).set(v.gpu_kv_usage)
            totals = pools[state.pool_name(v.instance_id)]
            totals[0] += v.waiting
            totals[1] += v.running
        for name, (waiting, running) in pools.items():
            self.pool_waiting.labels(name).set(waiting)
            self.pool_running.labels(name).set(running)
        cal = getattr(state.scorer, "calibration", None)
        if cal is not None:
            for coef in ("a", "b", "c", "d", "samples"):
                self.ttft_calibration.labels(coef).set(getattr(cal, coef))

    def autoscaled(self, snapshot: Mapping[str, Any]) -> None:
        """Show the autoscaling decisions of ``snapshot`` (``DecisionLog.snapshot``: per pool
        its latest decision and the counts by direction and reason class)."""
        for gauge in (self.autoscale_decisions, self.autoscale_info):
            gauge.clear()
        for pool, d in snapshot.get("pools", {}).items():
            self.autoscale_target.labels(pool).set(d["target"])
            self.autoscale_replicas.labels(pool, "counted").set(d["replicas"])
            self.autoscale_replicas.labels(pool, "ready").set(d["ready"])
            self.autoscale_last.labels(pool).set(d["ts"])
            self.autoscale_info.labels(pool, d["direction"], d["reason"]).set(1)
            for key, n in d.get("counts", {}).items():
                way, _, kind = key.partition("|")
                self.autoscale_decisions.labels(pool, way, kind).set(n)

    def render(self) -> bytes:
        """The exposition text: every series with its ``model_name`` and ``router`` labels."""
        return generate_latest(self.exposed)


class RequestTimer:
    """One request's clock at the ingress (``time.monotonic()``): observes its TTFT at the first
    token of any choice, an inter-token latency per later output of a choice, and at the end
    its latency and each choice's time per output token. Without ``token_times`` (outputs
    delivered whole) a choice's first token is dated by its engine (``first_token_age_s``) and
    the TTFT, from the earliest choice, is observed at the end."""

    __slots__ = ("_first", "_last", "_m", "_n", "arrived", "choices", "first", "token_times")

    def __init__(self, metrics: RouterMetrics, arrived: float, choices: int, token_times: bool):
        self._m = metrics
        self.arrived = arrived
        self.choices = choices
        self.token_times = token_times
        self.first: float | None = None  # the request's first token
        self._first: list[float | None] = [None] * choices  # per choice: its first output
        self._last: list[float] = [0.0] * choices  # its latest output
        self._n = [0] * choices  # its tokens

    def tokens(
        self,
        index: int,
        count: int,
        instance: str,
        now: float | None = None,
        first_token_age_s: float | None = None,
    ) -> None:
        """``count`` (> 0) new tokens of choice ``index`` arrived from ``instance``;
        ``first_token_age_s``: the output's ``EngineOutput.first_token_age_s``."""
        now = time.monotonic() if now is None else now
        m = self._m
        m.generation_tokens.labels(instance).inc(count)
        self._n[index] += count
        if not self.token_times:
            # the choice's first token came before the output that carries it, by the engine's
            # interval (never before the request arrived)
            first = now if first_token_age_s is None else now - first_token_age_s
            seen = self._first[index]
            self._first[index] = max(first if seen is None else min(seen, first), self.arrived)
            self._last[index] = now
            return
        if self._first[index] is None:
            self._first[index] = now
            if self.first is None:
                self.first = now
                m.ttft.labels(instance).observe(now - self.arrived)
        else:
            m.itl.labels(instance).observe(now - self._last[index])
        self._last[index] = now

    def finished(self, instance: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        m = self._m
        m.e2e.labels(instance).observe(now - self.arrived)
        if not self.token_times:
            firsts = [f for f in self._first if f is not None]
            if firsts:
                self.first = min(firsts)
                m.ttft.labels(instance).observe(self.first - self.arrived)
        for first, last, n in zip(self._first, self._last, self._n, strict=True):
            if first is not None and n > 1:
                m.tpot.labels(instance).observe((last - first) / (n - 1))
