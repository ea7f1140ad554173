"""Capacity planning: the cheapest cluster that serves a workload within its SLO, and the rate
at which a given cluster stops doing so.

Every configuration the search prices is one run of the cluster simulator
(``simulation.cluster``): the workload replayed in virtual time through the production routing
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

What one candidate's price is (its simulation, and the outcome judged against the SLO):
``simulation.pricing``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, replace

from simulation.jobs import check_jobs, fork_pool
from simulation.pricing import NO_TIER, Candidate, Outcome, PlanSetup, Slo, prefill_count

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

    def _guided(
        self,
        lo: int,
        hi: int,
        below: Callable[[dict[Candidate, Outcome], int], bool],
        probe: Callable[[int], list[Candidate]],
        first: list[int],
        step: int = 1,
    ) -> int | None:
        """The smallest ``n`` in ``[lo, hi]`` not ``below`` the boundary (``below(priced, n)``,
        true below some point and false from it on, reads the outcomes of ``probe(n)``'s
        candidates), by ``find_boundary`` from the ``first`` probes, galloping by ``step``: on
        the whole workload, first guided by the same search on its head when there is one, so
        that the whole-workload search starts at the guess and the point below it (the two runs
        that prove an answer) and gallops from there in single steps."""

        def search(fidelity: str, first: list[int], step: int) -> int | None:
            done = self.priced[fidelity]
            return find_boundary(
                lo,
                hi,
                first,
                lambda n: below(done, n),
                lambda ns: self.price([c for n in ns for c in probe(n)], fidelity),
                self.jobs,
                step,
            )

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

        def fails(done: dict[Candidate, Outcome], n: int) -> bool:
            return not any(done[c].passes(self.slo) for c in strongest(n))

        # both ends first: a failing end stops early, so it is cheap
        best = self._guided(lo, hi, fails, strongest, [lo, hi])
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

        # searched as "the smallest grid index that fails": below it, every index passes
        def passes(done: dict[Candidate, Outcome], i: int) -> bool:
            return done[at(i)].passes(self.slo)

        brk = self._guided(ilo, ihi, passes, lambda i: [at(i)], [0, per], step=per)  # from 1x
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
