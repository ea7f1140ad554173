"""Capacity planning: the cheapest cluster that serves a workload within its SLO, and the rate
at which a given cluster stops doing so.

Every configuration the search prices is one run of the cluster simulator
(``loadgen.simulator``): the workload replayed in virtual time through the production routing
core on sim engines of the chosen profile. Nothing is extrapolated from a utilisation formula.
The search leans on one property: more instances (or a lower request rate) never make SLO
attainment worse, up to the simulation's noise. So the instance count and the rate are found by
bisection (``jobs`` probes per round, run in parallel processes), not by a sweep, and a
configuration that has already missed more requests than the target allows is not simulated to
the end (``SloBudget``).

A *candidate* is one configuration: instances, CPU-tier size and eviction policy, how many of
the instances form a prefill pool (0: colocated; the rest decode, placed by the router's PD
planner), and the rate scale it serves. Cost orders candidates by instances, then CPU-tier GiB;
the eviction policy and the prefill/decode split cost nothing (the same GPUs either way).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from engines.sim.profile import LatencyProfile
from loadgen.cli import parse_floats
from loadgen.jobs import check_jobs, fork_pool
from loadgen.metrics import server_hit_rate
from loadgen.records import RequestRecord
from loadgen.simulator import SimSettings, SloBudget, engine_profile, ideal_ttfts, simulate
from loadgen.workloads import Planned

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


# the setups forked workers evaluate against, by fidelity (inherited, never pickled)
_WORKER_SETUPS: dict[str, PlanSetup] = {}

FULL, GUIDE = "full", "guide"


def _evaluate_in_worker(fidelity: str, cand: Candidate, slo: Slo, early_exit: bool) -> Outcome:
    return _WORKER_SETUPS[fidelity].evaluate(cand, slo, early_exit)


@dataclass(slots=True)
class SizeResult:
    """The cheapest passing candidate at one rate scale (None: none up to the maximum), the
    next cheaper candidate that was priced and failed, and every outcome priced on the way."""

    rate_scale: float
    best: Outcome | None
    cheaper_failing: Outcome | None
    outcomes: list[Outcome]


@dataclass(slots=True)
class RateResult:
    """The highest rate scale a candidate was shown to meet the SLO at (None: not even the
    lowest searched), the lowest it was shown to fail at (None: not even the highest), and
    every outcome priced on the way."""

    candidate: Candidate
    max_pass: Outcome | None
    min_fail: Outcome | None
    outcomes: list[Outcome]


# the rate search's grid: scales 2 ** (i / RATE_STEPS_PER_DOUBLING), about 2% apart
RATE_STEPS_PER_DOUBLING = 35


class Planner:
    """Searches configurations for one workload and SLO.

    ``jobs`` > 1 prices that many candidates at once in forked processes (the workload is
    shared, not copied); every outcome is kept, so no candidate is simulated twice.

    With ``guide`` in (0, 1) and a workload of at least ``MIN_GUIDED`` requests, a search runs
    first on the head of the workload (that fraction of its requests, a few times cheaper to
    simulate) to find where the boundary probably is, then on the whole workload from that
    guess outwards. The answer always rests on whole-workload runs on both sides of the
    boundary; the guide only decides where to look first."""

    MIN_GUIDED = 4000

    def __init__(
        self,
        setup: PlanSetup,
        slo: Slo,
        *,
        jobs: int = 1,
        early_exit: bool = True,
        guide: float = 0.25,
        on_outcome: Callable[[str, Outcome], None] | None = None,
    ) -> None:
        check_jobs(jobs)
        if not 0 <= guide < 1:
            raise ValueError(f"guide fraction must be in [0, 1), got {guide}")
        self.slo, self.jobs, self.early_exit = slo, jobs, early_exit
        self.setups = {FULL: setup}
        if guide > 0 and len(setup.plan) >= self.MIN_GUIDED:
            head = setup.plan[: max(1, int(len(setup.plan) * guide))]
            self.setups[GUIDE] = replace(setup, plan=head)
        self.on_outcome = on_outcome
        self.priced: dict[str, dict[Candidate, Outcome]] = {f: {} for f in self.setups}
        self._pool: ProcessPoolExecutor | None = None

    @property
    def outcomes(self) -> dict[Candidate, Outcome]:
        """Every whole-workload outcome priced so far."""
        return self.priced[FULL]

    def __enter__(self) -> Planner:
        _WORKER_SETUPS.update(self.setups)
        self._pool = fork_pool(self.jobs)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
        _WORKER_SETUPS.clear()

    def price(self, cands: Iterable[Candidate], fidelity: str = FULL) -> list[Outcome]:
        """The outcome of each candidate (simulated now unless already priced)."""
        cands = list(cands)
        done = self.priced[fidelity]
        todo = [c for c in dict.fromkeys(cands) if c not in done]
        if self._pool is not None and len(todo) > 1:
            futures: list[Future[Outcome]] = [
                self._pool.submit(_evaluate_in_worker, fidelity, c, self.slo, self.early_exit)
                for c in todo
            ]
            for fut in futures:
                self._record(fidelity, fut.result())
        else:
            for c in todo:
                self._record(fidelity, self.setups[fidelity].evaluate(c, self.slo, self.early_exit))
        return [done[c] for c in cands]

    def _record(self, fidelity: str, out: Outcome) -> None:
        self.priced[fidelity][out.candidate] = out
        if self.on_outcome is not None:
            self.on_outcome(fidelity, out)

    def _guided(self, search: Callable[[str, list[int], int], int | None], first: list[int],
                hi: int, step: int = 1) -> int | None:  # fmt: skip
        """``search(fidelity, first probes, gallop step)`` on the whole workload, first guided
        by the same search on its head when there is one: the whole-workload search then
        starts at the guess and the point below it (the two runs that prove an answer) and
        gallops from there in single steps."""
        if GUIDE not in self.setups:
            return search(FULL, first, step)
        g = search(GUIDE, first, step)
        g = hi if g is None else g
        return search(FULL, [g - 1, g], 1)

    # -- how many instances ------------------------------------------------------------------

    def size(
        self,
        min_instances: int,
        max_instances: int,
        tiers: Sequence[tuple[float, str]] = ((0.0, NO_TIER),),
        rate_scale: float = 1.0,
        curve: int = 0,
        splits: Sequence[float] = (0.0,),
    ) -> SizeResult:
        """The fewest instances in ``[min_instances, max_instances]`` at which some tier
        ``(GiB, policy)`` meets the SLO, the cheapest such tier there, and the next cheaper
        candidate that fails. The search prices only each policy's largest tier at the counts
        it probes (a larger tier of the same policy is taken to be never worse, as more
        instances are); every tier is priced at the answer, to pick the cheapest. ``curve``
        more counts, evenly spread over the range, are priced with every tier for the
        attainment curve. ``splits``: prefill pool fractions to price at every count probed
        (0: colocated; ``prefill_count``), none taken to dominate another; among the candidates
        that meet the SLO at the answer, the cheapest, then the best attainment, is chosen."""
        if not 1 <= min_instances <= max_instances:
            raise ValueError(
                f"--min-instances ({min_instances}) must be >= 1 and <= --max-instances "
                f"({max_instances})"
            )
        lo, hi = min_instances, max_instances

        def split(n: int) -> list[int]:
            return sorted({prefill_count(n, f) for f in splits})

        def at(n: int) -> list[Candidate]:
            return [Candidate(n, gib, pol, rate_scale, p) for gib, pol in tiers for p in split(n)]

        largest: dict[str, float] = {}
        for gib, pol in tiers:
            largest[pol] = max(gib, largest.get(pol, gib))
        if len(largest) > 1:  # a policy with a tier beats no tier at all
            largest.pop(NO_TIER, None)

        def strongest(n: int) -> list[Candidate]:
            return [
                Candidate(n, gib, pol, rate_scale, p)
                for pol, gib in largest.items()
                for p in split(n)
            ]

        def search(fidelity: str, first: list[int], step: int) -> int | None:
            done = self.priced[fidelity]
            return find_boundary(
                lo,
                hi,
                first,
                lambda n: not any(done[c].passes(self.slo) for c in strongest(n)),
                lambda ns: self.price([c for n in ns for c in strongest(n)], fidelity),
                self.jobs,
                step,
            )

        # both ends first: a failing end stops early, so it is cheap
        best = self._guided(search, [lo, hi], hi)
        if best is not None:
            self.price(at(best))  # the cheapest tier that meets it there
        if curve > 0:
            spread = {round(lo + (hi - lo) * i / max(curve - 1, 1)) for i in range(curve)}
            self.price(c for n in sorted(spread) for c in at(n))
        mine = sorted(
            (o for o in self.outcomes.values() if o.candidate.rate_scale == rate_scale),
            key=lambda o: (o.candidate.cost, o.candidate.policy, o.candidate.prefill_instances),
        )
        chosen = None
        if best is not None:
            chosen = min(
                (self.outcomes[c] for c in at(best) if self.outcomes[c].passes(self.slo)),
                key=lambda o: (o.candidate.cost, -o.attainment),
            )
        cheaper = [
            o
            for o in mine
            if not o.passes(self.slo)
            and (chosen is None or o.candidate.cost < chosen.candidate.cost)
        ]
        # the most expensive of the cheaper failures; among equals, the one closest to passing
        next_down = max(cheaper, key=lambda o: (o.candidate.cost, o.attainment), default=None)
        return SizeResult(rate_scale, chosen, next_down, mine)

    # -- at what rate it breaks ----------------------------------------------------------------

    def max_rate(
        self, cand: Candidate, *, lowest: float = 1 / 64, highest: float = 64.0
    ) -> RateResult:
        """The largest rate scale on a grid about 2% fine (``RATE_STEPS_PER_DOUBLING``) in
        ``[lowest, highest]`` at which ``cand`` meets the SLO, and the next one up, which
        fails: a gallop from scale 1 in doublings, then bisection of the bracket."""
        if not 0 < lowest <= 1 <= highest:
            raise ValueError("the rate search needs lowest <= 1 <= highest")
        per = RATE_STEPS_PER_DOUBLING
        ilo, ihi = math.floor(math.log2(lowest) * per), math.ceil(math.log2(highest) * per)

        def scale(i: int) -> float:
            return 2 ** (i / per)

        def at(i: int) -> Candidate:
            return replace(cand, rate_scale=scale(i))

        # searched as "the smallest grid index that fails", i.e. passes(i) is "fails(i)"
        def search(fidelity: str, first: list[int], step: int) -> int | None:
            done = self.priced[fidelity]
            return find_boundary(
                ilo,
                ihi,
                first,
                lambda i: done[at(i)].passes(self.slo),
                lambda ns: self.price([at(i) for i in ns], fidelity),
                self.jobs,
                step,
            )

        brk = self._guided(search, [0, per], ihi, step=per)  # from 1x, in doublings
        first_fail = brk  # None: passes even at the highest scale
        last_pass = (ihi if brk is None else brk - 1) if brk != ilo else None
        base = replace(cand, rate_scale=1.0)
        mine = sorted(
            (o for o in self.outcomes.values() if replace(o.candidate, rate_scale=1.0) == base),
            key=lambda o: o.candidate.rate_scale,
        )
        get = self.outcomes.get
        return RateResult(
            cand,
            get(at(last_pass)) if last_pass is not None else None,
            get(at(first_fail)) if first_fail is not None else None,
            mine,
        )


def find_boundary(
    lo: int,
    hi: int,
    first: list[int],
    fails: Callable[[int], bool],
    price: Callable[[list[int]], object],
    probes_per_round: int = 1,
    step: int = 1,
) -> int | None:
    """The smallest ``n`` in ``[lo, hi]`` with ``fails(n)`` false, for a ``fails`` that is
    true below some point and false from it on (None: it fails everywhere). ``price(ns)`` is
    called with each round's probes before ``fails`` is asked about them (the planner runs
    their simulations there, in parallel). Prices ``first`` first; then gallops away from the
    known side (``step``, doubling each round) until both sides are known, and k-sects the gap
    between them, ``probes_per_round`` probes a round. No point is probed, nor ``fails``
    asked about it, twice."""
    f, p = lo - 1, hi + 1  # the largest known failure below p; the smallest known pass
    probes = sorted({min(max(n, lo), hi) for n in first})
    while True:
        price(probes)
        failed = {n: fails(n) for n in probes}  # asked once per probe
        p = min([p, *(n for n, bad in failed.items() if not bad)])
        f = max([f, *(n for n, bad in failed.items() if bad and n < p)])
        if p == f + 1:
            return p if p <= hi else None
        k = probes_per_round
        if p > hi:  # no pass yet: gallop up from the highest failure
            probes = [min(f + step * i, hi) for i in range(1, k + 1)]
            step *= 2
        elif f < lo and p - lo > k:  # no failure yet: gallop down
            probes = [max(p - step * i, lo) for i in range(1, k + 1)]
            step *= 2
        else:
            k = min(k, p - f - 1)
            probes = [f + round((p - f) * i / (k + 1)) for i in range(1, k + 1)]
        probes = sorted({n for n in probes if f < n < p}) or [(f + p) // 2]


def parse_tiers(gib_list: str, policies: str) -> list[tuple[float, str]]:
    """``--cpu-tier-gib`` x ``--policy`` as ``(GiB, policy)`` pairs; a 0 GiB tier has no
    policy. Raises naming the flag."""
    from policies import policy_names

    sizes = parse_floats(
        gib_list, "--cpu-tier-gib", lambda g: g >= 0 and math.isfinite(g), ">= 0 (0: no CPU tier)"
    )
    names = [x.strip() for x in policies.split(",") if x.strip()]
    known = policy_names()
    for name in names:
        if name not in known:
            raise ValueError(f"--policy: unknown policy {name!r}; known: {', '.join(known)}")
    if not names and any(sizes):
        raise ValueError("--policy: give at least one eviction policy for the CPU tier")
    out: list[tuple[float, str]] = []
    for gib in sizes:
        out += [(gib, NO_TIER)] if gib == 0 else [(gib, name) for name in names]
    return out
