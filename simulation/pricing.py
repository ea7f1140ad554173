"""What the capacity planner (``simulation.planner``) prices: the SLO (``Slo``), a candidate
configuration (``Candidate``), one cluster simulation of it on a workload (``PlanSetup.evaluate``)
and its outcome judged against the SLO (``Outcome``, ``judge``), and the KV event volume a
configuration makes its router follow (``event_volume``)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from engines.profile import LatencyProfile
from loadgen.metrics import server_hit_rate
from loadgen.records import RequestRecord
from loadgen.workloads import Planned
from simulation.cluster import simulate
from simulation.settings import SimSettings, SloBudget, engine_profile, ideal_ttfts

NO_TIER = "-"  # the policy of a candidate without a CPU tier


@dataclass(frozen=True, slots=True)
class Slo:
    """The service level a configuration must meet: at least ``attainment`` of all requests
    (refused ones included) get their first token within ``ttft_ms`` of arrival and, if
    ``tpot_ms`` is set, a mean time per output token within it."""

    ttft_ms: float
    tpot_ms: float | None = None
    attainment: float = 0.99

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and math.isfinite(self.ttft_ms)):
            raise ValueError(f"--slo-ttft-ms must be > 0, got {self.ttft_ms}")
        if self.tpot_ms is not None and not (self.tpot_ms > 0 and math.isfinite(self.tpot_ms)):
            raise ValueError(f"--slo-tpot-ms must be > 0, got {self.tpot_ms}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {self.attainment}")

    @property
    def percentile(self) -> str:
        """The percentile the attainment target names: 0.99 -> ``p99``."""
        return f"p{self.attainment * 100:g}"

    def required(self, requests: int) -> int:
        """How many of ``requests`` must meet every SLO."""
        return math.ceil(requests * self.attainment - 1e-9)

    def budget(self, requests: int) -> SloBudget:
        """The misses a run of ``requests`` may have and still meet this SLO."""
        allowed = requests - self.required(requests)
        return SloBudget(self.ttft_ms / 1e3, _s(self.tpot_ms), allowed)


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def rescaled(plan: list[Planned], rate_scale: float) -> list[Planned]:
    """``plan`` sent ``rate_scale`` times as fast (its gaps divided by it), as
    ``--rate-scale`` builds it."""
    if rate_scale == 1.0:
        return plan
    return [replace(p, offset_s=p.offset_s / rate_scale) for p in plan]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One configuration the planner prices."""

    instances: int
    cpu_tier_gib: float = 0.0
    policy: str = NO_TIER
    rate_scale: float = 1.0
    prefill_instances: int = 0  # of ``instances``, the prefill pool's (0: colocated)

    @property
    def cost(self) -> tuple[float, ...]:
        return (self.instances, self.cpu_tier_gib)

    @property
    def label(self) -> str:
        tier = f", CPU tier {self.cpu_tier_gib:g} GiB {self.policy}" if self.cpu_tier_gib else ""
        split = (
            f" ({self.prefill_instances} prefill + {self.instances - self.prefill_instances} "
            "decode)"
            if self.prefill_instances
            else ""
        )
        return f"{self.instances} instances{split}{tier}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "instances": self.instances,
            "prefill_instances": self.prefill_instances,
            "cpu_tier_gib": self.cpu_tier_gib,
            "policy": self.policy if self.cpu_tier_gib else None,
            "rate_scale": self.rate_scale,
        }


def prefill_count(instances: int, fraction: float) -> int:
    """The prefill pool's size for a ``fraction`` of ``instances`` (0: colocated): at least one
    engine in each pool, so 0 when ``instances`` < 2."""
    if fraction <= 0 or instances < 2:
        return 0
    return min(max(1, round(fraction * instances)), instances - 1)


@dataclass(slots=True)
class Outcome:
    """What one candidate's simulation showed against the SLO. When the run ended early
    (``aborted``: it had already missed more requests than the target allows) the attainment
    figures are upper bounds and the percentiles count the unfinished requests as misses."""

    candidate: Candidate
    requests: int
    met: int  # requests within every SLO
    ttft_met: int
    tpot_met: int  # requests within the TPOT SLO (every completed one when there is none)
    refused: int  # 400 / 429 answers
    ttft_ms_at: float  # TTFT at the attainment percentile (inf: beyond the run)
    tpot_ms_at: float | None
    hit_rate: float | None
    aborted: bool
    wall_s: float
    # when ``aborted``: requests placed before the stop, and the misses counted by then
    # (TTFT, TPOT, refused), more than ``allowed``
    stopped_after: int = 0
    early_misses: tuple[int, int, int] = (0, 0, 0)
    allowed: int = 0

    @property
    def attainment(self) -> float:
        return self.met / self.requests if self.requests else 0.0

    def passes(self, slo: Slo) -> bool:
        return not self.aborted and self.met >= slo.required(self.requests)

    def why(self, slo: Slo) -> str:
        """Which SLO this candidate misses and at what percentile ("" when it meets it)."""
        if self.passes(slo):
            return ""
        if self.aborted:
            t, d, r = self.early_misses
            parts = [f"TTFT > {slo.ttft_ms:,.0f} ms for {t:,}"]
            if slo.tpot_ms is not None:
                parts.append(f"TPOT > {slo.tpot_ms:,.1f} ms for {d:,}")
            if r:
                parts.append(f"{r:,} refused")
            return (
                f"{t + d + r:,} misses by request {self.stopped_after:,} of {self.requests:,}, "
                f"more than the {self.allowed:,} a {slo.attainment:.1%} target allows ("
                + ", ".join(parts)
                + "); stopped there"
            )
        reasons = []
        need = slo.required(self.requests)
        if self.ttft_met < need:
            reasons.append(
                f"TTFT {slo.percentile} {_ms(self.ttft_ms_at)} > {slo.ttft_ms:,.0f} ms "
                f"({self.ttft_met / self.requests:.1%} within)"
            )
        if slo.tpot_ms is not None and self.tpot_ms_at is not None and self.tpot_met < need:
            reasons.append(
                f"TPOT {slo.percentile} {_ms(self.tpot_ms_at)} > {slo.tpot_ms:,.1f} ms "
                f"({self.tpot_met / self.requests:.1%} within)"
            )
        if not reasons:  # each SLO alone holds; together they do not
            reasons.append(f"TTFT and TPOT together: {self.attainment:.1%} within both")
        if self.refused:
            reasons.append(f"{self.refused:,} refused")
        return "; ".join(reasons)

    def to_dict(self, slo: Slo) -> dict[str, Any]:
        return {
            **self.candidate.to_dict(),
            "attainment": round(self.attainment, 5),
            "attainment_is_upper_bound": self.aborted,
            "passes": self.passes(slo),
            "why": self.why(slo) or None,
            "ttft_ms_at_percentile": None if math.isinf(self.ttft_ms_at) else self.ttft_ms_at,
            "tpot_ms_at_percentile": (
                None if self.tpot_ms_at is None or math.isinf(self.tpot_ms_at) else self.tpot_ms_at
            ),
            "hit_rate": self.hit_rate,
            "refused": self.refused,
            "wall_s": round(self.wall_s, 3),
        }


def _ms(v: float) -> str:
    return "beyond the run" if math.isinf(v) else f"{v:,.0f} ms"


def judge(
    records: Sequence[RequestRecord], requests: int, slo: Slo
) -> tuple[int, int, int, int, float, float | None, float | None]:
    """``(met, ttft_met, tpot_met, refused, TTFT at the percentile, TPOT at it, hit rate)``
    of a run's records against ``slo``; requests without a record (an aborted run) miss. A
    request meets the SLO exactly when ``loadgen.metrics.summarize`` counts it as goodput."""
    ttft_s, tpot_s = slo.ttft_ms / 1e3, _s(slo.tpot_ms)
    ttft = np.full(requests, np.inf)
    tpot = np.full(requests, np.inf)
    refused = 0
    for i, r in enumerate(records):
        if r.status in (400, 429):
            refused += 1
        if not r.ok:
            continue
        ttft[i] = r.ttft_s
        tp = r.tpot_s
        tpot[i] = 0.0 if math.isnan(tp) else tp
    t_ok = ttft <= ttft_s
    d_ok = tpot <= tpot_s if tpot_s is not None else np.isfinite(tpot)
    p_ok = t_ok & d_ok
    q = slo.attainment

    def at(values: np.ndarray) -> float:
        return float(np.quantile(values, q, method="inverted_cdf")) * 1e3 if requests else 0.0

    return (
        int(p_ok.sum()),
        int(t_ok.sum()),
        int(d_ok.sum()),
        refused,
        round(at(ttft), 3),
        round(at(tpot), 3) if tpot_s is not None else None,
        server_hit_rate(records),
    )


@dataclass(slots=True)
class PlanSetup:
    """Everything a candidate's simulation needs besides the candidate: the workload at rate
    scale 1, the engines' truth, the router, the cluster settings every candidate shares, and
    how many perturbation seeds each candidate is simulated with (their requests pooled: one
    seed's luck in the engines' speed draw no longer decides a verdict near the boundary)."""

    plan: list[Planned]
    trace_block_size: int
    truth: LatencyProfile
    router: str = "kv_ttft"
    router_options: dict[str, Any] = field(default_factory=dict)
    settings: SimSettings = field(default_factory=SimSettings)
    router_profile: LatencyProfile | None = None
    seeds: int = 1  # perturbation seeds per candidate, their requests pooled

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {self.seeds}")

    @property
    def block_size(self) -> int:
        return self.settings.block_size or self.trace_block_size

    @property
    def rate(self) -> float:
        """The workload's mean request rate at scale 1 (req/s)."""
        span = self.plan[-1].offset_s - self.plan[0].offset_s if len(self.plan) > 1 else 0.0
        return (len(self.plan) - 1) / span if span > 0 else math.inf

    def cpu_blocks(self, gib: float) -> int:
        """Blocks of this profile's KV in a CPU tier of ``gib`` GiB."""
        return int(gib * 2**30 // (self.truth.kv_bytes_per_token * self.block_size))

    def ceiling(self, slo: Slo) -> float:
        """The attainment no cluster can beat: each request alone on an idle engine of the
        profile, with every block that any earlier request carried already cached there. A
        target above it is unreachable at any size (a prompt the engines refuse, at or over
        ``max_model_len``; a prompt whose own prefill breaks the TTFT SLO; a decode step slower
        than the TPOT SLO)."""
        prof, _ = engine_profile(self.truth, self.settings)
        met = 0
        ideal = ideal_ttfts(self.plan, self.trace_block_size, self.truth, self.settings)
        for p, ttft_s in zip(self.plan, ideal, strict=True):
            r = p.req
            if math.isnan(ttft_s):
                continue
            ok = ttft_s * 1e3 <= slo.ttft_ms
            if ok and slo.tpot_ms is not None and r.output_length > 1:
                ctx = r.input_length + r.output_length // 2
                ok = prof.decode_step_s(1, ctx) * 1e3 <= slo.tpot_ms
            met += ok
        return met / len(self.plan) if self.plan else 1.0

    def scaled(self, rate_scale: float) -> list[Planned]:
        return rescaled(self.plan, rate_scale)

    def evaluate(self, cand: Candidate, slo: Slo, early_exit: bool = True) -> Outcome:
        """Simulate ``cand`` on this workload, once per perturbation seed (``seeds``, counted
        from the settings' seed), and judge the pooled requests against ``slo``. With
        ``early_exit`` the runs share one miss budget: the first run that exhausts it ends the
        evaluation."""
        engine = dict(self.settings.engine)
        if cand.cpu_tier_gib > 0:
            engine["cpu_capacity_blocks"] = self.cpu_blocks(cand.cpu_tier_gib)
            engine["cpu_policy"] = cand.policy
        plan = self.scaled(cand.rate_scale)
        total = len(plan) * self.seeds
        budget = slo.budget(total) if early_exit else None
        t0 = time.perf_counter()
        records: list[RequestRecord] = []
        aborted = False
        base = self.settings.perturbation
        for k in range(self.seeds):
            settings = replace(
                self.settings,
                instances=cand.instances,
                prefill_instances=cand.prefill_instances,
                engine=engine,
                perturbation=replace(base, seed=base.seed + k),
            )
            run = simulate(
                plan,
                self.trace_block_size,
                self.truth,
                self.router,
                settings,
                scorer_options=self.router_options,
                router_profile=self.router_profile,
                budget=budget,
            )
            records += run.records
            if run.aborted:
                aborted = True
                break
        met, ttft_met, tpot_met, refused, ttft_at, tpot_at, hit = judge(records, total, slo)
        early = (0, 0, 0)
        if aborted and budget is not None:
            # at least ``misses`` requests missed: the attainment is at most the rest
            met = total - budget.misses
            early = (budget.ttft_misses, budget.tpot_misses, budget.refused)
        return Outcome(
            cand,
            total,
            met,
            ttft_met,
            tpot_met,
            refused,
            ttft_at,
            tpot_at,
            hit,
            aborted,
            time.perf_counter() - t0,
            stopped_after=len(records) if aborted else total,
            early_misses=early,
            allowed=budget.max_misses if budget is not None else 0,
        )


# vLLM's default KV block size on GPUs: the granularity its KV events come in
VLLM_BLOCK_SIZE = 16
# the share of one router core that following the engines' KV events may take
ROUTER_CORE_BUDGET = 0.5


@dataclass(frozen=True, slots=True)
class EventVolume:
    """The KV events a cluster's engines publish at one operating point, and what following
    them costs each router replica (every replica reads them all).

    Every prompt token the engines compute (not a cache hit) and every output token fills
    blocks that are stored, and, once the caches are full, as many are evicted: blocks stored
    plus removed per second = 2 x (uncached prompt + output tokens per second) / block size."""

    block_size: int
    blocks_per_engine_s: float
    cluster_blocks_s: float
    router_cores: float  # of one router core, at event_stride 1
    stride: int  # the smallest event_stride in 1, 2, 4, 8, 16 under ROUTER_CORE_BUDGET

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "blocks_per_engine_s": round(self.blocks_per_engine_s),
            "cluster_blocks_s": round(self.cluster_blocks_s),
            "router_cores": round(self.router_cores, 4),
            "event_stride": self.stride,
        }


def event_volume(
    plan: Sequence[Planned],
    rate_rps: float,
    instances: int,
    hit_rate: float | None,
    block_size: int = VLLM_BLOCK_SIZE,
) -> EventVolume:
    """The event volume of ``plan``'s requests at ``rate_rps`` on ``instances`` engines whose
    caches serve ``hit_rate`` of the prompt tokens."""
    from cachemap.ingest import APPLY_BLOCKS_PER_S

    n = max(1, len(plan))
    prompt = sum(p.req.input_length for p in plan) / n
    output = sum(p.req.output_length for p in plan) / n
    new_tokens = prompt * (1 - (hit_rate or 0.0)) + output
    cluster = 2 * rate_rps * new_tokens / block_size
    cores = cluster / APPLY_BLOCKS_PER_S
    stride = next((k for k in (1, 2, 4, 8) if cores / k <= ROUTER_CORE_BUDGET), 16)
    return EventVolume(block_size, cluster / max(1, instances), cluster, cores, stride)
