"""Dispatch: place a request, stream it from the chosen engine, retry it elsewhere before the
first token and migrate it after.

Independent of HTTP: the ingress turns a validated body into a ``RoutedRequest`` and iterates
``Dispatcher.stream`` (through ``ChoiceStreams``: one engine request per choice of ``n``). The
engine side is an ``EngineClient`` (Ray Serve handle in production, engines in-process in the
router benchmark).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import msgspec
from opentelemetry import trace

from engines.base import EngineError, EngineOutput, KvCommand, RoutedRequest, Usage, whole
from policies.hints import PolicyHints, TransferReport
from router import lifecycle, tracing
from router.placement import NoInstanceError, Placement, PlacementRequest, placement_request
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


def request_for_placement(routed: RoutedRequest, block_size: int) -> PlacementRequest:
    r = routed.request
    return placement_request(
        r.request_id,
        len(r.prompt_token_ids),
        routed.block_hashes,
        block_size,
        r.sampling.max_tokens,
        routed.session_key,
        routed.category,
    )


@dataclass(slots=True)
class PdStats:
    """What one dispatcher saw of prefill/decode disaggregation (``router.metrics`` exports it).

    Requests: ``split`` handed from a prefill to a decode engine, ``colocated`` run whole on a
    decode engine (conditional disaggregation), ``recomputed`` hand-overs that failed and were
    recomputed on a decode engine. Prefill legs that handed KV over: ``prefill_s`` seconds in
    all, ``handed_tokens`` prompt tokens planned to be handed over. What decode engines measured
    of their pulls (``TransferReport``): ``pulls`` (``pull_failures`` of them failed),
    ``pull_bytes``, ``pull_s`` and ``decode_prompt_tokens`` (prompt tokens the decode engines
    computed themselves)."""

    split: int = 0
    colocated: int = 0
    recomputed: int = 0
    prefill_s: float = 0.0
    handed_tokens: int = 0
    pulls: int = 0
    pull_failures: int = 0
    pull_bytes: int = 0
    pull_s: float = 0.0
    decode_prompt_tokens: int = 0

    def pulled(self, report: TransferReport) -> None:
        """Count a decode engine's report of one pull."""
        self.pulls += 1
        self.pull_failures += not report.ok
        self.pull_bytes += report.bytes
        self.pull_s += report.seconds
        self.decode_prompt_tokens += report.prompt_tokens_computed or 0


@dataclass(slots=True)
class _Progress:
    """Where one ``Dispatcher.stream`` stands: the engine request running now (``current``:
    ``routed`` itself, a decode leg or a migrated leg), its placement request and placement,
    the instances tried, this leg's tries, the legs so far, and every token yielded."""

    routed: RoutedRequest
    preq: PlacementRequest
    placement: Placement | None = None
    current: RoutedRequest = field(init=False)
    tried: set[str] = field(default_factory=set)
    attempt: int = 0
    legs: int = 1
    generated: list[int] = field(default_factory=list)  # tokens yielded so far, over every leg

    def __post_init__(self) -> None:
        self.current = self.routed


class StreamBroken(Exception):
    """The engines failed after the first token more times than a request may migrate."""


class Dispatcher:
    def __init__(
        self,
        state: RouterState,
        client: EngineClient,
        max_attempts: int = 3,
        pre_place: bool = True,
        max_migrations: int = 2,
    ) -> None:
        """``max_attempts``: tries of a request that failed before its first token;
        ``max_migrations``: moves of one that failed after it (see ``stream``).
        ``pre_place=False`` leaves placement to the engine handle's own request router (Ray's
        PrefixCacheAffinityRouter as a peer): no estimate, so no SLO gate either."""
        self.state = state
        self.client = client
        self.max_attempts = max_attempts
        self.pre_place = pre_place
        self.max_migrations = max_migrations
        self.failovers = 0
        self.migrations = 0  # requests moved to another engine after their first token
        self.overrides = 0  # requests an engine reported running off their placement
        self.pd = PdStats()

    def placement_request(self, routed: RoutedRequest) -> PlacementRequest:
        return request_for_placement(routed, self.state.block_size)

    def place(
        self,
        preq: PlacementRequest,
        exclude: set[str],
        waited_s: float = 0.0,
        gate: bool = True,
        rerun: bool = False,
    ) -> Placement | None:
        """Place and, with ``gate``, apply the SLO gate to the estimate plus ``waited_s`` (time
        the request already spent in admission's queue; raises ``Rejected``); raises
        ``NoInstanceError`` when no engine is left to try. None without pre-placement.
        ``rerun``: a failover (with prefill/decode pools: whole on a decode engine)."""
        if not self.pre_place:
            return None
        state = self.state
        placement = lifecycle.admit(
            state, preq, state.clock(), waited_s, gate=gate, exclude=exclude, rerun=rerun
        )
        if state.disaggregated and not rerun:
            if placement.prefill is not None:
                self.pd.split += 1
            else:
                self.pd.colocated += 1
        return placement

    async def stream(
        self, routed: RoutedRequest, first: Placement | None = None
    ) -> AsyncGenerator[tuple[Placement, EngineOutput], None]:
        """Yield ``(placement, output)`` as one stream whatever fails underneath. An engine that
        fails before the first token: the request is retried on another instance (up to
        ``max_attempts`` tries). One that fails after it: the request migrates (Dynamo calls it
        so): the prompt plus the tokens already yielded go to another instance as a new engine
        request for the tokens still owed, up to ``max_migrations`` times; only then
        ``StreamBroken``. The final output's usage counts the client's prompt and every token
        of every leg."""
        p = _Progress(routed, self.placement_request(routed))
        p.placement = first or self.place(p.preq, p.tried)
        while True:
            p.attempt += 1
            # NOTE: without pre-placement the handle's own router picks; we learn nothing of it.
            where = p.placement.instance_id if p.placement is not None else "?"
            await self._start_leg(p)
            # NOTE: a failover replaces ``p.placement`` and ``p.preq`` before ``finally``
            running, running_preq = p.placement, p.preq
            started = False
            leg_span = self._leg_span(p.placement)
            outs = self.client.stream(p.current)
            try:
                async for out in outs:
                    if not started:
                        started = True
                        self._first_output(p, out)
                    yield p.placement or Placement(where), self._counted(p, out)
                return
            except (EngineError, ConnectionError, OSError) as e:
                if p.placement is not None:
                    self.state.failed(p.placement.instance_id)
                p.tried.add(where)
                if not p.generated and p.attempt >= self.max_attempts:
                    raise
                final = self._recover(p, where, e)
                if final is not None:  # it failed with every owed token already yielded
                    yield p.placement or Placement(where), final
                    return
            finally:
                # closed early (its choice was stopped): close the engine's stream now, not
                # whenever it is collected, so that the engine aborts the request at once
                close = getattr(outs, "aclose", None)
                if close is not None:
                    await close()
                if running is not None:
                    self.state.finished(running_preq, running.instance_id)
                if leg_span is not None:
                    leg_span.end()

    async def _start_leg(self, p: _Progress) -> None:
        """Aim ``p.current`` at ``p.placement`` and count it assigned there. A split placement
        runs its prefill leg first: ``p.current`` becomes the decode leg it hands over to, or,
        when no prefill engine could do it, the request is recomputed whole on the decoder."""
        placement, current = p.placement, p.current
        current.target_instance = placement.instance_id if placement is not None else None
        current.request.expected_cached_tokens = (
            self.state.cached_tokens(p.preq, placement) if placement is not None else 0
        )
        load = placement.detail.get("pool_load") if placement is not None else None
        if load is not None:  # kv_ttft's hint where there is a KV pool
            req = current.request
            req.kv_transfer_params = lifecycle.with_pool_load(req.kv_transfer_params, bool(load))
        if placement is not None and placement.prefill is not None:
            handed = await self._prefill(current, p.preq, placement)
            if handed is None:  # no prefill engine could do it: recompute on the decoder
                placement = p.placement = replace(placement, prefill=None, transfer_tokens=0)
                self.pd.recomputed += 1
            else:
                p.current = handed
            p.current.target_instance = placement.instance_id
        if placement is not None:
            self.state.assigned(p.preq, placement)

    def _leg_span(self, placement: Placement | None) -> trace.Span | None:
        """A disaggregated request's decode leg gets a span of its own beside the prefill's
        (None: not disaggregated, or tracing is off)."""
        if placement is not None and self.state.disaggregated and tracing.tracing_on():
            return tracing.tracer.start_span(
                "kvroute.decode_leg", attributes={"kvroute.instance": placement.instance_id}
            )
        return None

    def _first_output(self, p: _Progress, out: EngineOutput) -> None:
        """A leg's first output: its first token observed, and counted as an override if the
        engine reports running it off its placement."""
        self.state.first_token(p.preq.request_id, p.current.request.stream)
        if (
            p.placement is not None
            and out.instance_id is not None
            and out.instance_id != p.placement.instance_id
        ):
            # Serve's request router delivered it elsewhere than placed.
            self.overrides += 1

    def _counted(self, p: _Progress, out: EngineOutput) -> EngineOutput:
        """``out`` as the client sees it (a later leg's usage is the whole request's), its
        tokens counted as yielded and its pull report, if any, counted."""
        if out.finished and out.kv_transfer_params:
            self._pulled(out.kv_transfer_params)
        if p.current is not p.routed and out.usage is not None:
            out = _leg_usage(out, p.routed, len(p.generated) + len(out.token_ids))
        p.generated.extend(out.token_ids)
        return out

    def _recover(self, p: _Progress, where: str, e: Exception) -> EngineOutput | None:
        """After the engine at ``where`` failed with ``e`` (a retry is still allowed): ``p``
        re-placed, migrating the request after its first token (``StreamBroken`` past
        ``max_migrations``) or retrying it before. Returns the final output instead when every
        owed token was already yielded."""
        if p.generated:
            if p.legs > self.max_migrations:
                raise StreamBroken(f"engine {where} failed: {e}") from e
            log.warning(
                "engine %s failed after %d tokens, migrating: %s", where, len(p.generated), e
            )
            p.legs += 1
            leg = lifecycle.continuation(p.routed, p.generated, p.legs)
            if leg is None:
                return _finished(p.routed, p.generated)
            self.migrations += 1
            p.current = leg
            p.preq = self.placement_request(leg)
            p.attempt = 0
        else:
            log.warning("engine %s failed before the first token, retrying: %s", where, e)
            self.failovers += 1
            if p.current is not p.routed:  # the hand-over or decode failed
                p.current, p.preq = p.routed, self.placement_request(p.routed)
                self.pd.recomputed += 1
        # NOTE: no SLO gate: the request was admitted, and an accepted request is
        # served (only NoInstanceError, with no instance left, ends it here)
        p.placement = self.place(p.preq, p.tried, gate=False, rerun=True)
        return None

    async def _prefill(
        self, routed: RoutedRequest, preq: PlacementRequest, placement: Placement
    ) -> RoutedRequest | None:
        """The prefill leg of a disaggregated request: the prompt on ``placement.prefill`` with
        ``max_tokens=1`` and ``do_remote_decode``, retried on another prefill engine when one
        fails. Returns ``routed`` for the decode engine, carrying what the prefill engine
        returned in ``kv_transfer_params`` (unchanged, the router's hints merged in); None when
        no prefill engine could do it or the engine returned no parameters (the decode engine
        then computes the prompt itself)."""
        prefill: Placement | None = placement.prefill
        tried: set[str] = set()
        leg = lifecycle.prefill_leg(routed)
        leg_preq = self.placement_request(leg)
        started = time.monotonic()
        while prefill is not None:
            iid = prefill.instance_id
            leg.target_instance = iid
            leg.request.expected_cached_tokens = self.state.cached_tokens(leg_preq, prefill)
            self.state.assigned(leg_preq, prefill)
            try:
                with tracing.span("kvroute.prefill_leg") as span:
                    span.set_attribute("kvroute.instance", iid)
                    span.set_attribute("kvroute.transfer_tokens", placement.transfer_tokens)
                    out = await whole(self.client.stream(leg))
                self.state.first_token(leg_preq.request_id)  # one token: its TTFT, observed
            except (EngineError, ConnectionError, OSError) as e:
                log.warning("prefill engine %s failed, retrying: %s", iid, e)
                self.state.failed(iid)
                tried.add(iid)
                prefill = self._next_prefill(leg_preq, tried)
                continue
            finally:
                self.state.finished(leg_preq, iid)
            if not out.kv_transfer_params:
                log.warning(
                    "prefill engine %s returned no kv_transfer_params: is its KV connector "
                    "configured? recomputing on the decode engine",
                    prefill.instance_id,
                )
                return None
            self.pd.prefill_s += time.monotonic() - started
            self.pd.handed_tokens += placement.transfer_tokens
            return lifecycle.decode_leg(routed, out.kv_transfer_params)
        return None

    def _pulled(self, params: dict[str, Any]) -> None:
        """Count a decode engine's report of its pull (``PolicyHints.transfer``), if its output
        carries one; a malformed one is logged and not counted."""
        try:
            hints = PolicyHints.from_params(params)
        except ValueError as e:
            log.warning("engine output with unreadable hints, its pull not counted: %s", e)
            return
        if hints is not None and hints.transfer is not None:
            self.pd.pulled(hints.transfer)

    def _next_prefill(self, preq: PlacementRequest, tried: set[str]) -> Placement | None:
        """Another prefill engine for a prefill leg whose engine failed (None: none is left)."""
        try:
            again = self.state.place(preq, exclude=tried)
        except NoInstanceError:
            return None
        return again.prefill


def _leg_usage(out: EngineOutput, routed: RoutedRequest, completion: int) -> EngineOutput:
    """A migrated leg's final output, its usage as the client's request sees it: the client's
    prompt, every leg's tokens, and at most the prompt as cached."""
    assert out.usage is not None
    prompt = len(routed.request.prompt_token_ids)
    usage = Usage(prompt, completion, min(out.usage.cached_tokens, prompt))
    return msgspec.structs.replace(out, usage=usage)


def _finished(routed: RoutedRequest, generated: list[int]) -> EngineOutput:
    """The final output of a request whose engine failed after its last owed token."""
    prompt = len(routed.request.prompt_token_ids)
    cached = min(routed.request.expected_cached_tokens, prompt)
    return EngineOutput(
        routed.request.request_id,
        [],
        finished=True,
        finish_reason="length",
        usage=Usage(prompt, len(generated), cached),
    )


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
