"""``dynamo_cost``: a re-implementation of NVIDIA Dynamo's KV router cost function.

From Dynamo's router documentation (docs.nvidia.com/dynamo, "KV Router" / "Router Design"):
per worker,

    potential_prefill_blocks = (active prefill tokens on the worker
                                + input tokens - overlap_blocks * block_size) / block_size
    potential_decode_blocks  = active blocks on the worker + the request's blocks
    cost = overlap_score_weight * potential_prefill_blocks + potential_decode_blocks

lowest cost wins (``--router-temperature 0``: deterministic; ties broken at random in Dynamo,
by instance id here). Overlap comes from worker KV events (our cache map, GPU tier). Dynamo's
router counts active prefill tokens and blocks from its own in-flight requests; here the
prefill term is the engine's reported prefill queue plus this router's newer assignments
(``pending_prefill_tokens``) and the active blocks are the engine's reported KV usage times its
capacity. Without the prefill term (our first version) nothing in the cost moves between two
load samples, and a hot prefix's holder took every request in between.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cachemap import Match
from router.placement import InstanceView, Placement, PlacementRequest, Scorer, healthy


class DynamoCostScorer(Scorer):
    name = "dynamo_cost"

    def __init__(self, overlap_score_weight: float = 1.0) -> None:
        self.overlap_score_weight = overlap_score_weight

    def cost(self, request: PlacementRequest, inst: InstanceView, m: Match | None) -> float:
        bs = inst.block_size
        overlap = m.gpu_blocks if m else 0
        new_tokens = max(0, request.prompt_tokens - overlap * bs)
        prefill_blocks = (inst.pending_prefill_tokens + new_tokens) / bs
        request_blocks = -(-request.prompt_tokens // bs)
        active = inst.gpu_kv_usage * inst.kv_capacity_blocks
        if not inst.kv_capacity_blocks:  # unknown capacity: no occupancy term, only the queue
            active = 0.0
        return self.overlap_score_weight * prefill_blocks + active + request_blocks

    def place(
        self,
        request: PlacementRequest,
        instances: Sequence[InstanceView],
        match: Mapping[str, Match],
    ) -> Placement:
        costs = [
            (self.cost(request, i, match.get(i.instance_id)), i.instance_id, i)
            for i in healthy(instances)
        ]
        _, iid, _ = min(costs, key=lambda c: (c[0], c[1]))
        m = match.get(iid)
        return Placement(iid, cached_blocks=m.total_blocks if m else 0)
