"""The autoscaling core: what the router sees, every ``interval_s``, turned into a target replica
count per pool, with the reason.

Pure and clock-free like ``router.placement``'s scorers: no thread, no Ray, no wall clock, no
I/O. A caller (the cluster simulator in virtual time; later the Serve deployment's autoscaling
policy) hands ``Autoscaler.decide`` an ``Observation`` stamped with its own ``now`` and gets a
``Decision`` back. Policies keep state between calls (a forecaster's history, a delay's start),
all of it driven by the ``now`` they are handed, so a replay is deterministic.

Policies (``create_policy``; each is ``NAME`` or ``NAME@key=value+key=value``):

- ``static``: a fixed count (``n``; default: the pool's maximum), provisioning at the peak.
- ``ray_default``: Ray Serve's default policy (``ray.serve.autoscaling_policy``,
  ``replica_queue_length_autoscaling_policy`` with ``_apply_default_params``): desired =
  running replicas x (ongoing requests averaged over ``look_back_s``) / (running replicas x
  ``target_ongoing_requests``), then ``upscaling_factor``/``downscaling_factor`` on the delta,
  and a change only once it has been wanted in the same direction for ``upscale_delay_s`` (up)
  or ``downscale_delay_s`` (down). Ray's defaults: target 2, look-back 30 s, delays 30 s and
  600 s, factors 1. Ray runs its loop every 0.1 s; here it runs every ``interval_s``, so a delay
  ends at the first decision at or after it.
- ``throughput``: NVIDIA Dynamo's planner, throughput mode: the next interval's arrival rate
  (predicted from recent windows) over one replica's capacity at the SLO, from the profile
  (``replica_capacity``, prompts priced uncached as a profiled interpolation prices them), with
  ``headroom``.
- ``kvroute_reactive``: a profile-based capacity model with SLO feedback (no candidate sizes
  are simulated; the first pass's ``kvroute``). The capacity model prices the prompts'
  uncached tokens as the router placed them (its cache-map hits: KV-aware), forecasts the
  rate one cold start ahead (a new engine takes ``cold_start_s`` to serve), adds the
  replicas that the queued backlog needs to drain within the TTFT SLO, and multiplies by a
  gain that SLO feedback learns (raised while measured TTFT/TPOT attainment is under
  target, decayed back while it is met). Scale-down waits ``down_delay_s`` of consistently
  lower targets and steps by at most ``down_step`` of the pool at a time.
- ``kvroute``: model-predictive (``PredictivePolicy``): a forecast of the peak rate until a
  replica removed now could be back (trend, and the same time of the last cycles when the
  cycle is known), and the smallest pool whose simulation of that traffic meets the target
  (``Observation.what_if``, which the caller provides; the capacity model without one).
- ``SchedulePolicy`` (not a ``create_policy`` name): a schedule fixed in advance, the
  hindsight oracle's (``benchmarks/autoscale_suite.py`` finds it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.placement import parse_spec

# seconds between two decisions (the simulator's default; Ray's own loop runs every 0.1 s)
DEFAULT_INTERVAL_S = 10.0

# Seconds from a scale-up decision to a new engine's first step: vLLM serving Llama-3.1-8B on
# one H100 from weights on local NVMe or in the page cache. The parts: a Serve replica's
# process and CUDA context (~5-10 s), 16 GB of weights at a few GB/s (~5-10 s), torch.compile
# with its cache warm (~5-15 s) and CUDA graph capture for the default batch sizes
# (~5-15 s), then the KV cache's allocation and profiling run (~2-5 s): ~30-60 s in all, as
# vLLM's startup logs show for 8B models. We take 45 s, the middle: the cost of a scale-up
# that a policy must see coming. (A node that must boot first, or weights from the network,
# take minutes more: set ``cold_start_s``.)
DEFAULT_COLD_START_S = 45.0


class WhatIf(Protocol):
    """A simulator of the pool the caller hands the policy (``Observation.what_if``): the
    fraction of requests (0..1) within ``slo`` that ``replicas`` serving engines would reach
    over the next ``horizon_s`` seconds if requests arrived at ``rate`` per second with the
    recent mix, starting from the current queue. The cluster simulator provides one
    (``loadgen.simulator.WhatIfSimulator``: the recent requests re-timed, replayed on the
    production router core); a production deployment can hand the same object, built from
    the ingress's recent requests. It keeps ``calls`` (simulations run) for the reason."""

    calls: int

    def __call__(self, replicas: int, rate: float, horizon_s: float, slo: Slo) -> float: ...


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One routable engine as the router sees it (its latest load sample plus the router's own
    assignments since)."""

    instance_id: str
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # 0..1
    pending_prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Observation:
    """What the router saw of one pool over the last ``window_s`` seconds before ``now``.

    ``replicas``: the pool's engines that count against its target (serving or starting, not
    leaving); ``ready``: those serving. Token sums are over the window's arrivals;
    ``cached_tokens``: the prompt tokens the router expected the chosen engines to hold.
    ``ttfts``/``tpots``: seconds, of the requests whose first token (TTFT) or finish (TPOT)
    the router saw in the window."""

    now: float
    replicas: int
    ready: int
    window_s: float
    arrivals: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    engines: tuple[EngineLoad, ...] = ()
    ttfts: tuple[float, ...] = ()
    tpots: tuple[float, ...] = ()
    pool: str = "default"
    # the caller's simulator of this pool (``WhatIf``); None where it has none (the
    # model-predictive policy then falls back to its capacity model)
    what_if: WhatIf | None = None

    @property
    def rate(self) -> float:
        return self.arrivals / self.window_s if self.window_s > 0 else 0.0

    @property
    def ongoing(self) -> int:
        return sum(e.waiting + e.running for e in self.engines)


@dataclass(frozen=True, slots=True)
class Decision:
    pool: str
    target: int
    reason: str


@dataclass(frozen=True, slots=True)
class Slo:
    """The service level the policies plan for: TTFT and TPOT bounds in seconds (TPOT None:
    none) and the fraction of requests that must meet both."""

    ttft_s: float
    tpot_s: float | None = None
    attainment: float = 0.99

    def met(self, ttfts: Sequence[float], tpots: Sequence[float]) -> float | None:
        """Fraction of the observed requests within the SLO (None: nothing observed)."""
        n = len(ttfts) + len(tpots)
        if not n:
            return None
        good = sum(t <= self.ttft_s for t in ttfts)
        if self.tpot_s is not None:
            good += sum(t <= self.tpot_s for t in tpots)
        else:
            good += len(tpots)
        return good / n


class ProfileLike(Protocol):
    """The latency profile fields the capacity model reads (``engines.sim.profile``)."""

    base_ms: float
    prefill_pass_ms: float
    decode_pass_ms: float
    prefill_token_ms: float
    prefill_attn_ms: float
    decode_seq_ms: float
    decode_ctx_ms: float
    kv_capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int


def replica_capacity(
    profile: ProfileLike,
    prompt_tokens: float,
    uncached_tokens: float,
    output_tokens: float,
    tpot_s: float | None,
    *,
    tpot_margin: float = 0.8,
    max_utilization: float = 0.85,
) -> float:
    """Requests per second one engine sustains with its mean step time (the TPOT of its
    decodes) within ``tpot_margin`` x ``tpot_s`` and its GPU busy at most ``max_utilization``
    of the time with work beyond the steps' fixed cost, within KV capacity and
    ``max_num_seqs``.

    The steady state of a colocated engine at rate ``lam``: each request spends ``W`` ms of
    GPU work beyond the steps' fixed cost ``base`` (``base_ms`` and ``decode_pass_ms``: a busy
    engine's steps decode; ``W``: its uncached prefill chunks, each with ``prefill_pass_ms``,
    plus ``O`` decode tokens at the mean context), and is in decode for ``O`` steps; with step
    time ``tau`` the step holds ``lam tau`` requests' work, so ``tau = base / (1 - lam W)``, and
    the decoding batch is ``lam O tau`` (Little). Closed form, microseconds per call."""
    o = max(output_tokens, 1.0)
    u = max(uncached_tokens, 0.0)
    ctx = prompt_tokens + o / 2
    prefill_ms = u * (profile.prefill_token_ms + profile.prefill_attn_ms * (prompt_tokens - u / 2))
    prefill_ms += profile.prefill_pass_ms * math.ceil(u / profile.max_num_batched_tokens)
    w_ms = prefill_ms + o * (profile.decode_seq_ms + profile.decode_ctx_ms * ctx)
    base_ms = profile.base_ms + profile.decode_pass_ms
    lam_util = max_utilization / w_ms  # per ms
    lam = lam_util
    tau_max = math.inf
    if tpot_s is not None:
        tau_max = tpot_margin * tpot_s * 1e3
        if tau_max <= base_ms:
            return 0.0
        lam = min(lam, (1 - base_ms / tau_max) / w_ms)
    tau = base_ms / max(1e-9, 1 - lam * w_ms)
    batch = lam * o * tau
    limit = min(profile.max_num_seqs, profile.kv_capacity_tokens / max(ctx, 1.0))
    if batch > limit:
        lam *= limit / batch
    return lam * 1e3


class Forecaster:
    """Arrival rates of the recent windows (one per decision), and the rate ``ahead_s`` after
    the latest: a linear trend over the last ``points`` windows, never below the latest rate
    while rising and never below the mean of the window while falling (a lull forecast ends
    in the next burst's cold start otherwise)."""

    def __init__(self, points: int = 4) -> None:
        self.history: deque[tuple[float, float]] = deque(maxlen=max(2, points))

    def add(self, now: float, rate: float) -> None:
        self.history.append((now, rate))

    def predict(self, ahead_s: float) -> float:
        h = self.history
        if not h:
            return 0.0
        last = h[-1][1]
        if len(h) < 2:
            return last
        n = len(h)
        mt = sum(t for t, _ in h) / n
        mr = sum(r for _, r in h) / n
        var = sum((t - mt) ** 2 for t, _ in h)
        slope = sum((t - mt) * (r - mr) for t, r in h) / var if var > 0 else 0.0
        ahead = last + slope * ahead_s
        return max(ahead, last) if slope > 0 else max(ahead, mr, 0.0)


class Policy(Protocol):
    """One autoscaling rule: the desired count (fractional allowed) and why."""

    name: str

    def desired(self, obs: Observation, lo: int, hi: int) -> tuple[float, str]: ...


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


class _Feedback(Protocol):
    """What kvroute's policies learn from each observation (``_feedback``)."""

    slo: Slo
    gain_up: float
    gain_decay: float
    max_gain: float
    _mix: tuple[float, float, float]
    _gain: float


def _feedback(policy: _Feedback, obs: Observation) -> float | None:
    """Learn from ``obs``: the token mix per request (prompt, cached, output) of its arrivals,
    kept from the last window that had any, and the SLO gain (x ``gain_up`` while measured
    attainment is under the target, at most ``max_gain``; decaying back by ``gain_decay`` to 1
    otherwise). Returns the measured attainment (None: nothing measured)."""
    if obs.arrivals:
        a = obs.arrivals
        policy._mix = (obs.prompt_tokens / a, obs.cached_tokens / a, obs.output_tokens / a)
    met = policy.slo.met(obs.ttfts, obs.tpots)
    if met is not None and met < policy.slo.attainment:
        policy._gain = min(policy.max_gain, policy._gain * policy.gain_up)
    else:
        policy._gain = max(1.0, policy._gain * policy.gain_decay)
    return met


@dataclass
class KvroutePolicy:
    """kvroute's policy: profile capacity with KV hits, cold-start-ahead forecast, backlog and
    SLO feedback (see the module docstring)."""

    profile: Any
    slo: Slo
    cold_start_s: float = DEFAULT_COLD_START_S
    headroom: float = 1.05
    points: int = 4
    down_delay_s: float = 60.0
    down_step: float = 0.25
    gain_up: float = 1.25
    gain_decay: float = 0.97
    max_gain: float = 4.0
    name: str = "kvroute"
    _forecast: Forecaster = field(default_factory=Forecaster, repr=False)
    _mix: tuple[float, float, float] = (0.0, 0.0, 0.0)
    _gain: float = 1.0
    _low_since: float | None = None

    def __post_init__(self) -> None:
        self._forecast = Forecaster(self.points)

    def desired(self, obs: Observation, lo: int, hi: int) -> tuple[float, str]:
        self._forecast.add(obs.now, obs.rate)
        met = _feedback(self, obs)
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


class SeasonalForecaster:
    """The arrival rate over a coming span of time: the highest of a trend forecast
    (``Forecaster``) and, with a known cycle (``period_s`` > 0: a day in production, the
    suite's burst-and-lull cycle in the simulator), the rates observed at the same time of
    the cycle in the last ``periods`` cycles. Only what was observed before ``now`` is used;
    before one full cycle has been seen the seasonal part has nothing to say."""

    def __init__(self, period_s: float = 0.0, points: int = 4, periods: int = 2) -> None:
        self.period_s, self.periods = period_s, max(1, periods)
        self.trend = Forecaster(points)
        # (window's start, window's end, rate), oldest first, at most ``periods`` cycles
        self.history: deque[tuple[float, float, float]] = deque()

    def add(self, now: float, window_s: float, rate: float) -> None:
        self.trend.add(now, rate)
        if self.period_s > 0:
            self.history.append((now - window_s, now, rate))
            keep = now - self.period_s * self.periods - window_s
            while self.history and self.history[0][1] < keep:
                self.history.popleft()

    def peak(self, now: float, until_s: float) -> tuple[float, str]:
        """The highest rate forecast over ``[now, now + until_s]``, and where it comes from."""
        trend = self.trend.predict(until_s)
        if self.period_s <= 0 or not self.history:
            return trend, "trend"
        seasonal = 0.0
        for k in range(1, self.periods + 1):
            lo, hi = now - k * self.period_s, now + until_s - k * self.period_s
            seen = [r for a, b, r in self.history if b > lo and a < hi]
            if seen:
                seasonal = max(seasonal, max(seen))
        if seasonal > trend:
            return seasonal, "cycle"
        return trend, "trend"


@dataclass
class PredictivePolicy:
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
    result; it decays back (x ``gain_decay``) while the target is met. Without a what-if the
    policy sizes with the capacity model alone (the reactive ``kvroute_reactive``'s model)."""

    profile: Any
    slo: Slo
    cold_start_s: float = DEFAULT_COLD_START_S
    period_s: float = 0.0
    periods: int = 2
    horizon_s: float = 60.0
    sim_goal: float = 0.99
    points: int = 4
    max_sims: int = 4
    headroom: float = 1.2
    gain_up: float = 1.1
    gain_decay: float = 0.95
    max_gain: float = 2.0
    name: str = "kvroute"
    _forecast: SeasonalForecaster = field(default_factory=SeasonalForecaster, repr=False)
    _mix: tuple[float, float, float] = (0.0, 0.0, 0.0)
    _cap: float = 0.0  # requests/s per replica the last search found
    _gain: float = 1.0

    def __post_init__(self) -> None:
        self._forecast = SeasonalForecaster(self.period_s, self.points, self.periods)

    def desired(self, obs: Observation, lo: int, hi: int) -> tuple[float, str]:
        self._forecast.add(obs.now, obs.window_s, obs.rate)
        met = _feedback(self, obs)
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
            n = rate * self.headroom * self._gain / model
            return n, f"{source} forecast {rate:.2f}/s within {ahead:g} s, model {model:.2f}/s"
        cap = self._cap or model or 1.0
        need, sims = self._search(what_if, rate, cap, lo, hi)
        self._cap = rate / need
        n = need * self.headroom * self._gain
        why = (
            f"{source} forecast {rate:.2f}/s within {ahead:g} s: {need} replicas meet "
            f"{self.sim_goal:.3f} in simulation ({sims} runs){fb}"
        )
        return n, why

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
                seen[n] = what_if(n, rate, self.horizon_s, self.slo) >= goal
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


class Autoscaler:
    """One pool's autoscaler: ``policy``'s desired count, rounded up and clamped to
    [``min_replicas``, ``max_replicas``], with the reason."""

    def __init__(
        self,
        policy: Policy,
        min_replicas: int,
        max_replicas: int,
        interval_s: float = DEFAULT_INTERVAL_S,
        pool: str = "default",
    ) -> None:
        if min_replicas < 1:
            raise ValueError(f"--min-instances must be >= 1, got {min_replicas}")
        if max_replicas < min_replicas:
            raise ValueError(
                f"--max-instances must be >= --min-instances ({min_replicas}), got {max_replicas}"
            )
        if not interval_s > 0:
            raise ValueError(f"autoscale interval_s must be > 0, got {interval_s}")
        self.policy, self.pool = policy, pool
        self.min_replicas, self.max_replicas, self.interval_s = (
            min_replicas,
            max_replicas,
            interval_s,
        )

    def decide(self, obs: Observation) -> Decision:
        lo, hi = self.min_replicas, self.max_replicas
        want, why = self.policy.desired(obs, lo, hi)
        n = math.ceil(want - 1e-9) if math.isfinite(want) else hi
        target = min(hi, max(lo, n))
        if target != n:
            why += f" (clamped to [{lo}, {hi}])"
        return Decision(self.pool, target, f"{self.policy.name}: {why}")
