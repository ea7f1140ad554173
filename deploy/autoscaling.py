"""Online autoscaling under Ray Serve: kvroute's autoscaling core (``router.autoscale``) as the
custom autoscaling policy of each autoscaled engine pool's deployment.

How a decision is made and seen:

- Each engine replica reports to Serve, every ``metrics_interval_s``, its load now (waiting,
  running, KV usage, queued prefill tokens) and cumulative request counters: arrivals, prompt,
  cached and output tokens, and TTFT/TPOT as cumulative histogram buckets
  (``EngineDeployment.record_autoscaling_stats``; Serve's replica-reported custom metrics).
- Serve's controller calls the pool's ``PoolPolicy`` (``AutoscalingConfig.policy``, a class
  Serve instantiates once with ``policy_kwargs``) every control-loop tick (0.1 s). Every
  ``interval_s`` it turns the replicas' latest reports into an ``Observation`` (the counters'
  growth since the previous decision; a replica that left takes its counters with it) and asks
  ``Autoscaler.decide`` for the target. Serve's own delays are 0 and its scaling factors 1: the
  core's policy alone decides; Serve clamps to [min_replicas, max_replicas] as the core does.
- Every decision is logged (the controller's log, ``ray/session_latest/logs/serve/``) with its
  reason, and recorded in the app's ``DecisionLog`` (a small detached Ray actor); each ingress
  replica polls it (``DecisionPoller``) and exports it in its ``/metrics``
  (``kvroute_autoscale_*``). The decision is taken once, in the controller; the ingresses only
  show it.

The observation is what the engines measured: TTFT from the replica receiving the request to
its first token (the queue inside the engine, not the ingress's), and the cached tokens the
engine found (not the router's expectation). A TTFT counts at its bucket's upper bound, so the
attainment the policy sees errs low by at most one bucket (``TTFT_BUCKETS_S``).

A replica scaled down drains: Serve stops routing to it (kvroute's ``KvRequestRouter`` drops
it from the router's membership with Serve's replica set) and lets it finish what it runs for
up to ``drain_timeout_s`` (``graceful_shutdown_timeout_s``) before stopping it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from engines.deployment import (
    STAT_ARRIVALS,
    STAT_CACHED,
    STAT_KV_USAGE,
    STAT_OUTPUT,
    STAT_PREFILL,
    STAT_PROMPT,
    STAT_RUNNING,
    STAT_WAITING,
    TPOT_BUCKETS_S,
    TTFT_BUCKETS_S,
    bucket_key,
)
from router.autoscale import (
    DEFAULT_COLD_START_S,
    Autoscaler,
    Decision,
    EngineLoad,
    Observation,
    Slo,
    create_policy,
)

log = logging.getLogger(__name__)
# the decisions go to Serve's logger: in the controller, its log file (controller_*.log)
decisions_log = logging.getLogger("ray.serve")

NAMESPACE = "kvroute"
POLICY_PATH = "deploy.autoscaling:PoolPolicy"
_COUNTERS = (STAT_ARRIVALS, STAT_PROMPT, STAT_CACHED, STAT_OUTPUT)
_BUCKETS = tuple(
    [(bucket_key("ttft", b), b) for b in TTFT_BUCKETS_S]
    + [(bucket_key("tpot", b), b) for b in TPOT_BUCKETS_S]
)


def decision_log_name(app_name: str) -> str:
    return f"kvroute-autoscale-{app_name}"


def _latest(series: Any) -> float | None:
    """The newest value of one replica's time series (a list of Serve's ``TimeStampedValue``)."""
    if not series:
        return None
    return float(max(series, key=lambda p: p.timestamp).value)


class ObservationBuilder:
    """Turns the replicas' reports (Serve's ``AutoscalingContext.raw_metrics``: metric name ->
    replica id -> time series) into ``Observation``s: load from each replica's latest report,
    arrivals, tokens and latencies from its counters' growth since the previous call."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self._seen: dict[str, dict[str, float]] = {}  # replica -> counter -> value last call

    def observe(
        self,
        raw: Mapping[str, Mapping[Any, Any]],
        *,
        now: float,
        replicas: int,
        ready: int,
        window_s: float,
    ) -> Observation:
        latest: dict[str, dict[str, float]] = {}
        for name, by_replica in raw.items():
            for rid, series in by_replica.items():
                v = _latest(series)
                if v is not None:
                    iid = getattr(rid, "unique_id", str(rid))
                    latest.setdefault(iid, {})[name] = v
        sums = dict.fromkeys(_COUNTERS, 0.0)
        ttfts: list[float] = []
        tpots: list[float] = []
        engines = []
        for iid, stats in sorted(latest.items()):
            before = self._seen.get(iid, {})
            grew = {k: max(0.0, v - before.get(k, 0.0)) for k, v in stats.items()}
            for k in _COUNTERS:
                sums[k] += grew.get(k, 0.0)
            for key, bound in _BUCKETS:
                n = round(grew.get(key, 0.0))
                if n:
                    (ttfts if key.startswith("ttft") else tpots).extend([bound] * n)
            engines.append(
                EngineLoad(
                    iid,
                    waiting=int(stats.get(STAT_WAITING, 0)),
                    running=int(stats.get(STAT_RUNNING, 0)),
                    kv_usage=stats.get(STAT_KV_USAGE, 0.0),
                    pending_prefill_tokens=int(stats.get(STAT_PREFILL, 0)),
                )
            )
        # a replica that left takes its counters with it; one that comes back is new
        self._seen = {iid: {**self._seen.get(iid, {}), **s} for iid, s in latest.items()}
        return Observation(
            now=now,
            replicas=replicas,
            ready=ready,
            window_s=window_s,
            arrivals=int(sums[STAT_ARRIVALS]),
            prompt_tokens=int(sums[STAT_PROMPT]),
            output_tokens=int(sums[STAT_OUTPUT]),
            cached_tokens=int(sums[STAT_CACHED]),
            engines=tuple(engines),
            ttfts=tuple(ttfts),
            tpots=tuple(tpots),
            pool=self.pool,
        )


def direction(decision: Decision, obs: Observation) -> str:
    if decision.target > obs.replicas:
        return "up"
    return "down" if decision.target < obs.replicas else "hold"


def reason_kind(reason: str) -> str:
    """A low-cardinality class of a decision's reason (a label of
    ``kvroute_autoscale_decisions_total``; the full text is in the log and the info series):
    ``clamped`` (the policy wanted more or fewer than the bounds allow), ``delay`` (a change
    wanted, held back by the policy's delay), ``idle`` (nothing observed yet), ``backlog``
    (queued work beyond what the ready engines start within the SLO), or ``model`` (the
    policy's model of the traffic and capacity)."""
    if "clamped to" in reason:
        return "clamped"
    if "holding for" in reason or "waiting the" in reason:
        return "delay"
    if "no traffic" in reason or "no running replica" in reason:
        return "idle"
    if "backlog +" in reason:
        return "backlog"
    return "model"


class DecisionLog:
    """One app's autoscaling decisions (a detached Ray actor named ``decision_log_name``):
    written by the pools' policies in Serve's controller, read by the ingress replicas."""

    def __init__(self, keep: int = 256) -> None:
        self.pools: dict[str, dict[str, Any]] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep)

    def record(self, d: dict[str, Any]) -> None:
        p = self.pools.setdefault(d["pool"], {"counts": {}})
        p.update({k: v for k, v in d.items() if k != "pool"})
        key = f"{d['direction']}|{d['kind']}"
        p["counts"][key] = p["counts"].get(key, 0) + 1
        self.recent.append(d)

    def snapshot(self) -> dict[str, Any]:
        """``{"pools": {pool: {target, replicas, ready, direction, kind, reason, ts, counts:
        {"up|model": n, ...}}}, "recent": [decision, ...]}``."""
        return {"pools": self.pools, "recent": list(self.recent)}


def open_decision_log(app_name: str, create: bool = True) -> Any:
    """The handle of ``app_name``'s ``DecisionLog`` (created where missing, if ``create``)."""
    import ray

    name = decision_log_name(app_name)
    if not create:
        return ray.get_actor(name, namespace=NAMESPACE)
    cls: Any = ray.remote(DecisionLog)
    return cls.options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0
    ).remote()


def kill_decision_log(app_name: str) -> None:
    import ray

    with contextlib.suppress(ValueError):  # none: the app never autoscaled
        ray.kill(open_decision_log(app_name, create=False))


class PoolPolicy:
    """Serve's custom autoscaling policy of one engine pool (``AutoscalingConfig.policy``:
    Serve instantiates it once with ``policy_kwargs`` and calls it with an
    ``AutoscalingContext`` every control-loop tick). ``profile`` names the latency profile the
    capacity model prices with, under the engines' limits."""

    def __init__(
        self,
        *,
        app_name: str,
        pool: str,
        policy: str,
        min_replicas: int,
        max_replicas: int,
        interval_s: float,
        slo_ttft_s: float,
        slo_tpot_s: float | None = None,
        attainment: float = 0.99,
        cold_start_s: float = DEFAULT_COLD_START_S,
        profile: str | None = None,
        limits: Mapping[str, Any] | None = None,
        record: bool = True,
    ) -> None:
        self.app_name, self.pool, self.interval_s, self.record = app_name, pool, interval_s, record
        prof = None
        if profile is not None:
            from engines.profile import LatencyProfile

            prof = LatencyProfile.load(profile)
            lim = dict(limits or {})
            prof = prof.with_limits(
                lim.get("max_num_batched_tokens"), lim.get("long_prefill_token_threshold")
            )
        slo = Slo(slo_ttft_s, slo_tpot_s, attainment)
        self.autoscaler = Autoscaler(
            create_policy(policy, profile=prof, slo=slo, cold_start_s=cold_start_s),
            min_replicas,
            max_replicas,
            interval_s,
            pool,
        )
        self.builder = ObservationBuilder(pool)
        self.last: float | None = None
        self._log: Any = None

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        state = dict(ctx.policy_state or {})
        now = ctx.current_time if ctx.current_time is not None else time.time()
        if self.last is not None and now - self.last + 1e-6 < self.interval_s:
            return ctx.target_num_replicas, state
        window = self.interval_s if self.last is None else now - self.last
        self.last = now
        obs = self.builder.observe(
            ctx.raw_metrics or {},
            now=now,
            replicas=ctx.target_num_replicas,
            ready=ctx.current_num_replicas,
            window_s=window,
        )
        d = self.autoscaler.decide(obs)
        self.publish(d, obs)
        return d.target, state

    def publish(self, d: Decision, obs: Observation) -> dict[str, Any]:
        """Log ``d`` with its reason and record it in the app's ``DecisionLog``."""
        way = direction(d, obs)
        entry = {
            "pool": d.pool,
            "target": d.target,
            "replicas": obs.replicas,
            "ready": obs.ready,
            "direction": way,
            "kind": reason_kind(d.reason),
            "reason": d.reason,
            "ts": obs.now,
            "rate": obs.rate,
            "ongoing": obs.ongoing,
        }
        decisions_log.info(
            "kvroute autoscale %s/%s: %d -> %d (%s): %s",
            self.app_name,
            d.pool,
            obs.replicas,
            d.target,
            way,
            d.reason,
        )
        if self.record:
            try:
                if self._log is None:
                    self._log = open_decision_log(self.app_name)
                self._log.record.remote(entry)  # fire and forget: never stalls the controller
            except Exception as e:  # the decision stands; only its export is lost
                self._log = None
                log.warning("kvroute autoscale %s: decision log unavailable: %s", d.pool, e)
        return entry


def policy_kwargs(
    app_name: str,
    pool: str,
    spec: Any,
    profile: str | None,
    limits: Mapping[str, Any],
) -> dict[str, Any]:
    """``PoolPolicy``'s keyword arguments for a pool's ``PoolAutoscaling`` ``spec`` (JSON:
    Serve's ``policy_kwargs`` must be)."""
    slo: Slo = spec.slo
    return {
        "app_name": app_name,
        "pool": pool,
        "policy": spec.policy,
        "min_replicas": spec.min_replicas,
        "max_replicas": spec.max_replicas,
        "interval_s": spec.interval_s,
        "slo_ttft_s": slo.ttft_s,
        "slo_tpot_s": slo.tpot_s,
        "attainment": slo.attainment,
        "cold_start_s": spec.cold_start_s,
        "profile": profile,
        "limits": dict(limits),
    }


def serve_autoscaling_config(spec: Any, instances: int, kwargs: dict[str, Any]) -> Any:
    """Serve's ``AutoscalingConfig`` for a pool: ``PoolPolicy`` with ``kwargs`` decides; Serve's
    delays are 0 and its factors 1 (they would act on top of the core's own)."""
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    return AutoscalingConfig(
        min_replicas=spec.min_replicas,
        max_replicas=spec.max_replicas,
        initial_replicas=spec.initial_replicas(instances),
        metrics_interval_s=spec.metrics_interval_s,
        look_back_period_s=max(spec.interval_s, 2 * spec.metrics_interval_s),  # Serve: >
        upscale_delay_s=0.0,
        downscale_delay_s=0.0,
        policy=AutoscalingPolicy(policy_function=POLICY_PATH, policy_kwargs=kwargs),
    )


class DecisionPoller:
    """An ingress replica's copy of the app's ``DecisionLog``, refreshed every ``poll_s`` by a
    daemon thread (``/metrics`` reads ``latest`` without waiting on Ray)."""

    def __init__(self, app_name: str, poll_s: float = 1.0) -> None:
        self.app_name, self.poll_s = app_name, poll_s
        self.latest: dict[str, Any] = {"pools": {}, "recent": []}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvroute-autoscale", daemon=True)

    def start(self) -> DecisionPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import ray

        handle = None
        while not self._stop.is_set():
            try:
                if handle is None:
                    handle = open_decision_log(self.app_name, create=False)
                self.latest = ray.get(handle.snapshot.remote(), timeout=max(5.0, self.poll_s))
            except ValueError:  # no decision yet: the log does not exist
                pass
            except Exception as e:
                handle = None
                log.debug("autoscale decisions of %s: %s", self.app_name, e)
            self._stop.wait(self.poll_s)

    def __call__(self) -> dict[str, Any]:
        return self.latest
