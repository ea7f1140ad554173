"""One pool's autoscaler: a policy's desired count, clamped, with its reason."""

from __future__ import annotations

import math

from router.autoscale.model import DEFAULT_INTERVAL_S, Decision, Observation, Policy


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
