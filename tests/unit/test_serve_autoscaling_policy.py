"""The Serve side of online autoscaling (deploy/autoscaling.py), without a cluster: what the
replicas report becomes the core's ``Observation``; the pool's policy, wrapped the way Serve's
controller wraps a custom policy, decides once per interval; decisions reach ``/metrics``; the
config refuses bad autoscaling blocks naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingContext

from deploy.autoscaling import (
    DecisionLog,
    ObservationBuilder,
    PoolPolicy,
    policy_kwargs,
    reason_kind,
    serve_autoscaling_config,
)
from deploy.config import ServeConfig
from engines.base import EngineOutput, Usage
from engines.deployment import TTFT_BUCKETS_S, RequestStats, bucket_key
from router.metrics import RouterMetrics

DEP = DeploymentID("engine", "app")


def rid(n: int) -> ReplicaID:
    return ReplicaID(f"r{n}", DEP)


def raw(reports: dict[int, dict[str, float]], ts: float = 100.0) -> dict[str, Any]:
    """Serve's ``raw_metrics``: metric -> replica -> time series (an older point first)."""
    out: dict[str, Any] = {}
    for n, stats in reports.items():
        for k, v in stats.items():
            out.setdefault(k, {})[rid(n)] = [
                TimeStampedValue(ts - 1, -1.0),
                TimeStampedValue(ts, v),
            ]
    return out


def context(
    raw_metrics: dict[str, Any], *, now: float, target: int, running: int, config: Any = None
) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=DEP,
        deployment_name="engine",
        app_name="app",
        current_num_replicas=running,
        target_num_replicas=target,
        running_replicas=[rid(i) for i in range(running)],
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics={},
        raw_metrics=raw_metrics,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=3,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=config,
    )


def test_request_stats_buckets() -> None:
    s = RequestStats()
    s.arrived(100)
    s.first_token(0.3)
    s.finished(EngineOutput("a", [1], finished=True, usage=Usage(100, 11, 64)), 10.0, 11.0)
    c = s.counters
    assert (c["arrivals"], c["prompt_tokens"], c["cached_tokens"], c["output_tokens"]) == (
        1,
        100,
        64,
        11,
    )
    assert c[bucket_key("ttft", 0.5)] == 1 and c[bucket_key("ttft", 0.25)] == 0
    assert c[bucket_key("tpot", 0.1)] == 1  # 1 s over 10 gaps
    assert bucket_key("ttft", TTFT_BUCKETS_S[-1]) == "ttft_le_inf"


def test_observation_from_replica_reports() -> None:
    b = ObservationBuilder("engine")
    first = {"arrivals": 10, "prompt_tokens": 1000, "cached_tokens": 400, "output_tokens": 50}
    reports = {
        0: {"waiting": 3, "running": 2, "kv_usage": 0.5, **first, "ttft_le_0.5": 8, "ttft_le_4": 2},
        1: {"waiting": 0, "running": 1, "arrivals": 4, "prompt_tokens": 400, "ttft_le_0.1": 4},
    }
    obs = b.observe(raw(reports), now=100.0, replicas=2, ready=2, window_s=5.0)
    assert (obs.arrivals, obs.prompt_tokens, obs.cached_tokens) == (14, 1400, 400)
    assert obs.rate == pytest.approx(14 / 5)
    assert obs.ongoing == 6  # the latest point, not the older one
    assert sorted(obs.ttfts) == [0.1] * 4 + [0.5] * 8 + [4.0] * 2
    assert {e.instance_id for e in obs.engines} == {"r0", "r1"}
    # next window: only the growth counts; r1 left (its counters go with it), r2 is new
    reports[0].update(arrivals=13, prompt_tokens=1300)
    reports[0]["ttft_le_0.5"] = 11
    del reports[1]
    reports[2] = {"arrivals": 2, "prompt_tokens": 100, "waiting": 0, "running": 2}
    obs = b.observe(raw(reports, 105.0), now=105.0, replicas=2, ready=2, window_s=5.0)
    assert (obs.arrivals, obs.prompt_tokens, obs.cached_tokens) == (5, 400, 0)
    assert obs.ttfts == (0.5,) * 3
    assert {e.instance_id for e in obs.engines} == {"r0", "r2"}


def spec(**autoscaling: Any) -> Any:
    cfg = ServeConfig.validated(
        {"engines": {"instances": 1}, "autoscaling": {"engine": {"max_replicas": 3, **autoscaling}}}
    )
    return cfg.autoscaling["engine"]


def serve_policy(policy: str, interval_s: float = 5.0) -> tuple[Any, Any]:
    """The pool's policy as Serve's controller runs it: the config's ``AutoscalingPolicy``
    deserialized and instantiated by Serve's own code, wrapped by Serve's default params."""
    s = spec(policy=policy, interval_s=interval_s)
    kw = policy_kwargs("app", "engine", s, "cpu-tiny-llama", {})
    config = serve_autoscaling_config(s, 1, kw)
    instance = _resolve_policy_callable(config.policy)
    assert isinstance(instance, PoolPolicy)
    instance.record = False  # no Ray here: the decision log is exercised in the integration tier
    return _apply_autoscaling_config(instance), config


def test_policy_decides_once_per_interval_under_serves_wrapper() -> None:
    policy, config = serve_policy(
        "ray_default@target_ongoing_requests=2+look_back_s=1+upscale_delay_s=0+downscale_delay_s=0",
        interval_s=5.0,
    )
    assert (config.upscale_delay_s, config.downscale_delay_s) == (0.0, 0.0)
    busy = raw({0: {"waiting": 6, "running": 4, "arrivals": 20}})
    target, _ = policy(context(busy, now=1000.0, target=1, running=1, config=config))
    assert target == 3  # 10 ongoing over target 2: 5, clamped to the maximum
    # within the interval Serve's 0.1 s ticks change nothing, even with the load gone
    idle = raw({0: {"waiting": 0, "running": 0, "arrivals": 20}})
    for now in (1000.1, 1002.0, 1004.9):
        assert policy(context(idle, now=now, target=3, running=1, config=config))[0] == 3
    target, _ = policy(context(idle, now=1005.0, target=3, running=3, config=config))
    assert target == 1


def test_kvroute_policy_runs_on_replica_reports() -> None:
    policy, config = serve_policy("kvroute", interval_s=5.0)
    reports = {0: {"waiting": 0, "running": 1, "arrivals": 0, "prompt_tokens": 0}}
    target, _ = policy(context(raw(reports), now=10.0, target=1, running=1, config=config))
    assert 1 <= target <= 3


def test_reason_kinds() -> None:
    assert reason_kind("ray_default: ongoing 9.0 ...: up after 0 s (clamped to [1, 3])") == (
        "clamped"
    )
    assert reason_kind("kvroute: forecast ...: wants 1, holding for 60 s") == "delay"
    assert reason_kind("ray_default: ...: wants 3, waiting the upscale delay") == "delay"
    assert reason_kind("kvroute: no traffic seen yet") == "idle"
    assert reason_kind("kvroute: forecast 3.00/s ..., backlog +1.2") == "backlog"
    assert reason_kind("throughput: rate 2.00/s over 1.00/s per replica") == "model"


def test_decisions_in_metrics() -> None:
    log = DecisionLog()
    for way, target in (("up", 3), ("hold", 3), ("down", 1)):
        log.record(
            {
                "pool": "engine",
                "target": target,
                "replicas": 2,
                "ready": 2,
                "direction": way,
                "kind": "model",
                "reason": f"why {way}",
                "ts": 5.0,
            }
        )
    m = RouterMetrics("m", "r")
    m.autoscaled(log.snapshot())
    text = m.render().decode()
    assert 'kvroute_autoscale_target_replicas{model_name="m",pool="engine",router="r"} 1.0' in text
    for way in ("up", "hold", "down"):
        assert f'direction="{way}",model_name="m",pool="engine",reason="model"' in text
    assert 'reason="why down"' in text and 'reason="why up"' not in text


@pytest.mark.parametrize(
    ("block", "error"),
    [
        ({"max_replicas": 3, "min_replicas": 4}, "autoscaling.engine: max_replicas: must be >="),
        ({"max_replicas": 3, "policy": "nope"}, "autoscaling.engine: policy: unknown policy"),
        ({"max_replicas": 3, "policy": "kvroute@bogus=1"}, "unknown option 'bogus'"),
        ({}, "autoscaling.engine.max_replicas: Field required"),
        ({"max_replicas": 3, "interval_s": 0}, "autoscaling.engine.interval_s:"),
        ({"max_replicas": 3, "interval": 1}, "autoscaling.engine.interval: Extra inputs"),
        (
            {"max_replicas": 3, "interval_s": 1, "metrics_interval_s": 2},
            "autoscaling.engine: interval_s: must be >= metrics_interval_s",
        ),
        (
            {"max_replicas": 3, "slo_ttft_ms": 0.001},
            "autoscaling.engine.slo_ttft_ms: no engine can meet it: the floor of profile",
        ),
        (
            {"max_replicas": 3, "slo_tpot_ms": 0.001},
            "autoscaling.engine.slo_tpot_ms: no engine can meet it",
        ),
    ],
)
def test_config_errors_name_the_field(block: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error.replace("[", r"\[")):
        ServeConfig.validated({"autoscaling": {"engine": block}})


def test_config_names_unknown_pool_and_starts_within_bounds() -> None:
    with pytest.raises(ValueError, match=r"autoscaling\.decode: no pool named 'decode'"):
        ServeConfig.validated({"autoscaling": {"decode": {"max_replicas": 2}}})
    cfg = ServeConfig.validated(
        {"engines": {"instances": 5}, "autoscaling": {"engine": {"max_replicas": 3}}}
    )
    assert cfg.instances == 3
