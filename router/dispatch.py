"""Dispatch: place a request, stream it from the chosen engine, fail over before the first token.

Independent of HTTP: the ingress turns a validated body into a ``RoutedRequest`` and iterates
``Dispatcher.stream`` (through ``ChoiceStreams``: one engine request per choice of ``n``). The
engine side is an ``EngineClient`` (Ray Serve handle in production, engines in-process in the
router benchmark).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
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
            running = placement  # NOTE: a failover replaces ``placement`` before ``finally``
            started = False
            outs = self.client.stream(routed)
            try:
                async for out in outs:
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
                # closed early (its choice was stopped): close the engine's stream now, not
                # whenever it is collected, so that the engine aborts the request at once
                close = getattr(outs, "aclose", None)
                if close is not None:
                    await close()
                if running is not None:
                    self.state.finished(preq, running.instance_id)


class ChoiceStreams:
    """The engine streams of one request's choices (``n`` engine requests, one per choice,
    all sent where ``first`` placed the first), merged: ``items()`` yields ``(index, placement,
    output)`` as outputs arrive. ``stop(index)`` ends that choice's engine request (the engine
    aborts it) and the others go on; ``close()`` ends them all.

    One choice is iterated directly (``stop`` closes its stream). Several each run in a task of
    their own (``EngineClient.isolate`` first), so that ``stop`` cancels exactly that one; a
    stream's failure is raised from ``items()``, which then cancels the rest."""

    def __init__(
        self, dispatcher: Dispatcher, children: list[RoutedRequest], first: Placement | None
    ) -> None:
        self._dispatcher, self._children, self._first = dispatcher, children, first
        self._items: AsyncGenerator[tuple[int, Placement, EngineOutput], None] | None = None
        self._queue: asyncio.Queue[tuple[int, Placement | None, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._open: set[int] = set()

    def items(self) -> AsyncIterator[tuple[int, Placement, EngineOutput]]:
        if self._items is None:
            self._items = self._one() if len(self._children) == 1 else self._merged()
        return self._items

    async def _one(self) -> AsyncGenerator[tuple[int, Placement, EngineOutput], None]:
        stream = self._dispatcher.stream(self._children[0], self._first)
        try:
            async for placement, out in stream:
                yield 0, placement, out
        finally:
            await stream.aclose()

    async def _pump(self, index: int) -> None:
        self._dispatcher.client.isolate()
        try:
            async for placement, out in self._dispatcher.stream(self._children[index], self._first):
                self._queue.put_nowait((index, placement, out))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._queue.put_nowait((index, None, e))
        else:
            self._queue.put_nowait((index, None, None))

    async def _merged(self) -> AsyncGenerator[tuple[int, Placement, EngineOutput], None]:
        self._open = set(range(len(self._children)))
        self._tasks = [
            asyncio.create_task(self._pump(i), name=f"kvroute-choice-{i}")
            for i in range(len(self._children))
        ]
        try:
            while self._open:
                index, placement, item = await self._queue.get()
                if index not in self._open:
                    continue  # stopped: what it still sent is dropped
                if placement is None:
                    self._open.discard(index)
                    if item is not None:
                        raise item
                    continue
                yield index, placement, item
        finally:
            await self._cancel()

    async def stop(self, index: int) -> None:
        """Choice ``index`` needs nothing more (a stop string ended it here): abort its engine
        request."""
        if len(self._children) == 1:
            await self.close()
        else:
            self._open.discard(index)
            self._tasks[index].cancel()

    async def _cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        if self._items is not None:
            await self._items.aclose()
        await self._cancel()
