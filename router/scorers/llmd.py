"""``llmd_weighted``: a re-implementation of llm-d's inference-scheduler weighted scoring.

From llm-d's documented default scheduling profile (llm-d/llm-d-inference-scheduler): every
scorer maps each candidate to [0, 1], the scheduler sums ``weight * score`` and picks the
maximum. The "precise prefix cache" profile weighs:

- ``precise-prefix-cache-scorer`` (2): fraction of the request's blocks the pod holds, from KV
  events (our cache map, GPU tier);
- ``kv-cache-utilization-scorer`` (1): ``1 - KV usage``;
- ``queue-scorer`` (1): min-max normalised waiting queue, ``(max - q) / (max - min)`` (1 when
  all queues are equal).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cachemap import Match
from router.placement import InstanceView, Placement, PlacementRequest, Scorer, healthy


class LlmdWeightedScorer(Scorer):
    name = "llmd_weighted"

    def __init__(
        self, prefix_weight: float = 2.0, kv_weight: float = 1.0, queue_weight: float = 1.0
    ):
        self.weights = (prefix_weight, kv_weight, queue_weight)

    def place(
        self,
        request: PlacementRequest,
        instances: Sequence[InstanceView],
        match: Mapping[str, Match],
    ) -> Placement:
        alive = healthy(instances)
        n = max(1, len(request.block_hashes))
        queues = [i.waiting for i in alive]
        qmax, qmin = max(queues), min(queues)
        wp, wk, wq = self.weights
        best: tuple[float, str] | None = None
        for inst in alive:
            m = match.get(inst.instance_id)
            prefix = (m.gpu_blocks if m else 0) / n
            kv = 1.0 - min(1.0, max(0.0, inst.gpu_kv_usage))
            queue = 1.0 if qmax == qmin else (qmax - inst.waiting) / (qmax - qmin)
            score = wp * prefix + wk * kv + wq * queue
            if best is None or score > best[0] or (score == best[0] and inst.instance_id < best[1]):
                best = (score, inst.instance_id)
        assert best is not None
        m = match.get(best[1])
        return Placement(best[1], cached_blocks=m.total_blocks if m else 0)
