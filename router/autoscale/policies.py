"""The autoscaling policies (``create_policy`` names them; ``router.autoscale`` describes each)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from router.autoscale.forecast import Forecaster, SeasonalForecaster
from router.autoscale.model import (
    DEFAULT_COLD_START_S,
    Observation,
    Policy,
    Slo,
    WhatIf,
    replica_capacity,
)
from router.placement import parse_spec


@dataclass
class StaticPolicy:
    n: int | None = None
    name: str = "static"

    def desired(self, obs: Observation, lo: int, hi: int) -> tuple[float, str]:
        n = hi if self.n is None else self.n
        return n, f"static {n}"


@dataclass
class RayDefaultPolicy:
    """Ray Serve's default autoscaling policy (see the module docstring)."""

    target_ongoing_requests: float = 2.0
    look_back_s: float = 30.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    upscaling_factor: float = 1.0
    downscaling_factor: float = 1.0
    name: str = "ray_default"
    _samples: deque[tuple[float, int]] = field(default_factory=deque, repr=False)
    _direction: int = 0
    _since: float | None = None

    def desired(self, obs: Observation, lo: int, hi: int) -> tuple[float, str]:
        now = obs.now
        self._samples.append((now, obs.ongoing))
        while self._samples and self._samples[0][0] < now - self.look_back_s:
            self._samples.popleft()
        ongoing = sum(v for _, v in self._samples) / len(self._samples)
        cur = obs.replicas
        running = obs.ready
        if running == 0:
            return cur, "no running replica"
        desired = running * ongoing / (running * self.target_ongoing_requests)
        # _apply_scaling_factors: on the running replicas
        delta = desired - running
        factor = self.upscaling_factor if delta > 0 else self.downscaling_factor
        scaled = math.ceil(running + factor * delta)
        if math.ceil(desired) < running and scaled == running:
            scaled -= 1
        # _apply_delay_logic: against the current target
        why = (
            f"ongoing {ongoing:.1f} over {running} running, target {self.target_ongoing_requests:g}"
        )
        if scaled > cur:
            if self._direction < 0 or self._since is None:
                self._direction, self._since = 1, now
            if now - self._since + 1e-6 >= self.upscale_delay_s:
                self._direction, self._since = 0, None
                return scaled, f"{why}: up after {self.upscale_delay_s:g} s"
            return cur, f"{why}: wants {scaled}, waiting the upscale delay"
        if scaled < cur:
            if self._direction > 0 or self._since is None:
                self._direction, self._since = -1, now
            if now - self._since + 1e-6 >= self.downscale_delay_s:
                self._direction, self._since = 0, None
                return max(1, scaled), f"{why}: down after {self.downscale_delay_s:g} s"
            return cur, f"{why}: wants {scaled}, waiting the downscale delay"
        self._direction, self._since = 0, None
        return cur, why


@dataclass
class ThroughputPolicy:
    """Dynamo-planner-style throughput scaling (see the module docstring)."""

    profile: Any
    slo: Slo
    headroom: float = 1.1
    points: int = 3
    name: str = "throughput"
    _forecast: Forecaster = field(default_factory=Forecaster, repr=False)
    _mix: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        self._forecast = Forecaster(self.points)

    def desired(self, obs: Observation, lo: int, hi: int) -> tuple[float, str]:
        self._forecast.add(obs.now, obs.rate)
        if obs.arrivals:
            self._mix = (obs.prompt_tokens / obs.arrivals, obs.output_tokens / obs.arrivals)
        p, o = self._mix
        if not p and not o:
            return obs.replicas, "no traffic seen yet"
        rate = self._forecast.predict(obs.window_s)
        cap = replica_capacity(self.profile, p, p, o, self.slo.tpot_s)
        if cap <= 0:
            return hi, "TPOT SLO below the profile's step time"
        n = rate * self.headroom / cap
        return n, f"rate {rate:.2f}/s over {cap:.2f}/s per replica (ISL {p:.0f}, OSL {o:.0f})"


@dataclass
class _SloFeedback:
    """What kvroute's policies share: the profile and SLO they size for, the cold start they
    look ahead over, and what they learn from each observation (``_learn``)."""

    profile: Any
    slo: Slo
    cold_start_s: float = DEFAULT_COLD_START_S
    # a scale-down sooner than ``cold_start_s`` after the scale-up it reverses is held
    # (``Autoscaler``)
    hold_reversals: bool = True
    points: int = 4
    gain_up: float = 1.1
    gain_decay: float = 0.95
    max_gain: float = 2.0
    _mix: tuple[float, float, float] = (0.0, 0.0, 0.0)
    _gain: float = 1.0

    def _learn(self, obs: Observation) -> float | None:
        """Learn from ``obs``: the token mix per request (prompt, cached, output) of its
        arrivals, kept from the last window that had any, and the SLO gain (x ``gain_up``
        while measured attainment is under the target, at most ``max_gain``; decaying back by
        ``gain_decay`` to 1 otherwise). Returns the measured attainment (None: nothing
        measured)."""
        if obs.arrivals:
            a = obs.arrivals
            self._mix = (obs.prompt_tokens / a, obs.cached_tokens / a, obs.output_tokens / a)
        met = self.slo.met(obs.ttfts, obs.tpots)
        if met is not None and met < self.slo.attainment:
            self._gain = min(self.max_gain, self._gain * self.gain_up)
        else:
            self._gain = max(1.0, self._gain * self.gain_decay)
        return met


@dataclass
class KvroutePolicy(_SloFeedback):
    """kvroute's policy: profile capacity with KV hits, cold-start-ahead forecast, backlog and
    SLO feedback (see the module docstring)."""

    headroom: float = 1.05
    down_delay_s: float = 60.0
    down_step: float = 0.25
    gain_up: float = 1.25
    gain_decay: float = 0.97
    max_gain: float = 4.0
    name: str = "kvroute"
    _forecast: Forecaster = field(default_factory=Forecaster, repr=False)
    _low_since: float | None = None

    def __post_init__(self) -> None:
        self._forecast = Forecaster(self.points)

    def desired(self, obs: Observation, lo: int, hi: int) -> tuple[float, str]:
        self._forecast.add(obs.now, obs.rate)
        met = self._learn(obs)
        p, c, o = self._mix
        if not p and not o:
            return obs.replicas, "no traffic seen yet"
        rate = self._forecast.predict(self.cold_start_s + obs.window_s)
        cap = replica_capacity(self.profile, p, max(p - c, 1.0), o, self.slo.tpot_s)
        if cap <= 0:
            return hi, "TPOT SLO below the profile's step time"
        # the backlog: queued prompts beyond what the ready engines start within the TTFT SLO
        waiting = sum(e.waiting for e in obs.engines)
        backlog = max(0.0, waiting - cap * self.slo.ttft_s * max(obs.ready, 1)) / max(
            cap * max(self.cold_start_s, self.slo.ttft_s), 1e-9
        )
        n = rate * self.headroom * self._gain / cap + backlog
        why = (
            f"forecast {rate:.2f}/s at +{self.cold_start_s + obs.window_s:g} s over "
            f"{cap:.2f}/s per replica (ISL {p:.0f}, hit {c / p if p else 0:.2f}, OSL {o:.0f})"
            f", gain {self._gain:.2f}"
            + (f", attainment {met:.3f}" if met is not None else "")
            + (f", backlog +{backlog:.1f}" if backlog else "")
        )
        want = math.ceil(n - 1e-9)
        cur = obs.replicas
        if want >= cur:
            self._low_since = None
            return want, why
        if self._low_since is None:
            self._low_since = obs.now
        if obs.now - self._low_since + 1e-6 < self.down_delay_s:
            return cur, f"{why}: wants {want}, holding for {self.down_delay_s:g} s"
        step = max(1, math.floor(cur * self.down_step))
        return max(want, cur - step), f"{why}: down"


@dataclass
class PredictivePolicy(_SloFeedback):
    """kvroute's model-predictive policy (``kvroute``): every decision, forecast the highest
    arrival rate until a replica removed now could be back (``cold_start_s`` plus one
    interval: ``SeasonalForecaster``), and search the smallest pool whose simulation
    (``Observation.what_if``: the recent requests re-timed at that rate on the production
    router core, from the current queue, for ``horizon_s``) keeps ``sim_goal`` of the requests
    that any pool could serve in time within the SLO (the issue's target, 99% or a point
    under the workload's ceiling, is about that share of the attainable requests). Holding
    capacity through a lull shorter than a scale cycle follows from the forecast window; a
    burst one cycle back at this time of the cycle (``period_s``) is provisioned ahead.

    The search starts at the rate over the per-replica capacity the last search found
    (first: ``replica_capacity`` with the router's cache hits) and moves by bisection, at
    most ``max_sims`` simulations a decision; the count found times ``headroom`` (the
    simulation's engines run at the profile's speed, real ones spread around it) is the
    target. SLO feedback: while measured attainment is under
    the target, a gain (x ``gain_up`` per decision, at most ``max_gain``) multiplies the
    result; it decays back (x ``gain_decay``) while the target is met. With
    ``traffic_headroom`` (off: 0) the margin is on traffic instead: the simulation is asked
    about that many times the forecast rate and the count it finds is not multiplied, so a
    small pool is not rounded up a whole engine (cheaper, see ``docs/autoscaling.md``: at 1.2
    it cost 22-26% fewer GPU-hours on to-b and azure-conv but 0.2 point of the conversation
    day's attainment, so it is not the default). With ``cycle_caps_trend`` (off) a rise the
    cycle has seen is forecast at the cycle's rate instead of extrapolated (``SeasonalForecaster``;
    on to-b it cost 6% fewer GPU-hours, on the conversation day 6% more and 0.3 point of
    attainment, so it is not the default). With ``trend_within_span`` (off) the trend is carried
    no further ahead than the windows it was fitted on span (``Forecaster``): on to-b, mix and
    azure-conv it cost 6-11% fewer GPU-hours at equal attainment, on the conversation day
    3-12% more, so it is not the default either. Until the forecast has
    ``points`` windows behind it, the pool is not shrunk (``_held``). Without a what-if the
    policy sizes with the capacity model alone (the reactive ``kvroute_reactive``'s model)."""

    period_s: float = 0.0
    periods: int = 2
    horizon_s: float = 60.0
    sim_goal: float = 0.99
    max_sims: int = 4
    headroom: float = 1.2
    traffic_headroom: float = 0.0
    cycle_caps_trend: bool = False
    trend_within_span: bool = False
    name: str = "kvroute"
    _forecast: SeasonalForecaster = field(default_factory=SeasonalForecaster, repr=False)
    _cap: float = 0.0  # requests/s per replica the last search found

    def __post_init__(self) -> None:
        self._forecast = SeasonalForecaster(
            self.period_s,
            self.points,
            self.periods,
            self.cycle_caps_trend,
            self.trend_within_span,
        )

    def desired(self, obs: Observation, lo: int, hi: int) -> tuple[float, str]:
        self._forecast.add(obs.now, obs.window_s, obs.rate)
        met = self._learn(obs)
        p, c, o = self._mix
        if not p and not o:
            return obs.replicas, "no traffic seen yet"
        ahead = self.cold_start_s + obs.window_s
        rate, source = self._forecast.peak(obs.now, ahead)
        fb = f", gain {self._gain:.2f}" + (f", attainment {met:.3f}" if met is not None else "")
        if rate <= 0:
            return lo, f"no arrivals forecast within {ahead:g} s{fb}"
        model = replica_capacity(self.profile, p, max(p - c, 1.0), o, self.slo.tpot_s)
        what_if = obs.what_if
        if what_if is None:
            if model <= 0:
                return hi, "TPOT SLO below the profile's step time"
            n, held = self._held(rate * self.headroom * self._gain / model, obs)
            why = f"{source} forecast {rate:.2f}/s within {ahead:g} s, model {model:.2f}/s"
            return n, why + held
        cap = self._cap or model or 1.0
        # the margin on traffic (``traffic_headroom``) replaces the one on the count
        planned = rate * (self.traffic_headroom or 1.0)
        need, sims = self._search(what_if, planned, cap, lo, hi)
        self._cap = planned / need
        n = need * (1.0 if self.traffic_headroom else self.headroom) * self._gain
        at = f" at {planned:.2f}/s" if self.traffic_headroom else ""
        why = (
            f"{source} forecast {rate:.2f}/s within {ahead:g} s: {need} replicas meet "
            f"{self.sim_goal:.3f}{at} in simulation ({sims} runs){fb}"
        )
        n, held = self._held(n, obs)
        return n, why + held

    def _held(self, n: float, obs: Observation) -> tuple[float, str]:
        """``n``, but never under the pool while the forecast has fewer than ``points``
        windows behind it: a rate from one or two windows says little (the Azure conv trace
        ran at 8.9 req/s in its first 10 s and 40-80 after; without the count's headroom the
        pool went on the first window, a cold start short for a minute). With the reason's
        note when it holds."""
        seen = self._forecast.windows
        if seen < self.points and n < obs.replicas:
            note = f"; held at {obs.replicas} ({seen} of {self.points} windows)"
            return float(obs.replicas), note
        return n, ""

    def _search(
        self, what_if: WhatIf, rate: float, cap: float, lo: int, hi: int
    ) -> tuple[int, int]:
        """The smallest count in [lo, hi] whose simulation reaches the goal, and the runs it
        took: from the guess, down by doubling steps or up by doubling the count until the
        goal is bracketed, then bisection; the best count known to pass when ``max_sims``
        runs are spent (hi when none passed)."""
        goal = min(1.0, self.sim_goal)
        seen: dict[int, bool] = {}

        def ok(n: int) -> bool:
            if n not in seen:
                seen[n] = what_if(n, rate, self.horizon_s, self.slo, goal) >= goal
            return seen[n]

        guess = min(hi, max(lo, math.ceil(rate / cap - 1e-9)))
        # bracket: ``good`` meets the target, ``bad`` does not (lo - 1: nothing below lo)
        if ok(guess):
            good, bad, step = guess, lo - 1, 1
            while good > lo and len(seen) < self.max_sims:
                probe = max(lo, good - step)
                if ok(probe):
                    good, step = probe, step * 2
                else:
                    bad = probe
                    break
        else:
            bad, good = guess, hi
            while bad < hi and len(seen) < self.max_sims:
                probe = min(hi, 2 * bad)
                if ok(probe):
                    good = probe
                    break
                bad = probe
            else:  # out of runs (or at the ceiling) without a pass: the ceiling
                return hi, len(seen)
        while good - bad > 1 and len(seen) < self.max_sims:
            mid = (good + bad) // 2
            if ok(mid):
                good = mid
            else:
                bad = mid
        return good, len(seen)


@dataclass
class SchedulePolicy:
    """A replica schedule fixed in advance (``schedule``: ``(from_s, n)`` steps, sorted): the
    hindsight oracle's. At ``now`` the target is the largest count the schedule asks for
    until ``lead_s`` later (an engine must be decided a cold start before it serves), so a
    scheduled rise is paid from its decision, as any policy's is."""

    schedule: Sequence[tuple[float, int]] = ()
    lead_s: float = 0.0
    name: str = "schedule"

    def at(self, t: float) -> int:
        n = self.schedule[0][1] if self.schedule else 1
        for at, k in self.schedule:
            if at > t:
                break
            n = k
        return n

    def desired(self, obs: Observation, lo: int, hi: int) -> tuple[float, str]:
        end = obs.now + self.lead_s
        n = max([self.at(obs.now)] + [k for at, k in self.schedule if obs.now < at <= end])
        return n, f"scheduled {n} (until +{self.lead_s:g} s)"


POLICIES = ("static", "ray_default", "throughput", "kvroute", "kvroute_reactive")


def create_policy(spec: str, *, profile: Any, slo: Slo, cold_start_s: float) -> Policy:
    """The policy ``spec`` names; raises ``ValueError`` naming the bad name or option."""
    name, options = parse_spec(spec, "--autoscale")
    cls: Any
    kwargs: dict[str, Any]
    if name == "static":
        cls, kwargs = StaticPolicy, {}
    elif name == "ray_default":
        cls, kwargs = RayDefaultPolicy, {}
    elif name == "throughput":
        cls, kwargs = ThroughputPolicy, {"profile": profile, "slo": slo}
    elif name == "kvroute":
        cls = PredictivePolicy
        kwargs = {"profile": profile, "slo": slo, "cold_start_s": cold_start_s}
    elif name == "kvroute_reactive":
        cls, kwargs = KvroutePolicy, {"profile": profile, "slo": slo, "cold_start_s": cold_start_s}
    else:
        raise ValueError(f"--autoscale: unknown policy {name!r}; valid: {', '.join(POLICIES)}")
    fields = {f for f in cls.__dataclass_fields__ if not f.startswith("_") and f != "name"}
    bad = sorted(set(options) - (fields - set(kwargs)))
    if bad:
        valid = ", ".join(sorted(fields - set(kwargs) - {"profile", "slo"}))
        raise ValueError(f"--autoscale {spec}: unknown option {bad[0]!r}; valid: {valid}")
    for key, value in options.items():
        if isinstance(value, str) or (isinstance(value, (int, float)) and value < 0):
            raise ValueError(f"--autoscale {spec}: {key} must be a number >= 0, got {value!r}")
    policy: Policy = cls(**kwargs, **options)
    return policy
