"""Dispatch: place a request, stream it from the chosen engine, fail over before the first token.

Independent of HTTP: the ingress turns a validated body into a ``RoutedRequest`` and iterates
``Dispatcher.stream``. The engine side is an ``EngineClient`` (Ray Serve handle in production,
engines in-process in the router benchmark).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from engines.base import EngineError, EngineOutput, KvCommand, RoutedRequest
from router.placement import Placement, PlacementRequest
from router.state import RouterState

log = logging.getLogger(__name__)


class EngineClient(Protocol):
    def stream(self, routed: RoutedRequest) -> AsyncIterator[EngineOutput]:
        """Outputs of ``routed`` from ``routed.target_instance``; raises on engine failure."""
        ...

    async def command(self, command: KvCommand) -> dict[str, Any]:
        """Carry out ``command`` on ``command.target_instance``; raises ``EngineError``."""
        ...

    def isolate(self) -> None:
        """Make the engine calls of the current asyncio task a request of their own. Call it
        first in each task of a fan-out (one client request sent to several engines at once)."""
        ...


def request_for_placement(routed: RoutedRequest) -> PlacementRequest:
    r = routed.request
    return PlacementRequest(
        r.request_id,
        len(r.prompt_token_ids),
        routed.block_hashes,
        max_tokens=r.sampling.max_tokens,
        session_key=routed.session_key,
        category=routed.category,
    )


class StreamBroken(Exception):
    """The engine failed after the first token: the response cannot be retried."""


class Dispatcher:
    def __init__(
        self,
        state: RouterState,
        client: EngineClient,
        max_attempts: int = 3,
        pre_place: bool = True,
    ) -> None:
        """``pre_place=False`` leaves placement to the engine handle's own request router (Ray's
        PrefixCacheAffinityRouter as a peer): no estimate, so no SLO gate either."""
        self.state = state
        self.client = client
        self.max_attempts = max_attempts
        self.pre_place = pre_place
        self.failovers = 0
        self.overrides = 0  # requests an engine reported running off their placement

    def placement_request(self, routed: RoutedRequest) -> PlacementRequest:
        return request_for_placement(routed)

    def place(
        self, preq: PlacementRequest, exclude: set[str], waited_s: float = 0.0
    ) -> Placement | None:
        """Place and apply the SLO gate to the estimate plus ``waited_s`` (time the request
        already spent in admission's queue; raises ``Rejected``, or ``NoInstanceError`` when no
        engine is left to try); None without pre-placement."""
        if not self.pre_place:
            return None
        placement = self.state.place(preq, exclude=exclude)
        estimate = placement.estimated_ttft_s
        self.state.admission.check_slo(estimate + waited_s if estimate is not None else None)
        return placement

    async def stream(
        self, routed: RoutedRequest, first: Placement | None = None
    ) -> AsyncIterator[tuple[Placement, EngineOutput]]:
        """Yield ``(placement, output)``; retries on another instance while nothing was sent."""
        preq = self.placement_request(routed)
        tried: set[str] = set()
        placement = first or self.place(preq, tried)
        attempt = 0
        while True:
            attempt += 1
            # NOTE: without pre-placement the handle's own router picks; we learn nothing of it.
            where = placement.instance_id if placement is not None else "?"
            routed.target_instance = placement.instance_id if placement is not None else None
            routed.request.expected_cached_tokens = (
                self.state.cached_tokens(preq, placement) if placement is not None else 0
            )
            if placement is not None:
                self.state.assigned(preq, placement)
            started = False
            try:
                async for out in self.client.stream(routed):
                    if not started:
                        started = True
                        self.state.first_token(preq.request_id)
                        if (
                            placement is not None
                            and out.instance_id is not None
                            and out.instance_id != placement.instance_id
                        ):
                            # Serve's request router delivered it elsewhere than placed.
                            self.overrides += 1
                    yield placement or Placement(where), out
                return
            except (EngineError, ConnectionError, OSError) as e:
                if placement is not None:
                    self.state.failed(placement.instance_id)
                if started:
                    raise StreamBroken(f"engine {where} failed: {e}") from e
                tried.add(where)
                if attempt >= self.max_attempts:
                    raise
                log.warning("engine %s failed before the first token, retrying: %s", where, e)
                self.failovers += 1
                placement = self.place(preq, tried)
            finally:
                if placement is not None:
                    self.state.finished(preq, placement.instance_id)
