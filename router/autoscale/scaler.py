"""One pool's autoscaler: a policy's desired count, clamped, with its reason; a scale-down that
would reverse a scale-up whose engines are still starting is held."""

from __future__ import annotations

import math

from router.autoscale.model import DEFAULT_INTERVAL_S, Decision, Observation, Policy


class Autoscaler:
    """One pool's autoscaler: ``policy``'s desired count, rounded up and clamped to
    [``min_replicas``, ``max_replicas``], with the reason.

    A policy that weighs what a scale-up has cost (``hold_reversals``: kvroute's) has its
    scale-downs sooner than its ``cold_start_s`` after the scale-up they reverse held at the
    current count: the engines that scale-up started pay their cold start whether or not they
    are still wanted. The scale-down goes through at the first decision after. The rule is
    here, so the simulator and Serve run it alike (``simulation.measures.flapping`` counts what
    is left: direction changes, and reversals within a cold start); the peers' policies
    (``ray_default``, Dynamo's ``throughput``) and the hindsight schedules run as they are."""

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
        # how long a scale-down is held after the scale-up it reverses (0: not held)
        hold = getattr(policy, "hold_reversals", False)
        self.cold_start_s = float(getattr(policy, "cold_start_s", 0.0)) if hold else 0.0
        self._up_at = -math.inf  # when the target last rose
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
        if target > obs.replicas:
            self._up_at = obs.now
        elif target < obs.replicas and obs.now - self._up_at < self.cold_start_s:
            why += (
                f"; held at {obs.replicas}: the scale-up {obs.now - self._up_at:.0f} s ago "
                f"is still within its {self.cold_start_s:g} s cold start"
            )
            target = obs.replicas
        return Decision(self.pool, target, f"{self.policy.name}: {why}")
