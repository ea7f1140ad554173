"""One request's lifecycle, in one place: the ingress's dispatcher and the cluster simulator both
call it, so the simulator that ranks routers runs the requests production runs.

- ``admit``: place a request and apply the SLO gate to the placement's estimate plus the time it
  already waited (admission's queue), in that order (a 429 names the estimate).
- The legs of a request and their ids: the ``n`` choices of one request are child requests
  ``"{i}_{id}"`` (``choice_requests``, vLLM's rule for its own children); a disaggregated
  request's prefill leg is ``"{id}-prefill"`` (``prefill_leg``: one token, answered whole,
  ``do_remote_decode``), whose engine's ``kv_transfer_params`` go with the request to its decode
  engine (``handed_over``, the router's hints kept); a request whose engine failed after its
  first token goes on as ``"{id}-leg{k}"`` (``continuation``: the prompt plus the tokens so far,
  for the tokens still owed).

Pure: no I/O, no clock reads (``now`` is an argument), no engine calls; the order of a request's
events (assigned, first token, finished) is the caller's, as the core's ``assigned`` /
``first_token`` / ``finished`` document it.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import msgspec

from engines.base import RoutedRequest
from policies.hints import HINTS_KEY, PolicyHints
from router.admission import Admission
from router.placement import Placement, PlacementRequest

PREFILL_SUFFIX = "-prefill"  # a split request's prefill leg is request ``<id>-prefill``
# what a prefill leg adds to its ``kv_transfer_params`` (vLLM's contract: compute the prompt,
# keep its KV for a decode engine to pull, answer one token)
PREFILL_PARAMS: Mapping[str, bool] = {"do_remote_decode": True, "do_remote_prefill": False}


class Router(Protocol):
    """What ``admit`` needs of a routing core (``RouterCore``, or ``RouterState`` around one)."""

    @property
    def admission(self) -> Admission: ...

    def place(
        self,
        request: PlacementRequest,
        *,
        now: float,
        exclude: Iterable[str] = ...,
        rerun: bool = ...,
    ) -> Placement: ...


def admit(
    router: Router,
    request: PlacementRequest,
    now: float,
    waited_s: float = 0.0,
    *,
    gate: bool = True,
    exclude: Iterable[str] = (),
    rerun: bool = False,
) -> Placement:
    """Place ``request`` at ``now`` (minus the instances in ``exclude``; ``rerun``: a failover,
    whole on a decode-capable engine) and, with ``gate``, refuse it (``Rejected``) when its
    estimate plus ``waited_s`` already breaks the TTFT SLO; raises ``NoInstanceError`` when no
    instance is left. An accepted request that fails over is placed again without the gate: it
    is served, not refused halfway."""
    placement = router.place(request, now=now, exclude=exclude, rerun=rerun)
    if gate:
        estimate = placement.estimated_ttft_s
        router.admission.check_slo(estimate + waited_s if estimate is not None else None)
    return placement


def prefill_leg_id(request_id: str) -> str:
    return request_id + PREFILL_SUFFIX


def request_of_prefill_leg(leg_id: str) -> str:
    """The request whose prefill leg is ``leg_id``."""
    return leg_id.removesuffix(PREFILL_SUFFIX)


def prefill_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """A prefill leg's ``kv_transfer_params``: the request's (the router's hints) plus
    ``PREFILL_PARAMS``."""
    return {**(params or {}), **PREFILL_PARAMS}


def with_pool_load(params: Mapping[str, Any] | None, load: bool) -> dict[str, Any]:
    """``params`` with the router's ``pool_load`` hint (``PolicyHints.pool_load``) in its hints
    entry, the other hints kept."""
    hints = PolicyHints.from_params(params) or PolicyHints()
    return msgspec.structs.replace(hints, pool_load=load).merged_into(params)


def handed_over(request: Mapping[str, Any] | None, engine: Mapping[str, Any]) -> dict[str, Any]:
    """The decode leg's ``kv_transfer_params``: what the prefill engine returned (``engine``,
    unchanged, vLLM's contract) over what the request carried, the router's own hints (under
    ``HINTS_KEY``) kept as the request had them."""
    params = {**(request or {}), **engine}
    hints = (request or {}).get(HINTS_KEY)
    if hints is not None:
        params[HINTS_KEY] = hints
    return params


def prefill_leg(routed: RoutedRequest) -> RoutedRequest:
    """The prefill leg of ``routed``: request ``<id>-prefill``, one token, answered whole, with
    ``PREFILL_PARAMS`` added to its ``kv_transfer_params``."""
    r = routed.request
    sampling = msgspec.structs.replace(r.sampling, max_tokens=1, min_tokens=0)
    request = msgspec.structs.replace(
        r,
        request_id=prefill_leg_id(r.request_id),
        sampling=sampling,
        stream=False,
        kv_transfer_params=prefill_params(r.kv_transfer_params),
    )
    return msgspec.structs.replace(routed, request=request, target_instance=None)


def decode_leg(routed: RoutedRequest, engine_params: Mapping[str, Any]) -> RoutedRequest:
    """``routed`` for its decode engine, carrying what its prefill engine returned."""
    params = handed_over(routed.request.kv_transfer_params, engine_params)
    request = msgspec.structs.replace(routed.request, kv_transfer_params=params)
    return msgspec.structs.replace(routed, request=request)


def continuation(routed: RoutedRequest, generated: list[int], leg: int) -> RoutedRequest | None:
    """Leg ``leg`` (2, 3 ...) of ``routed`` after ``generated`` tokens: its prompt plus those
    tokens, for the tokens still owed (None: none is), as request ``<id>-leg<leg>``. Placement
    keeps the prompt's block hashes (the generated tail is cached nowhere else)."""
    r, sampling = routed.request, routed.request.sampling
    left = sampling.max_tokens - len(generated)
    if left < 1:
        return None
    owed = msgspec.structs.replace(
        sampling, max_tokens=left, min_tokens=max(0, sampling.min_tokens - len(generated))
    )
    request = msgspec.structs.replace(
        r,
        request_id=f"{r.request_id}-leg{leg}",
        prompt_token_ids=[*r.prompt_token_ids, *generated],
        sampling=owed,
    )
    return msgspec.structs.replace(routed, request=request, target_instance=None)


def choice_requests(routed: RoutedRequest, n: int) -> list[RoutedRequest]:
    """The engine requests of ``n`` choices of ``routed``: ``routed`` itself for one; for more,
    copies with ids ``"{i}_{id}"`` and seeds ``seed + i`` (vLLM's rule for its own ``n``
    children), from a random seed when the request has none (so that choices differ on every
    engine, the sim's prompt-derived default seed included)."""
    if n == 1:
        return [routed]
    r = routed.request
    base = r.sampling.seed if r.sampling.seed is not None else secrets.randbits(62)
    return [
        msgspec.structs.replace(
            routed,
            request=msgspec.structs.replace(
                r,
                request_id=f"{i}_{r.request_id}",
                sampling=msgspec.structs.replace(r.sampling, seed=base + i),
            ),
        )
        for i in range(n)
    ]
