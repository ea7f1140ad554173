"""The autoscaling core (``router.autoscale``): Ray Serve's default rule as Ray computes it,
the capacity model, the forecaster, the kvroute policy's feedback and hysteresis, and
``kvroute simulate --autoscale``."""

from __future__ import annotations

import json

import pytest

from deploy.cli import main as kvroute
from engines.profile import LatencyProfile
from router.autoscale import (
    Autoscaler,
    EngineLoad,
    Forecaster,
    KvroutePolicy,
    Observation,
    PredictivePolicy,
    RayDefaultPolicy,
    SchedulePolicy,
    SeasonalForecaster,
    Slo,
    create_policy,
    replica_capacity,
)
from simulation.measures import flapping


@pytest.fixture(scope="module")
def profile() -> LatencyProfile:
    return LatencyProfile.load("h100-llama3.1-8b")


def obs(now, replicas, ready=None, ongoing=0, **kw):
    ready = replicas if ready is None else ready
    engines = tuple(EngineLoad(f"e{i}", running=ongoing // max(ready, 1)) for i in range(ready))
    extra = ongoing - sum(e.running for e in engines)
    if engines and extra:
        engines = (EngineLoad("e0", running=engines[0].running + extra), *engines[1:])
    return Observation(
        now=now, replicas=replicas, ready=ready, window_s=10.0, engines=engines, **kw
    )


def test_ray_default_matches_rays_own_rule():
    """The same sequence of (time, ongoing requests) through Ray Serve's default policy
    functions and through ours gives the same targets (both averaging over the look-back)."""
    from ray.serve import autoscaling_policy as rp
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    cfg = AutoscalingConfig(min_replicas=1, max_replicas=100, target_ongoing_requests=4)
    ours = RayDefaultPolicy(target_ongoing_requests=4)
    state: dict = {}
    target = running = 4
    window: list[tuple[float, int]] = []
    loads = [8, 40, 60, 60, 60, 60, 30, 4, 4] + [4] * 70
    for k, ongoing in enumerate(loads):
        now = 10.0 * k
        window = [(t, v) for t, v in [*window, (now, ongoing)] if t >= now - cfg.look_back_period_s]
        avg = sum(v for _, v in window) / len(window)
        ctx = AutoscalingContext(
            deployment_id=None, deployment_name="d", app_name=None,
            current_num_replicas=running, target_num_replicas=target, running_replicas=[],
            total_num_requests=avg, total_queued_requests=None, aggregated_metrics=None,
            raw_metrics=None, capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=100, policy_state={}, last_scale_up_time=None,
            last_scale_down_time=None, current_time=now, config=cfg,
        )  # fmt: skip
        desired, _ = rp._core_replica_queue_length_policy(ctx)
        scaled = rp._apply_scaling_factors(desired, running, cfg)
        ray_target, state = rp._apply_delay_logic(max(0, scaled), target, cfg, state, _now=now)
        mine, _ = ours.desired(obs(now, target, running, ongoing), 1, 100)
        assert mine == ray_target, (k, now, avg)
        target = ray_target
        running = target  # replicas start at once here
    assert target == 1  # down after 600 s of low load, in one step


def test_capacity_model_follows_hits_and_the_tpot_slo(profile):
    base = replica_capacity(profile, 4000, 4000, 300, 0.05)
    assert base > 0
    assert replica_capacity(profile, 4000, 1000, 300, 0.05) > 1.5 * base  # hits spare prefill
    assert replica_capacity(profile, 4000, 4000, 300, 0.02) < base  # tighter TPOT
    assert replica_capacity(profile, 4000, 4000, 300, 0.005) == 0.0  # below one step
    # at the capacity, the modelled step time is within the TPOT margin
    lam = base / 1e3
    w = 4000 * (profile.prefill_token_ms + profile.prefill_attn_ms * 2000) + 300 * (
        profile.decode_seq_ms + profile.decode_ctx_ms * 4150
    )
    assert profile.base_ms / (1 - lam * w) <= 0.8 * 50 + 1e-6


def test_capacity_model_prices_each_chunk_as_its_own_pass():
    """Dynamo's mocker profile: a prompt's uncached tokens in full 8,192-token passes and one of
    the rest, each ``a T^2 + b T + c`` (``prefill_sq_ms``), as the sim engine prices them."""
    mocker = LatencyProfile.load("dynamo-mocker-h100")
    u, out = 20_000, 10
    passes = 2 * mocker.pass_ms(8192) + mocker.pass_ms(3616)  # the fixed and squared parts
    w = passes + u * mocker.prefill_token_ms + out * mocker.decode_ctx_ms * (u + out / 2)
    # no TPOT bound and far from the batch limits: the utilisation bound sets the rate
    assert replica_capacity(mocker, u, u, out, None) == pytest.approx(0.85 / w * 1e3)
    assert passes == pytest.approx(3 * 16.50142 + 4.209989e-07 * (2 * 8192**2 + 3616**2))


def test_forecaster_extrapolates_rises_but_not_falls():
    f = Forecaster(4)
    for k, r in enumerate([1.0, 2.0, 3.0, 4.0]):
        f.add(10.0 * k, r)
    assert f.predict(20.0) == pytest.approx(6.0)
    g = Forecaster(4)
    for k, r in enumerate([4.0, 3.0, 2.0, 1.0]):
        g.add(10.0 * k, r)
    assert g.predict(50.0) == pytest.approx(2.5)  # the window's mean, not a negative rate


def test_a_trend_within_its_span_extrapolates_no_further_than_its_windows():
    """A step from 10 to 40 requests/s in the last window: the fit's slope (0.9/s per s) is
    carried 55 s ahead by default, only the 30 s the windows span with ``within_span``."""
    plain, spanned = Forecaster(4), Forecaster(4, within_span=True)
    for f in (plain, spanned):
        for k, r in enumerate([10.0, 10.0, 10.0, 40.0]):
            f.add(10.0 * k, r)
    assert plain.predict(55.0) == pytest.approx(40.0 + 0.9 * 55)
    assert spanned.predict(55.0) == pytest.approx(40.0 + 0.9 * 30)
    assert spanned.predict(20.0) == pytest.approx(40.0 + 0.9 * 20)  # within the span: the same


def test_kvroute_policy_feedback_and_hysteresis(profile):
    slo = Slo(2.0, 0.05, 0.99)
    p = KvroutePolicy(profile, slo, cold_start_s=30.0, down_delay_s=60.0)
    mix = {"arrivals": 500, "prompt_tokens": 500 * 2000, "output_tokens": 500 * 200}
    n0, why = p.desired(obs(0.0, 4, cached_tokens=0, ttfts=(0.5,) * 10, **mix), 1, 64)
    assert "forecast 50.00/s" in why and "gain 1.00" in why
    assert n0 == 6  # 50/s x 1.05 over ~9.3/s per replica
    # missed SLOs raise the gain, and the target with it
    n1, why = p.desired(obs(10.0, n0, cached_tokens=0, ttfts=(5.0,) * 10, **mix), 1, 64)
    assert n1 > n0 and "gain 1.25" in why
    # KV hits: the same traffic with 3/4 of its prompt cached needs fewer replicas
    q = KvroutePolicy(profile, slo, cold_start_s=30.0)
    hit, _ = q.desired(obs(0.0, 4, cached_tokens=500 * 1500, **mix), 1, 64)
    assert hit < n0
    # a lower want is held for down_delay_s, then stepped down by at most a quarter
    low = {"arrivals": 1, "prompt_tokens": 2000, "output_tokens": 200}
    r = KvroutePolicy(profile, slo, cold_start_s=30.0, down_delay_s=60.0, points=2)
    assert r.desired(obs(0.0, 16, **low), 1, 64)[0] == 16
    assert "holding" in r.desired(obs(30.0, 16, **low), 1, 64)[1]
    n, why = r.desired(obs(60.0, 16, **low), 1, 64)
    assert n == 12 and why.endswith("down")


def test_autoscaler_clamps_and_names_its_policy(profile):
    slo = Slo(2.0, 0.05)
    a = Autoscaler(create_policy("static@n=100", profile=profile, slo=slo, cold_start_s=45), 2, 8)
    d = a.decide(obs(0.0, 4))
    assert d.target == 8 and d.reason.startswith("static: static 100") and "clamped" in d.reason
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        create_policy("nope", profile=profile, slo=slo, cold_start_s=45)
    with pytest.raises(ValueError, match=r"unknown option 'target'.*target_ongoing_requests"):
        create_policy("ray_default@target=3", profile=profile, slo=slo, cold_start_s=45)
    with pytest.raises(ValueError, match="--max-instances"):
        Autoscaler(a.policy, 4, 2)


def test_cli_autoscale_reports_attainment_gpu_hours_and_decisions(capsys):
    rc = kvroute([
        "simulate", "--workload", "to-b", "--rate", "30", "--duration", "40", "--instances",
        "1", "--router", "kv_ttft", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--json",
        "--no-progress", "--autoscale", "static@n=3", "--max-instances", "4",
        "--cold-start-s", "10", "--autoscale-interval-s", "5",
    ])  # fmt: skip
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    meta = doc["meta"]["autoscale"]
    assert meta["policy"] == "static@n=3" and meta["cold_start_s"] == 10.0
    a = doc["routers"]["kv_ttft"]["autoscale"]
    assert [r[:2] for r in a["replicas"]] == [[0.0, 1], [5.0, 3]]
    assert 0 < a["attainment"] <= 1 and a["peak_instances"] == 3
    assert 0 < a["gpu_hours"] < 3 * 60 / 3600


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--autoscale", "kvroute"], "--autoscale needs --slo-ttft-ms"),
        (["--autoscale", "bogus", "--slo-ttft-ms", "100"], "unknown policy 'bogus'"),
        (["--autoscale", "kvroute", "--slo-ttft-ms", "100", "--cold-start-s", "-1"],
         "--cold-start-s must be"),
        (["--autoscale", "kvroute", "--slo-ttft-ms", "100", "--max-instances", "0"],
         "--max-instances must be"),
        (["--autoscale", "kvroute", "--slo-ttft-ms", "100", "--warm-prefixes", "-1"],
         "--warm-prefixes must be >= 0"),
        (["--autoscale", "kvroute", "--slo-ttft-ms", "0.01"],
         "--slo-ttft-ms: no engine can meet it: the floor of profile 'h100-llama3.1-8b'"),
        (["--autoscale", "kvroute", "--slo-ttft-ms", "100", "--slo-tpot-ms", "0.01"],
         "--slo-tpot-ms: no engine can meet it"),
        (["--autoscale", "kvroute", "--slo-ttft-ms", "100", "--autoscale-interval-s", "0.05"],
         "--autoscale-interval-s must be >= --load-interval-ms (100 ms)"),
    ],
)  # fmt: skip
def test_cli_autoscale_bad_input_names_the_flag(argv, message, capsys):
    rc = kvroute(["simulate", "--workload", "to-b", "--duration", "5", "--no-progress", *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


class Threshold:
    """A what-if whose pool meets the SLO exactly when it has ``rate / per`` replicas: the
    policy's search on a known answer."""

    def __init__(self, per: float) -> None:
        self.per, self.calls, self.asked = per, 0, []

    def __call__(self, replicas, rate, horizon_s, slo, goal=None):
        self.calls += 1
        self.asked.append((replicas, rate))
        return 1.0 if replicas * self.per >= rate else 0.5


def test_seasonal_forecaster_recalls_the_same_time_of_the_last_cycle():
    f = SeasonalForecaster(period_s=600.0, points=4)
    plain = SeasonalForecaster(period_s=0.0, points=4)
    for k in range(1, 100):  # one cycle and a bit: a lull, a burst from 400 s to 600 s
        now = 10.0 * k
        rate = 2.0 if (now - 10.0) % 600 < 400 else 8.0
        f.add(now, 10.0, rate)
        plain.add(now, 10.0, rate)
    # at 990 s the burst of 400-600 s is 600 s back from 1000-1045 s: within the window
    rate, source = f.peak(990.0, 55.0)
    assert (rate, source) == (8.0, "cycle")
    assert plain.peak(990.0, 55.0) == (2.0, "trend")  # no cycle: only the lull's trend
    # a lull far from the next burst: the cycle says lull too
    assert f.peak(700.0, 55.0)[0] == 2.0


def test_with_cycle_caps_trend_a_rise_the_cycle_has_seen_is_not_extrapolated():
    """Second cycle, the burst's first windows: the trend over a step from 2 to 8 forecasts
    far above 8 a cold start ahead (the default takes it); with ``cycle_caps_trend`` the cycle
    saw 8 then, so 8 it is. A rise above what the cycle saw is the trend's again."""
    f = SeasonalForecaster(period_s=600.0, points=4, cycle_caps_trend=True)
    default = SeasonalForecaster(period_s=600.0, points=4)
    trend_only = SeasonalForecaster(period_s=0.0, points=4)
    for k in range(1, 103):  # a lull, a burst from 400 s to 600 s, the next lull, the burst
        now = 10.0 * k
        rate = 2.0 if (now - 10.0) % 600 < 400 else 8.0
        for g in (f, default, trend_only):
            g.add(now, 10.0, rate)
    assert f.trend.latest() == 8.0
    assert trend_only.peak(1020.0, 55.0)[0] > 20.0  # the step extrapolated
    assert default.peak(1020.0, 55.0) == trend_only.peak(1020.0, 55.0)
    assert f.peak(1020.0, 55.0) == (8.0, "cycle")
    for k, rate in ((103, 16.0), (104, 24.0)):  # beyond the cycle: the trend's forecast
        f.add(10.0 * k, 10.0, rate)
    rate, source = f.peak(1040.0, 55.0)
    assert source == "trend" and rate > 24.0


def test_predictive_policy_finds_the_smallest_pool_its_simulation_passes(profile):
    slo = Slo(2.0, 0.05, 0.99)
    p = create_policy("kvroute@headroom=1+max_sims=8", profile=profile, slo=slo, cold_start_s=45)
    assert isinstance(p, PredictivePolicy)
    mix = {"arrivals": 200, "prompt_tokens": 200 * 2000, "output_tokens": 200 * 200}
    w = Threshold(per=1.0)
    n, why = p.desired(obs(0.0, 4, what_if=w, **mix), 1, 64)
    assert n == 20 and "20 replicas meet" in why and f"({w.calls} runs)" in why
    assert w.calls <= p.max_sims
    assert all(r == 20.0 for _, r in w.asked)  # the forecast rate, the window's
    # the next decision starts from the capacity it found: one run above, one below at most
    w2 = Threshold(per=1.0)
    n2, _ = p.desired(obs(10.0, 20, what_if=w2, **mix), 1, 64)
    assert n2 == 20 and w2.calls == 2
    # the default budget of runs: a pass bracketed, not bisected to the end
    d = create_policy("kvroute@headroom=1", profile=profile, slo=slo, cold_start_s=45)
    wd = Threshold(per=1.0)
    nd, _ = d.desired(obs(0.0, 4, what_if=wd, **mix), 1, 64)
    assert 20 <= nd <= 40 and wd.calls <= d.max_sims == 4
    # nothing passes up to the ceiling: the ceiling
    stuck = create_policy("kvroute", profile=profile, slo=slo, cold_start_s=45)
    n3, _ = stuck.desired(obs(0.0, 4, what_if=Threshold(per=0.0001), **mix), 1, 16)
    assert n3 >= 16
    # no what-if (a caller without a simulator): the capacity model sizes the pool
    q = create_policy("kvroute", profile=profile, slo=slo, cold_start_s=45)
    m, why = q.desired(obs(0.0, 4, **mix), 1, 64)
    assert m > 0 and "model" in why


def test_predictive_policy_can_plan_its_headroom_on_traffic(profile):
    """With ``traffic_headroom`` the simulation is asked about that many times the forecast
    rate and says how many engines that needs: two engines that carry 1.4x the traffic stay
    two, where the count's headroom (1.2) makes 2 engines' need 2.4, so 3."""
    slo = Slo(2.0, 0.05, 0.99)
    mix = {"arrivals": 100, "prompt_tokens": 100 * 2000, "output_tokens": 100 * 200}
    spec = "kvroute@traffic_headroom=1.4+max_sims=8"
    p = create_policy(spec, profile=profile, slo=slo, cold_start_s=45)
    w = Threshold(per=7.5)  # one engine carries 7.5/s: 10/s x 1.4 = 14/s fits on 2
    n, why = p.desired(obs(0.0, 2, what_if=w, **mix), 1, 64)
    assert n == 2 and {r for _, r in w.asked} == {14.0} and "at 14.00/s" in why
    d = create_policy("kvroute@max_sims=8", profile=profile, slo=slo, cold_start_s=45)
    assert d.desired(obs(0.0, 2, what_if=Threshold(per=7.5), **mix), 1, 64)[0] == 2.4
    q = create_policy(spec, profile=profile, slo=slo, cold_start_s=45)
    n, _ = q.desired(obs(0.0, 2, what_if=Threshold(per=4.0), **mix), 1, 64)
    assert n == 4  # 14/s on 4/s engines; 10/s needs 3, and 3 x 1.4 would have been 5


def test_predictive_policy_keeps_its_pool_until_the_forecast_has_its_windows(profile):
    """The first decisions (fewer than ``points`` windows seen) never shrink the pool: one
    quiet first window does not let go of engines a cold start away; then it follows."""
    slo = Slo(2.0, 0.05, 0.99)
    p = create_policy("kvroute@headroom=1", profile=profile, slo=slo, cold_start_s=45)
    mix = {"arrivals": 20, "prompt_tokens": 20 * 2000, "output_tokens": 20 * 200}
    w = Threshold(per=1.0)  # 2/s: 2 replicas
    out = [p.desired(obs(10.0 * k, 6, what_if=w, **mix), 1, 64) for k in range(1, 6)]
    assert [n for n, _ in out] == [6, 6, 6, 2, 2]  # points=4: the 4th window lets it go
    assert "held at 6 (1 of 4 windows)" in out[0][1] and "held" not in out[3][1]


def test_predictive_policy_holds_through_a_short_lull_from_its_forecast(profile):
    """A burst one cycle back that falls within cold start + an interval of now keeps the pool
    up through the lull before it; a lull longer than that lets it go: no special rule."""
    slo = Slo(2.0, 0.05, 0.99)
    p = create_policy("kvroute@period_s=300+headroom=1", profile=profile, slo=slo, cold_start_s=45)
    w = Threshold(per=1.0)
    targets = {}
    for k in range(1, 60):
        now = 10.0 * k
        busy = (now - 10.0) % 300 >= 200  # 100 s bursts every 300 s
        a = 300 if busy else 50
        o = obs(now, 10, what_if=w, arrivals=a, prompt_tokens=a * 2000, output_tokens=a * 200)
        targets[now], _ = p.desired(o, 1, 64)
    assert targets[560.0] == 30  # 2nd cycle's burst 510-610 s: up
    assert targets[420.0] < 15  # 2nd cycle's lull, the burst 90 s+ away: down
    assert targets[460.0] == 30  # the burst 50 s away (cold start 45 s + 10 s): held ahead


def test_schedule_policy_asks_a_cold_start_ahead():
    s = SchedulePolicy([(0.0, 2), (60.0, 10), (120.0, 3)], lead_s=45.0)
    assert s.desired(obs(0.0, 2), 1, 64)[0] == 2
    assert s.desired(obs(20.0, 2), 1, 64)[0] == 10  # 60 s is within 45 s of 20 s
    assert s.desired(obs(100.0, 10), 1, 64)[0] == 10
    assert s.desired(obs(130.0, 10), 1, 64)[0] == 3


def test_create_policy_keeps_the_reactive_policy_and_checks_options(profile):
    slo = Slo(2.0, 0.05)
    r = create_policy("kvroute_reactive", profile=profile, slo=slo, cold_start_s=45)
    assert isinstance(r, KvroutePolicy)
    with pytest.raises(ValueError, match=r"unknown option 'period'.*period_s"):
        create_policy("kvroute@period=5", profile=profile, slo=slo, cold_start_s=45)


class Scripted:
    """A policy that wants the next count of its script each decision, and holds its
    reversals for ``cold_start_s``."""

    name = "scripted"
    hold_reversals = True

    def __init__(self, wants: list[int], cold_start_s: float = 30.0) -> None:
        self.wants, self.cold_start_s = list(wants), cold_start_s

    def desired(self, obs: Observation, lo: int, hi: int) -> tuple[float, str]:
        return self.wants.pop(0), "scripted"


def test_a_scale_down_within_a_cold_start_of_its_scale_up_is_held():
    """The engines a scale-up started pay their cold start anyway: reversing it sooner is held
    at the current count, and goes through once the cold start is over."""
    scaler = Autoscaler(Scripted([3, 1, 1, 1, 4, 2]), 1, 5, 10.0)
    seen = []
    n = 1
    for now in (0.0, 10.0, 20.0, 30.0, 40.0, 80.0):
        d = scaler.decide(Observation(now=now, replicas=n, ready=n, window_s=10.0))
        seen.append(d.target)
        n = d.target
    assert seen == [3, 3, 3, 1, 4, 2]
    # a scale-down with no scale-up before it goes through at once
    quiet = Autoscaler(Scripted([1]), 1, 5)
    assert quiet.decide(Observation(now=5.0, replicas=3, ready=3, window_s=10.0)).target == 1
    free = Scripted([3, 1])
    free.hold_reversals = False  # a peer's policy runs as it is
    scaler = Autoscaler(free, 1, 5)
    assert [scaler.decide(Observation(t, n, n, 10.0)).target for t, n in ((0, 1), (10, 3))] == [
        3,
        1,
    ]


def test_flapping_counts_direction_changes_and_quick_reversals():
    targets = [(0, 2, "initial"), (100, 4, ""), (120, 2, ""), (500, 5, ""), (4000, 3, ""),
               (4100, 4, "")]  # fmt: skip
    out = flapping(targets, cold_start_s=45.0, duration_s=7200.0, period_s=3600.0)
    assert out == {
        "direction_changes": 4,  # down at 120, up at 500, down at 4000, up at 4100
        "per_hour": 2.0,
        "max_in_an_hour": 2,
        "quick_reversals": 1,  # the down 20 s after the up it reverses
        "per_cycle": 2.0,
    }
    assert flapping(targets[:1], 45.0, 600.0)["direction_changes"] == 0
