"""Running a validated chat or completions request: prepare, admit, place, stream its choices
from the engines and answer, as one JSON body or as server-sent events. A completions body
with several prompts runs as vLLM's batch (``Completions.batch``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from engines.base import EngineOutput, RoutedRequest
from router import tracing
from router.admission import Ticket
from router.api import ChatCompletionRequest, CompletionRequest
from router.api_errors import APIError
from router.dispatch import ChoiceStreams, Dispatcher, StreamBroken
from router.lifecycle import choice_requests
from router.metrics import RouterMetrics
from router.placement import Placement
from router.prepare import RequestPreparer
from router.responses import ResponseBuilder
from router.tokenizer import PromptTokenizer


class Completions:
    """The engine side of the OpenAI completion endpoints, one object per app: a validated body
    prepared (``RequestPreparer``), admitted, placed, dispatched, and answered. Admission's
    refusals raise ``Rejected``; a request no engine could serve raises before the 200."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        tokenizer: PromptTokenizer,
        prepare: RequestPreparer,
        metrics: RouterMetrics,
    ) -> None:
        self.dispatcher, self.tokenizer = dispatcher, tokenizer
        self.prepare, self.metrics = prepare, metrics

    async def single(
        self,
        request: Request,
        req: ChatCompletionRequest | CompletionRequest,
        chat: bool,
        namespace: str | None = None,
    ) -> Response:
        """A request with one prompt: its ``n`` choices, all where the first was placed, taking
        ``n`` admission slots (each choice is an engine request). ``namespace``: the client
        key's cache namespace (``router.keys``)."""
        dispatcher, metrics = self.dispatcher, self.metrics
        with tracing.span("kvroute.ingress", request.headers) as span:
            routed, response_id = await self.prepare(request, req, namespace=namespace)
            prompt_ids = routed.request.prompt_token_ids
            span.set_attribute("kvroute.prompt_tokens", len(prompt_ids))
            children = choice_requests(routed, req.n)
            builder = ResponseBuilder(
                req, chat, self.tokenizer, response_id, len(prompt_ids), prompt_token_ids=prompt_ids
            )
            queued_at = time.monotonic()
            ticket = await dispatcher.state.admission.acquire(len(children))
            metrics.admitted(builder, queued_at, routed.request.stream)
            streams: ChoiceStreams | None = None
            handed_off = False
            try:
                first = self._place_first(children[0], queued_at)
                # every choice goes where the first was placed (vLLM runs n in one engine too)
                streams = ChoiceStreams(dispatcher, children, first)
                items = streams.items()
                if req.stream:
                    # NOTE: the first output comes before the 200: a request the engines refuse
                    # or cannot serve gets its 4xx/5xx, not an error event.
                    head: list[dict[str, Any]] = []
                    async for i, placement, out in items:
                        head = builder.chunks(i, out, placement.instance_id)
                        await _stop_if_ended(streams, builder, i, out)
                        break
                    handed_off = True
                    return StreamingResponse(
                        self._sse(items, streams, head, builder, ticket, children),
                        media_type="text/event-stream",
                        background=BackgroundTask(ticket.release),
                    )
                async for i, placement, out in items:
                    builder.add(i, out, placement.instance_id)
                    await _stop_if_ended(streams, builder, i, out)
                builder.estimate_cached_tokens(children[0].request.expected_cached_tokens)
                metrics.finished(builder)
                return JSONResponse(builder.final())
            finally:
                if not handed_off:
                    if streams is not None:
                        await streams.close()
                    ticket.release()

    def _place_first(self, child: RoutedRequest, queued_at: float) -> Placement | None:
        """Place a request's (or a batch prompt's) first choice, in a span of its own (None
        without pre-placement)."""
        dispatcher = self.dispatcher
        with tracing.span("kvroute.placement") as ps:
            first = dispatcher.place(
                dispatcher.placement_request(child),
                set(),
                waited_s=time.monotonic() - queued_at,  # the client's TTFT counts it
            )
            if first is not None:
                ps.set_attribute("kvroute.instance", first.instance_id)
                ps.set_attribute("kvroute.cached_blocks", first.cached_blocks)
                self.metrics.placed(first)
        return first

    async def _sse(
        self,
        items: AsyncIterator[tuple[int, Any, EngineOutput]],
        streams: ChoiceStreams,
        head: list[dict[str, Any]],
        builder: ResponseBuilder,
        ticket: Ticket,
        children: list[RoutedRequest],
    ) -> AsyncIterator[bytes]:
        try:
            for chunk in head:
                yield _event(chunk)
            with tracing.span("kvroute.engine_call"):
                async for i, placement, out in items:
                    for chunk in builder.chunks(i, out, placement.instance_id):
                        yield _event(chunk)
                    await _stop_if_ended(streams, builder, i, out)
            builder.estimate_cached_tokens(children[0].request.expected_cached_tokens)
            if builder.include_usage:
                yield _event(builder.usage_chunk())
            self.metrics.finished(builder)
        except Exception as e:  # the client already has a 200: end the stream with an error
            self.metrics.errors.labels("stream").inc()
            if isinstance(e, APIError):
                err = e
            else:
                kind = (
                    "engine failed mid-stream" if isinstance(e, StreamBroken) else "stream aborted"
                )
                err = APIError(500, f"{kind}: {e}", type_="server_error")
            yield _event(err.body())
        finally:
            await streams.close()
            ticket.release()
        yield b"data: [DONE]\n\n"

    # -- a batch of prompts ----------------------------------------------------------------

    async def batch(
        self,
        request: Request,
        req: CompletionRequest,
        prompts: list[str | list[int]],
        namespace: str | None = None,
    ) -> Response:
        """A completions body with several prompts, as vLLM's serving_completion runs it: every
        prompt checked first (a 400 before any runs), then admitted together, taking an
        admission slot per engine request (prompts x ``n``), and each placed on its own, all at
        once; prompt ``k``'s choice ``i`` is choice ``k * n + i`` of one response, whose usage
        is the sum. Streamed, chunks interleave as they come and the 200 waits for every
        prompt's first output (an engine's refusal is still a 4xx)."""
        n = req.n
        with tracing.span("kvroute.ingress", request.headers) as span:
            prepared = [await self.prepare(request, req, p, namespace) for p in prompts]
            response_id = prepared[0][1]
            span.set_attribute(
                "kvroute.prompt_tokens",
                sum(len(r.request.prompt_token_ids) for r, _ in prepared),
            )
            queued_at = time.monotonic()
            batch = _Batch(self.dispatcher)
            handed_off = False
            batch.ticket = await self.dispatcher.state.admission.acquire(len(prompts) * n)
            try:
                for routed, _ in prepared:
                    batch.runs.append(self._open(req, routed, response_id, queued_at))
                items = batch.start()
                if req.stream:
                    head = await _batch_head(items, batch.runs, n)
                    handed_off = True
                    return StreamingResponse(
                        self._batch_sse(items, batch.runs, head, batch.close, n),
                        media_type="text/event-stream",
                        background=BackgroundTask(batch.close),
                    )
                return JSONResponse(await self._batch_body(items, batch.runs, n))
            finally:
                if not handed_off:
                    await batch.close()

    def _open(
        self, req: CompletionRequest, routed: RoutedRequest, response_id: str, queued_at: float
    ) -> _Run:
        """One prompt of an admitted batch placed, its engine streams not yet started."""
        prompt_ids = routed.request.prompt_token_ids
        children = choice_requests(routed, req.n)
        builder = ResponseBuilder(
            req, False, self.tokenizer, response_id, len(prompt_ids), prompt_token_ids=prompt_ids
        )
        self.metrics.admitted(builder, queued_at, routed.request.stream)
        first = self._place_first(children[0], queued_at)
        streams = ChoiceStreams(self.dispatcher, children, first)
        return _Run(builder, streams, children[0].request.expected_cached_tokens)

    async def _batch_body(
        self, items: AsyncIterator[tuple[int, Any]], runs: list[_Run], n: int
    ) -> dict[str, Any]:
        """The JSON body of a batch: every prompt's choices, reindexed, and the summed usage."""
        async for k, (i, placement, out) in items:
            run = runs[k]
            run.builder.add(i, out, placement.instance_id)
            await _stop_if_ended(run.streams, run.builder, i, out)
        finals = []
        for run in runs:
            run.builder.estimate_cached_tokens(run.expected_cached_tokens)
            self.metrics.finished(run.builder)
            finals.append(run.builder.final())
        body = finals[0]
        body["choices"] = [
            c | {"index": c["index"] + k * n} for k, f in enumerate(finals) for c in f["choices"]
        ]
        body["usage"] = _summed_usage([f["usage"] for f in finals])
        return body

    async def _batch_sse(
        self,
        items: AsyncIterator[tuple[int, Any]],
        runs: list[_Run],
        head: list[dict[str, Any]],
        close: Callable[[], Awaitable[None]],
        n: int,
    ) -> AsyncIterator[bytes]:
        """``_sse`` for a batch of prompts: one usage chunk at the end, summed."""
        try:
            for chunk in head:
                yield _event(chunk)
            with tracing.span("kvroute.engine_call"):
                async for k, (i, placement, out) in items:
                    run = runs[k]
                    for chunk in _reindexed(
                        run.builder.chunks(i, out, placement.instance_id), k * n
                    ):
                        yield _event(chunk)
                    await _stop_if_ended(run.streams, run.builder, i, out)
            for run in runs:
                run.builder.estimate_cached_tokens(run.expected_cached_tokens)
            if runs[0].builder.include_usage:
                chunk = runs[0].builder.usage_chunk()
                chunk["usage"] = _summed_usage([r.builder.usage() for r in runs])
                yield _event(chunk)
            for run in runs:
                self.metrics.finished(run.builder)
        except Exception as e:  # the client already has a 200: end the stream with an error
            self.metrics.errors.labels("stream").inc()
            err = (
                e
                if isinstance(e, APIError)
                else APIError(500, f"engine failed mid-stream: {e}", type_="server_error")
            )
            yield _event(err.body())
        finally:
            await close()
        yield b"data: [DONE]\n\n"


@dataclass
class _Run:
    """One prompt of a completions batch: its response builder, engine streams, and the
    router's estimate of its cached prefix."""

    builder: ResponseBuilder
    streams: ChoiceStreams
    expected_cached_tokens: int


@dataclass
class _Batch:
    """The runs of a batch's prompts, their engine streams merged once started: ``start()``
    yields ``(k, (index, placement, output))`` for prompt ``k`` as outputs arrive, and raises
    the first failure; ``close()`` ends every stream and releases the batch's admission
    ``ticket``."""

    dispatcher: Dispatcher
    runs: list[_Run] = field(default_factory=list)
    ticket: Ticket | None = None
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = field(
        default_factory=asyncio.Queue
    )
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> AsyncIterator[tuple[int, Any]]:
        self.tasks.extend(asyncio.create_task(self._pump(k, r)) for k, r in enumerate(self.runs))
        return self._outputs()

    async def _pump(self, k: int, run: _Run) -> None:
        self.dispatcher.client.isolate()  # a task per prompt: engine calls of their own
        try:
            async for item in run.streams.items():
                self.queue.put_nowait((k, item, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.queue.put_nowait((k, None, e))
            return
        self.queue.put_nowait((k, None, None))

    async def _outputs(self) -> AsyncIterator[tuple[int, Any]]:
        left = len(self.runs)
        while left:
            k, item, err = await self.queue.get()
            if err is not None:
                raise err
            if item is None:
                left -= 1
            else:
                yield k, item

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for run in self.runs:
            await run.streams.close()
        if self.ticket is not None:
            self.ticket.release()


async def _batch_head(
    items: AsyncIterator[tuple[int, Any]], runs: list[_Run], n: int
) -> list[dict[str, Any]]:
    """The chunks of a streamed batch up to every prompt's first output (sent with the 200)."""
    head: list[dict[str, Any]] = []
    started: set[int] = set()
    async for k, (i, placement, out) in items:
        head += _reindexed(runs[k].builder.chunks(i, out, placement.instance_id), k * n)
        await _stop_if_ended(runs[k].streams, runs[k].builder, i, out)
        started.add(k)
        if len(started) == len(runs):
            break
    return head


async def _stop_if_ended(
    streams: ChoiceStreams, builder: ResponseBuilder, index: int, out: EngineOutput
) -> None:
    """Abort choice ``index``'s engine request if the builder ended the choice (a stop string)
    while its engine goes on."""
    if builder.choices[index].done and not out.finished:
        await streams.stop(index)


def _event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {json.dumps(payload)}\n\n".encode()


def _reindexed(chunks: list[dict[str, Any]], offset: int) -> list[dict[str, Any]]:
    """``chunks`` with their choices' indexes moved by ``offset`` (a batch's later prompts)."""
    for chunk in chunks if offset else ():
        for c in chunk["choices"]:
            c["index"] += offset
    return chunks


def _summed_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The usage of a batch: every count summed (vLLM's)."""
    out = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens")}
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages)
    return {**out, "prompt_tokens_details": {"cached_tokens": cached}}
