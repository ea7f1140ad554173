"""The cluster simulator's settings and records: the engines' options an ``--engine`` flag may
set, how the engines' truth departs from their profile (``Perturbation``), one simulated
cluster (``SimSettings``), the SLO budget that ends a failing replay early (``SloBudget``), what a
run produced (``SimRun``), and the ideal TTFTs a run is measured against (``ideal_ttfts``).
``simulation.cluster`` runs them."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from engines.base import LOAD_INTERVAL_S
from engines.pool.link import DEFAULT_POOL_GBPS, DEFAULT_POOL_LATENCY_MS, PoolLink
from engines.profile import LatencyProfile
from engines.sim.options import SimEngineOptions
from engines.sim.pool import SimPool
from engines.sim.request import SimRequest
from loadgen.records import RequestRecord
from loadgen.workloads import Planned, ideal_hits
from router.autoscale import DEFAULT_COLD_START_S
from router.settings import DEFAULTS, RouterSettings

# the engines' options (``SimEngineOptions``) an ``--engine key=value`` may set: all but the
# block size (``--block-size``) and the token ids of generated text (virtual engines make none)
ENGINE_OPTIONS: tuple[str, ...] = tuple(
    f.name
    for f in fields(SimEngineOptions)
    if f.name not in ("block_size", "vocab_size", "token_offset")
)

# how far back a leaving engine's requests are handed over (``SimSettings.handover_prefixes``):
# a conversation's next turn came 150-670 s after its last on the Mooncake trace's day
DEFAULT_HANDOVER_HISTORY_S = 600.0
# the request ids of warming prefills (``SimSettings.warm_prefixes``)
WARM_PREFIX = "warm-"


@dataclass(frozen=True, slots=True)
class Perturbation:
    """How the simulated engines' truth departs from the profile, all seeded.

    ``speed_sigma``: each engine's slowdown is log-normal with this sigma and mean 1;
    ``jitter``: per-step log-normal sigma (mean 1); ``stragglers``: the fraction of engines
    (rounded) that run ``straggler_slowdown`` times slower on top of their speed factor."""

    speed_sigma: float = 0.1
    jitter: float = 0.05
    stragglers: float = 0.0
    straggler_slowdown: float = 3.0
    seed: int = 0

    def __post_init__(self) -> None:
        # named by the ``kvroute simulate`` flag that sets each field
        checks = {
            "--speed-sigma": (self.speed_sigma, 0 <= self.speed_sigma < 2, "in [0, 2)"),
            "--jitter": (self.jitter, 0 <= self.jitter < 2, "in [0, 2)"),
            "--stragglers": (self.stragglers, 0 <= self.stragglers <= 1, "in [0, 1]"),
            "--straggler-slowdown": (self.straggler_slowdown, self.straggler_slowdown >= 1, ">= 1"),
        }
        for flag, (value, ok, valid) in checks.items():
            if not ok:
                raise ValueError(f"{flag} must be {valid}, got {value}")

    def joiner_slowdown(self, i: int) -> float:
        """The speed factor of engine ``i`` when it joins during a run (autoscaling): drawn
        from its index's own seeded stream, so the starting engines' factors are those of a
        fixed-size run, and a joiner's do not depend on how many joined before it."""
        rng = random.Random(f"speed/{self.seed}/{i}")
        s = self.speed_sigma
        out = math.exp(rng.gauss(-s * s / 2, s)) if s else 1.0
        if rng.random() < self.stragglers:
            out *= self.straggler_slowdown
        return out

    def slowdowns(self, n: int) -> list[float]:
        rng = random.Random(f"speed/{self.seed}")
        s = self.speed_sigma
        out = [math.exp(rng.gauss(-s * s / 2, s)) if s else 1.0 for _ in range(n)]
        for i in rng.sample(range(n), round(self.stragglers * n)):
            out[i] *= self.straggler_slowdown
        return out


EXACT = Perturbation(speed_sigma=0.0, jitter=0.0)


@dataclass(slots=True)
class SimSettings:
    """One simulated cluster: engines, their truth, the router's lags and SLO gate."""

    instances: int = 16
    block_size: int | None = None  # default: the workload's (Mooncake 512, synthetic 16)
    engine: dict[str, Any] = field(default_factory=dict)  # ENGINE_OPTIONS, by name
    perturbation: Perturbation = field(default_factory=Perturbation)
    event_lag_s: float = 0.01
    load_lag_s: float = 0.01
    load_interval_s: float = LOAD_INTERVAL_S
    slo_ttft_s: float | None = None  # admission: reject when the best estimate breaks it
    # prefill/decode: the first ``prefill_instances`` engines are a prefill pool, the rest a
    # decode pool (0: every engine colocated)
    prefill_instances: int = 0
    pd_max_local_prefill_tokens: int = DEFAULTS.pd_max_local_prefill_tokens
    pd_overload_factor: float | None = DEFAULTS.pd_overload_factor
    # membership (``ClusterSimulator.run`` with an autoscaler): seconds from the scale decision
    # to a new engine's first step (see ``DEFAULT_COLD_START_S``)
    cold_start_s: float = DEFAULT_COLD_START_S
    # the engines' KV events keep every event_stride-th block (EngineConfig.event_stride)
    event_stride: int = DEFAULTS.event_stride
    # the router counts the prompts it sent that no KV event shows yet (RouterCore's option)
    inflight_prompts: bool = DEFAULTS.inflight_prompts
    # the autoscaler's simulator (``Observation.what_if``: a ``WhatIfSimulator`` every
    # decision), sampling the requests of the last ``what_if_history_s`` seconds
    what_if: bool = True
    what_if_history_s: float = 120.0
    # the what-if's engines start holding what each sampled request found cached when it was
    # placed (prefilled before the sample's requests arrive); off: they start empty
    what_if_cached: bool = False
    # warming (KV-aware scale-up): a joining engine, at the end of its cold start and before
    # it is routable, prefills the ``warm_prefixes`` hottest prefixes of the requests placed
    # in the last ``what_if_history_s`` (``hot_prefixes``); 0: it joins cold
    warm_prefixes: int = 0
    # hand-over (KV-aware scale-down): when an engine leaves, the ``handover_prefixes`` longest
    # prompts it served in the last ``handover_history_s`` that no survivor holds half of are
    # prefilled where the router places them among the survivors (``warming.longest_prompts``); 0:
    # its cache leaves with it
    handover_prefixes: int = 0
    handover_history_s: float = DEFAULT_HANDOVER_HISTORY_S
    # the cluster's KV pool (``engines.sim.pool``, issue 58): GiB in all (0: no pool), each
    # engine's link to it (GB/s, and ms per load) and its eviction policy (``policies/``)
    pool_gib: float = 0.0
    pool_gbps: float = DEFAULT_POOL_GBPS
    pool_latency_ms: float = DEFAULT_POOL_LATENCY_MS
    pool_policy: str = "lru"
    # router replicas, each its own core (map, ledger, scorer) on the same buses; arrivals are
    # spread over them in turn (``simulation.wiring``)
    router_replicas: int = 1
    # the replicas share their assignments (``RouterCore.share``), each reaching the others
    # after the event lag, so a replica counts another's prompts before the engine reports them
    share_assignments: bool = True
    # failure studies: seconds after the first arrival at which the serving engine holding the
    # most GPU blocks is lost, its caches with it (None: none is)
    lose_engine_at_s: float | None = None
    # the pool announces what it holds on the KV bus, and the router prices loads from it
    # (``RouterCore``'s ``kv_pool``); off: the engines still use the pool, the router is blind
    pool_in_map: bool = True

    def router_settings(self, block_size: int, kv_capacity_blocks: int) -> RouterSettings:
        """The router's settings for this cluster of engines with ``block_size``-token blocks,
        ``kv_capacity_blocks`` each (the rest at the router's defaults)."""
        return RouterSettings(
            block_size=block_size,
            kv_capacity_blocks=kv_capacity_blocks,
            slo_ttft_s=self.slo_ttft_s,
            event_stride=self.event_stride,
            inflight_prompts=self.inflight_prompts,
            pd_max_local_prefill_tokens=self.pd_max_local_prefill_tokens,
            pd_overload_factor=self.pd_overload_factor,
        )

    def pool_link(self) -> PoolLink | None:
        """Each engine's link to the pool (None: no pool)."""
        if not self.pool_gib:
            return None
        return PoolLink(self.pool_gbps, self.pool_latency_ms)

    def pool(self, truth: LatencyProfile, block_size: int) -> SimPool | None:
        """A new pool for one simulated cluster of ``truth`` engines with ``block_size``-token
        blocks (``pool_gib`` of them, at least one block), or None when ``pool_gib`` is 0."""
        link = self.pool_link()
        if link is None:
            return None
        block_bytes = block_size * truth.kv_bytes_per_token
        return SimPool(
            max(int(self.pool_gib * (1 << 30)) // block_bytes, 1),
            block_bytes,
            link=link,
            policy=self.pool_policy,
            announce=self.pool_in_map,
            stride=self.event_stride,
        )

    def gpu_blocks(self, truth: LatencyProfile, block_size: int) -> int:
        """Each engine's GPU KV blocks: ``num_gpu_blocks`` when set, else the profile's
        capacity (what the router is told an engine holds)."""
        return int(self.engine.get("num_gpu_blocks") or truth.kv_capacity_tokens // block_size)

    def validate(self) -> None:
        if self.instances < 1:
            raise ValueError(f"--instances must be >= 1, got {self.instances}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        for lag in (self.event_lag_s, self.load_lag_s):
            if not 0 <= lag < 60:
                raise ValueError(f"--lag-ms must be in [0, 60000), got {lag * 1e3:g}")
        if self.event_stride < 1:
            raise ValueError(f"--event-stride must be >= 1, got {self.event_stride}")
        if self.warm_prefixes < 0:
            raise ValueError(f"--warm-prefixes must be >= 0, got {self.warm_prefixes}")
        if self.router_replicas < 1:
            raise ValueError(f"--router-replicas must be >= 1, got {self.router_replicas}")
        lose = self.lose_engine_at_s
        if lose is not None and not (lose >= 0 and math.isfinite(lose) and self.instances > 1):
            raise ValueError(
                f"lose_engine_at_s must be a number >= 0 with 2 engines or more, got {lose}"
            )
        if self.handover_prefixes < 0:
            raise ValueError(f"--handover-prefixes must be >= 0, got {self.handover_prefixes}")
        if not self.handover_history_s > 0:
            raise ValueError(f"handover_history_s must be > 0, got {self.handover_history_s}")
        if not 0 <= self.cold_start_s < 86_400:
            raise ValueError(f"--cold-start-s must be in [0, 86400), got {self.cold_start_s}")
        if not self.load_interval_s > 0:
            raise ValueError(f"load_interval_s must be > 0, got {self.load_interval_s}")
        if self.prefill_instances and not 0 < self.prefill_instances < self.instances:
            raise ValueError(
                f"--prefill-instances must be in [1, --instances), got {self.prefill_instances}"
            )
        self._validate_pool()
        unknown = sorted(set(self.engine) - set(ENGINE_OPTIONS))
        if unknown:
            raise ValueError(
                f"--engine: unknown option {unknown[0]!r}; valid: {', '.join(ENGINE_OPTIONS)}"
            )
        try:
            SimEngineOptions(**self.engine)
        except ValueError as e:
            raise ValueError(f"--engine: {e}") from None

    def _validate_pool(self) -> None:
        from policies.base import OfflinePolicy
        from policies.registry import get_policy_class

        if not (self.pool_gib >= 0 and math.isfinite(self.pool_gib)):
            raise ValueError(f"--pool-gib must be a number >= 0 (0: no pool), got {self.pool_gib}")
        try:
            PoolLink(self.pool_gbps, self.pool_latency_ms)
        except ValueError as e:  # its checks, named by the flags (latency_ms: --pool-latency-ms)
            raise ValueError(f"--pool-{e}".replace("_", "-", 1)) from None
        try:
            cls = get_policy_class(self.pool_policy)
        except ValueError as e:
            raise ValueError(f"--pool-policy: {e}") from None
        if issubclass(cls, OfflinePolicy):
            raise ValueError(f"--pool-policy: {self.pool_policy!r} needs the future (offline)")


@dataclass(slots=True)
class SloBudget:
    """Ends a replay early once more than ``max_misses`` requests have missed the SLO: the run
    can no longer attain it, and simulating the rest would only cost time (the capacity
    planner's early exit on configurations that fail). A request misses when it is refused (a
    400 or 429), when its first token comes later than ``ttft_s`` after its arrival, or when it
    finishes with a mean time per output token over ``tpot_s``; each counts once, under the
    first of those. A request still waiting for its first token is not counted until then.
    With ``counted``, only the misses of the requests it names (their ids) count."""

    ttft_s: float
    tpot_s: float | None
    max_misses: int
    ttft_misses: int = 0
    tpot_misses: int = 0
    refused: int = 0
    counted: frozenset[str] | None = None

    @property
    def misses(self) -> int:
        return self.ttft_misses + self.tpot_misses + self.refused

    @property
    def exhausted(self) -> bool:
        return self.misses > self.max_misses

    def counts(self, request_id: str) -> bool:
        return self.counted is None or request_id in self.counted

    def first_token(self, request_id: str, ttft_s: float) -> None:
        if ttft_s > self.ttft_s and self.counts(request_id):
            self.ttft_misses += 1

    def refuse(self, request_id: str) -> None:
        if self.counts(request_id):
            self.refused += 1

    def finished(self, req: SimRequest) -> None:
        if self.tpot_s is None or req.num_output < 2 or req.ttft_s > self.ttft_s:
            return  # no TPOT to judge, or already counted at its first token
        if not self.counts(req.request_id):
            return
        if (req.finish_s - req.first_token_s) / (req.num_output - 1) > self.tpot_s:
            self.tpot_misses += 1


@dataclass(slots=True)
class SimRun:
    """What one simulated run produced."""

    router: str
    records: list[RequestRecord]
    queue: list[tuple[float, str, int, int]]  # (t, instance, waiting, running) per load sample
    span_s: float  # first arrival to last finish, virtual seconds
    wall_s: float
    calibration: dict[str, float] | None
    slowdowns: list[float]  # each engine's speed factor over the profile
    aborted: bool = False  # a ``SloBudget`` ran out: records after that point are unfinished
    # GPU-seconds of every engine from its scale decision (the first arrival for the starting
    # engines) to its release (drained after leaving; else the last finish)
    gpu_seconds: float = 0.0
    # the pool's target replica count over time: (t, n, reason) at the start and each change
    replicas: list[tuple[float, int, str]] = field(default_factory=list)
    # KV event messages and blocks (stored and removed) the engines put on the bus
    kv_messages: int = 0
    kv_blocks: int = 0
    # each engine's billing, (from, to): ``gpu_seconds`` is their sum (see ``gpu_seconds_in``)
    billed: list[tuple[float, float]] = field(default_factory=list)
    # autoscaling: each decision's cost in seconds of this process's CPU (what-ifs included)
    decision_cpu_s: list[float] = field(default_factory=list)
    # per engine that joined during the run: (routable from, its id, warmed first)
    joins: list[tuple[float, str, bool]] = field(default_factory=list)

    def gpu_seconds_in(self, t0: float, t1: float = math.inf) -> float:
        """GPU-seconds billed within ``[t0, t1]``."""
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in self.billed)

    @property
    def requests_per_wall_s(self) -> float:
        return len(self.records) / self.wall_s if self.wall_s > 0 else math.inf


ProgressFn = Callable[[int, int], None]  # (requests placed, total)


def engine_profile(truth: LatencyProfile, settings: SimSettings) -> tuple[LatencyProfile, int]:
    """``truth`` with the scheduler limits of the engines of ``settings`` (what they run, and
    what the router prices with), and their ``max_model_len``, before any ``Perturbation``."""
    eng = settings.engine
    prof = truth.with_limits(
        eng.get("max_num_batched_tokens"), eng.get("long_prefill_token_threshold")
    )
    return prof, int(eng.get("max_model_len") or prof.max_model_len)


def ideal_ttfts(
    plan: Sequence[Planned], trace_block_size: int, truth: LatencyProfile, settings: SimSettings
) -> list[float]:
    """Each request's ideal TTFT in seconds, in plan order: alone on an idle engine of the
    truth profile (``engine_profile``: unperturbed), with every block that any earlier request
    of the plan carried already in its GPU cache (``ideal_hits``; a full hit still computes the
    last token). NaN for a prompt the engines refuse (at or over ``max_model_len``).

    No router can place a request faster, up to the perturbation: a request on an engine that
    ``Perturbation`` made faster than the profile (its speed factor or a step's jitter below
    1) can come in under it, so the excess over it can be slightly negative there; with
    ``EXACT`` every measured TTFT is at least this. The capacity planner's ceiling
    (``PlanSetup.ceiling``) is the attainment of these TTFTs."""
    prof, max_len = engine_profile(truth, settings)
    out: list[float] = []
    for r, k in ideal_hits(p.req for p in plan):
        if r.input_length >= max_len:
            out.append(math.nan)
            continue
        cached = min(k * trace_block_size, r.input_length - 1) if r.input_length else 0
        out.append(prof.ttft_s(r.input_length, max(cached, 0)))
    return out
