"""Prefill/decode placement: where a request's prompt is computed and where it decodes.

In a deployment with ``prefill`` and ``decode`` pools (``router.pools``) a request goes in two
legs: a prefill engine computes the prompt (one output token, ``do_remote_decode``) and hands
its KV to a decode engine, which loads it and generates (docs/architecture.md "Prefill/decode
disaggregation"). ``PdPlanner.plan`` chooses both engines from the routing core's state, on
the core's clock, with no I/O:

- decode: among the decode-capable instances (roles ``decode`` and ``both``), the one with
  room for the request's KV and the least decode load (running plus waiting requests); a
  cached prefix there is worth up to one request of load (a full hit), so a later turn of a
  conversation returns to the engine that decoded the earlier one unless it is busier;
- prefill: the core's scorer (kv_ttft: prefix hit and load, estimated TTFT) over the
  prefill-capable instances (``prefill`` and ``both``);
- conditional disaggregation, priced by the TTFT estimate: the request runs whole on its
  decode engine (colocated) when its uncached part is short, at most
  ``max_local_prefill_tokens`` (Dynamo's ``max_local_prefill_length`` plays this part), and
  the estimate of running it there is no worse than prefill + transfer + the decode engine's
  first step; or, however long, when the split would take more than ``overload_factor`` times
  the colocated estimate (the prefill pool is backed up: Dynamo caps its prefill queue for
  the same reason). Otherwise it is split. An idle cluster always prices colocation sooner
  (no hand-over), so the estimate alone would never split; the split exists for the decode
  engine's other sequences, which a long prefill there would stall (the TPOT that PD
  protects).

The TTFT estimates come from each instance's latency model (its pool's profile) and its live
load view, as kv_ttft prices them; the KV hand-over is priced by ``TransferModel``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachemap import Match
from engines.base import DEFAULT_TRANSFER_GBPS, DEFAULT_TRANSFER_LATENCY_MS
from router.placement import (
    InstanceView,
    NoInstanceError,
    Placement,
    PlacementRequest,
    Scorer,
    cached_tokens,
    kv_fits,
    profile_ttft,
)
from router.pools import DECODE_ROLES, PREFILL_ROLES, Role


@dataclass(frozen=True, slots=True)
class TransferModel:
    """Seconds to hand ``tokens`` tokens of KV from a prefill engine to a decode engine."""

    kv_bytes_per_token: int
    gbps: float = DEFAULT_TRANSFER_GBPS
    latency_s: float = DEFAULT_TRANSFER_LATENCY_MS / 1e3

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {self.kv_bytes_per_token}")
        if not self.gbps > 0:
            raise ValueError(f"transfer gbps must be > 0, got {self.gbps}")
        if self.latency_s < 0:
            raise ValueError(f"transfer latency must be >= 0, got {self.latency_s}")

    def seconds(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.latency_s + tokens * self.kv_bytes_per_token / (self.gbps * 1e9)


@dataclass(frozen=True, slots=True)
class PdPlan:
    """Where a request runs: ``decode`` alone (colocated: ``prefill`` is None), or its prompt on
    ``prefill`` first, ``transfer_tokens`` of KV handed to ``decode``."""

    decode: Placement
    prefill: Placement | None = None
    transfer_tokens: int = 0
    estimated_ttft_s: float | None = None  # of the plan taken
    colocated_ttft_s: float | None = None  # had it run whole on ``decode``
    reason: str = ""  # why colocated or split (placement records, metrics)

    def record(self) -> dict[str, Any]:
        """The plan as a JSON-able dict (the placement log's ``pd`` entry)."""
        return {
            "decode": self.decode.instance_id,
            "prefill": self.prefill.instance_id if self.prefill is not None else None,
            "transfer_tokens": self.transfer_tokens,
            "estimated_ttft_s": self.estimated_ttft_s,
            "colocated_ttft_s": self.colocated_ttft_s,
            "reason": self.reason,
        }


class PdPlanner:
    def __init__(
        self,
        transfer: TransferModel,
        max_local_prefill_tokens: int,
        overload_factor: float | None,
    ) -> None:
        """``max_local_prefill_tokens`` and ``overload_factor``: ``RouterSettings``'
        ``pd_max_local_prefill_tokens`` and ``pd_overload_factor`` (``RouterSettings.pd_planner``
        builds the planner with them); ``overload_factor`` None: a long prompt is always split."""
        if max_local_prefill_tokens < 0:
            raise ValueError(
                f"max_local_prefill_tokens must be >= 0, got {max_local_prefill_tokens}"
            )
        if overload_factor is not None and not overload_factor >= 1:
            raise ValueError(f"overload_factor must be >= 1, got {overload_factor}")
        self.transfer = transfer
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.overload_factor = overload_factor

    def plan(
        self,
        scorer: Scorer,
        role: Callable[[str], Role],
        request: PlacementRequest,
        views: Sequence[InstanceView],
        match: Mapping[str, Match],
        colocate: bool = False,
    ) -> PdPlan:
        """Both legs of ``request`` over ``views`` (the candidates' load views, as the core
        built them) and the cache map's ``match`` for its blocks; ``role`` tells each
        instance's role (its pool's) and ``scorer`` places the prefill leg. ``colocate``: no
        prefill leg (a re-run after a failed hand-over recomputes the prompt on a decode
        engine). Raises ``NoInstanceError``
        when no healthy decode-capable instance is among ``views``; with no prefill-capable
        one, the request runs colocated."""
        views = [v for v in views if v.healthy]
        roles = {v.instance_id: role(v.instance_id) for v in views}
        decoders = [v for v in views if roles[v.instance_id] in DECODE_ROLES]
        if not decoders:
            raise NoInstanceError("no decode engine available")
        d, d_cached = self._decoder(request, decoders, match)
        d_tokens = cached_tokens(request.prompt_tokens, d_cached, d.block_size)
        uncached = request.prompt_tokens - d_tokens
        colocated, _ = profile_ttft(request, d, match.get(d.instance_id))
        decode = Placement(d.instance_id, estimated_ttft_s=colocated, cached_blocks=d_cached)
        prefillers = [
            v
            for v in views
            if roles[v.instance_id] in PREFILL_ROLES and v.instance_id != d.instance_id
        ]
        if colocate or not prefillers or uncached <= 0:
            why = "re-run" if colocate else "no prefill engine" if not prefillers else "cached"
            return PdPlan(decode, None, 0, colocated, colocated, why)
        prefill = scorer.place(request, prefillers, match)
        p_ttft = prefill.estimated_ttft_s
        if p_ttft is None:  # a scorer without an estimate: price it as kv_ttft would
            p = next(v for v in prefillers if v.instance_id == prefill.instance_id)
            p_ttft, _ = profile_ttft(request, p, match.get(p.instance_id))
        # after the hand-over the decode engine computes the prompt's last token itself
        first_step = d.latency.ttft_s(
            request.prompt_tokens,
            request.prompt_tokens - 1,
            queued=d.pending_prefill_tokens,
            queued_requests=d.waiting,
        )
        split = p_ttft + self.transfer.seconds(uncached) + first_step
        if uncached <= self.max_local_prefill_tokens and colocated <= split:
            return PdPlan(decode, None, 0, colocated, colocated, "short")
        if self.overload_factor is not None and split > self.overload_factor * colocated:
            return PdPlan(decode, None, 0, colocated, colocated, "split too slow")
        decode = Placement(d.instance_id, estimated_ttft_s=split, cached_blocks=d_cached)
        return PdPlan(decode, prefill, uncached, split, colocated, "split")

    @staticmethod
    def _decoder(
        request: PlacementRequest, views: list[InstanceView], match: Mapping[str, Match]
    ) -> tuple[InstanceView, int]:
        """The decode instance: room for the request's KV first, then the least decode load,
        a full prefix hit counting as one request less; ties go to the first in view order."""
        total = max(1, len(request.block_hashes))
        best: tuple[tuple[bool, float], InstanceView, int] | None = None
        for v in views:
            m = match.get(v.instance_id)
            cached = m.total_blocks if m is not None else 0
            key = (not kv_fits(request, v, cached), v.running + v.waiting - cached / total)
            if best is None or key < best[0]:
                best = (key, v, cached)
        assert best is not None
        return best[1], best[2]
