"""``kv_ttft``: kvroute's scorer. Mooncake-style TTFT estimate per instance, lowest wins.

    ttft(i) = queue(i) + prefill(uncached tokens at this context length) + load(CPU-hit tokens)

- queue(i): the prefill work already waiting on ``i`` (engine-reported queued prefill tokens,
  beyond each queued prompt's cached prefix, plus this router's assignments newer than that
  report) over ``i``'s prefill rate, from its own profile;
- prefill: the request's tokens beyond the instance's leading cached run (GPU or CPU), in
  ``max_num_batched_tokens`` chunks at their context length, plus the per-request overhead;
- load: the CPU-resident part of that run, moved to the GPU at the profile's bandwidth.

Decode load breaks near-ties (within ``tie_s``) toward fewer running sequences, and vetoes an
instance whose GPU KV usage is above ``kv_veto`` or that could not fit the request's blocks:
routing there would preempt running decodes. If every instance is vetoed the veto is ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cachemap import Match
from router.placement import InstanceView, Placement, PlacementRequest, Scorer, healthy


class KvTtftScorer(Scorer):
    name = "kv_ttft"

    def __init__(self, kv_veto: float = 0.95, tie_s: float = 0.002) -> None:
        if not 0 < kv_veto <= 1:
            raise ValueError(f"kv_veto must be in (0, 1], got {kv_veto}")
        self.kv_veto = kv_veto
        self.tie_s = tie_s

    def estimate(
        self, request: PlacementRequest, inst: InstanceView, m: Match | None
    ) -> tuple[float, int]:
        """(estimated TTFT in seconds, leading cached blocks) of ``request`` on ``inst``."""
        bs = inst.block_size
        gpu = m.gpu_blocks if m else 0
        total = m.total_blocks if m else 0
        # NOTE: an engine always recomputes at least the prompt's last token.
        cached_tokens = min(total * bs, max(0, request.prompt_tokens - 1))
        gpu_tokens = min(gpu * bs, cached_tokens)
        lat = inst.latency
        queue = lat.queue_s(inst.pending_prefill_tokens)
        ttft = lat.ttft_s(request.prompt_tokens, gpu_tokens, cached_tokens - gpu_tokens)
        return queue + ttft, total

    def _vetoed(self, request: PlacementRequest, inst: InstanceView) -> bool:
        if inst.gpu_kv_usage >= self.kv_veto:
            return True
        if inst.kv_capacity_blocks:
            need = -(-(request.prompt_tokens + request.max_tokens) // inst.block_size)
            free = inst.kv_capacity_blocks * (1.0 - inst.gpu_kv_usage)
            return need > free
        return False

    def place(
        self,
        request: PlacementRequest,
        instances: Sequence[InstanceView],
        match: Mapping[str, Match],
    ) -> Placement:
        alive = healthy(instances)
        pool = [i for i in alive if not self._vetoed(request, i)] or alive
        scored = [(self.estimate(request, i, match.get(i.instance_id)), i) for i in pool]
        best_s = min(s for (s, _), _ in scored)
        near = [(s, c, i) for (s, c), i in scored if s <= best_s + self.tie_s]
        s, cached, inst = min(near, key=lambda x: (x[2].running + x[2].waiting, x[0]))
        return Placement(inst.instance_id, estimated_ttft_s=s, cached_blocks=cached)
