"""The autoscaling core's records (what a policy is handed, what it answers), its SLO, and
the capacity model of one replica (over the profile's cost model, ``engines.profile``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engines.profile import LatencyProfile

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
    (``simulation.whatif.WhatIfSimulator``: the recent requests re-timed, replayed on the
    production router core); a production deployment can hand the same object, built from
    the ingress's recent requests. It keeps ``calls`` (simulations run) for the reason.

    With ``goal``, the caller asks only whether the fraction reaches it: the simulator may stop
    as soon as too many requests have missed for it to, and answer a fraction under ``goal``
    (at least as high as the whole run's); an answer of ``goal`` or more is the whole run's."""

    calls: int

    def __call__(
        self, replicas: int, rate: float, horizon_s: float, slo: Slo, goal: float | None = None
    ) -> float: ...


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

    def floors_broken(self, profile: LatencyProfile) -> list[tuple[str, float]]:
        """The bounds no number of ``profile`` engines can meet, each as (``"ttft"`` or
        ``"tpot"``, the profile's floor in seconds): under a one-token prompt's TTFT on an idle
        engine (its prefill and the request overhead), or under a lone request's decode step."""
        out = []
        ttft_floor = profile.ttft_s(1)
        if self.ttft_s < ttft_floor:
            out.append(("ttft", ttft_floor))
        tpot_floor = profile.decode_step_s(1, 2)
        if self.tpot_s is not None and self.tpot_s < tpot_floor:
            out.append(("tpot", tpot_floor))
        return out

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


def replica_capacity(
    profile: LatencyProfile,
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
    GPU work beyond the steps' fixed cost ``base`` (the profile's ``work_ms`` and
    ``busy_step_ms``), and is in decode for ``O`` steps; with step time ``tau`` the step holds
    ``lam tau`` requests' work, so ``tau = base / (1 - lam W)``, and the decoding batch is
    ``lam O tau`` (Little). Closed form, microseconds per call."""
    o = max(output_tokens, 1.0)
    ctx = prompt_tokens + o / 2  # a decoding request's mean context: the KV it holds
    w_ms = profile.work_ms(prompt_tokens, uncached_tokens, output_tokens)
    base_ms = profile.busy_step_ms
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


class Policy(Protocol):
    """One autoscaling rule: the desired count (fractional allowed) and why."""

    name: str

    def desired(self, obs: Observation, lo: int, hi: int) -> tuple[float, str]: ...
