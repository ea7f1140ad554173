"""Prometheus metrics of one router replica (its own registry, so several apps can coexist in
one process, as in tests)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router.placement import Placement

if TYPE_CHECKING:
    from router.dispatch import Dispatcher
    from router.responses import ResponseBuilder


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvroute_requests", "Requests completed", ["instance"], registry=r)
        self.errors = Counter("kvroute_errors", "Client-visible errors", ["status"], registry=r)
        self.prompt_tokens = Counter("kvroute_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "kvroute_cached_prompt_tokens", "Prompt tokens served from cache", registry=r
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
        self.overrides = Gauge(
            "kvroute_placement_overrides",
            "Requests Serve delivered to another engine than placement chose",
            registry=r,
        )
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

    def placed(self, p: Placement) -> None:
        self.predicted_cached_blocks.observe(p.cached_blocks)
        if p.estimated_ttft_s is not None:
            self.estimated_ttft.observe(p.estimated_ttft_s)

    def finished(self, b: ResponseBuilder) -> None:
        self.requests.labels(b.instance_id or "").inc()
        self.prompt_tokens.inc(b.prompt_tokens)
        self.cached_tokens.inc(b.cached_tokens)

    def observe(self, dispatcher: Dispatcher) -> None:
        state = dispatcher.state
        self.failovers.set(dispatcher.failovers)
        self.migrations.set(dispatcher.migrations)
        self.overrides.set(dispatcher.overrides)
        self.cache_map_blocks.set(len(state.cache_map))
        self.in_flight.set(state.load.in_flight())
        self.queued.set(state.admission.queued)
        self.bus_errors.set(state.bus_errors)
        self.resync_pending.set(len(state.needs_resync()))
        if state.disaggregated:
            self.pd_requests.labels("split").set(dispatcher.pd_split)
            self.pd_requests.labels("colocated").set(dispatcher.pd_colocated)
            self.pd_requests.labels("recomputed").set(dispatcher.pd_recomputed)
            self.pd_prefill_seconds.set(dispatcher.pd_prefill_s)
            self.pd_handed_tokens.set(dispatcher.pd_handed_tokens)
            self.pd_pulls.labels("true").set(dispatcher.pd_pulls - dispatcher.pd_pull_failures)
            self.pd_pulls.labels("false").set(dispatcher.pd_pull_failures)
            self.pd_pull_bytes.set(dispatcher.pd_pull_bytes)
            self.pd_pull_seconds.set(dispatcher.pd_pull_s)
            self.pd_decode_prompt_tokens.set(dispatcher.pd_decode_prompt_tokens)
        per_instance = (self.instance_waiting, self.instance_running, self.instance_kv_usage)
        for gauge in (*per_instance, self.pool_waiting, self.pool_running):
            gauge.clear()
        pools: dict[str, list[int]] = {name: [0, 0] for name in state.core.pools}
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
