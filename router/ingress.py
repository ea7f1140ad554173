"""The OpenAI-compatible HTTP front door (FastAPI): validate, tokenize once, hash, admit, place,
stream. Every client mistake is an OpenAI-shaped 4xx; nothing accepted is dropped silently.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cachemap import BlockHasher
from engines.base import EngineError, EngineOutput, EngineRequest, RoutedRequest
from policies.hints import PolicyHints
from router import tracing
from router.admission import Rejected, Ticket
from router.api import (
    ADMIN_ERRORS,
    CATEGORY_PATTERN,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EngineKind,
    checked_token_ids,
    error_responses,
    json_body_schema,
    openapi_responses,
    validation_error,
)
from router.dispatch import ChoiceStreams, Dispatcher, StreamBroken
from router.hints import conversation_ids, parse_continuation
from router.kv_control import KvControl, kv_routes
from router.lifecycle import choice_requests
from router.metrics import RouterMetrics
from router.placement import NoInstanceError
from router.ratelimit import RateLimiter
from router.responses import ResponseBuilder
from router.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)


@dataclass
class IngressConfig:
    model: str  # the served model name clients ask for
    max_model_len: int
    block_size: int
    api_keys: frozenset[str] = field(default_factory=frozenset)
    # requests per second per API key (per client address without keys), bursts of rate_burst;
    # None: no limit. Over it: 429 with Retry-After.
    rate_limit: float | None = None
    rate_burst: int = 20
    # the KV control API (/v1/kv/*) answers only these keys; none: the API is off (403)
    admin_keys: frozenset[str] = field(default_factory=frozenset)
    pins: bool = False  # the engines' CPU tier honours pins (engines.engine.cpu_tier is set)
    # send the conversation's ids and the continuation hint to the CPU-tier policy; False sends
    # category and turn only (what the hint experiment compares against)
    session_hints: bool = True
    max_body_bytes: int = 4 << 20
    metrics_admin: bool = False  # /metrics answers the admin keys only
    # names this router replica in every response's ``x-kvroute-router`` header (which of many
    # replicas answered: for operators, and for tests that must reach a given one)
    router_id: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    # the engines behind this ingress: "sim" engines cannot produce what needs a token
    # distribution or a detokenizer (logprobs, structured outputs ...: a 400 naming the field)
    engine_kind: EngineKind = "sim"
    max_n: int = 16  # choices per request (``n``): each is an engine request of its own
    max_logprobs: int = 20  # candidates per token (vLLM's max_logprobs default)
    category_header: str = "x-kvroute-category"
    session_header: str = "x-session-id"
    continuation_header: str = "x-kvroute-continuation"
    # distinct request categories (kvroute_category, x-kvroute-category) this ingress passes
    # to the engines' CPU-tier policies, which keep state per category; a new one past it: 400
    max_categories: int = 64
    # the online autoscaling decisions of the app's pools (``deploy.autoscaling``'s
    # ``DecisionPoller``: a ``DecisionLog.snapshot``), shown in /metrics; None: none autoscale
    autoscale: Callable[[], Mapping[str, Any]] | None = None


# NOTE: msgspec's decoder, not json.loads: a 1k-token-id prompt's body decodes in ~31 us
# against ~74, and it refuses what is not JSON (NaN, Infinity, invalid UTF-8) with the byte
_json_decoder = msgspec.json.Decoder()


def _check_json_content_type(request: Request) -> None:
    """415 unless the body is declared ``application/json`` (a ``charset`` parameter, if any,
    UTF-8: RFC 8259's only encoding). A web page can POST text/plain, form or typeless bodies
    cross-origin without a CORS preflight; application/json needs one, so a keyless router on
    localhost is not an open door to every page its user visits."""
    declared = request.headers.get("content-type")
    media, _, rest = (declared or "").partition(";")
    params = {}
    for part in rest.split(";") if rest.strip() else ():
        key, _, value = part.strip().partition("=")
        params[key.strip().lower()] = value.strip().strip('"').lower()
    charset = params.pop("charset", "utf-8")
    if media.strip().lower() != "application/json" or charset not in ("utf-8", "utf8") or params:
        raise APIError(
            415,
            "the body must be JSON sent as content-type application/json; got "
            + (repr(declared) if declared is not None else "no content-type"),
            param="content-type",
            code="unsupported_media_type",
        )


async def _read_json_body(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 415 unless declared ``application/json``
    (``_check_json_content_type``); 413 as soon as it is known to exceed ``limit`` bytes (from
    Content-Length, or while streaming it in), so an oversized body is never held whole; 400
    for a body that is not standard JSON (RFC 8259: no NaN or Infinity) or is nested past the
    parser's depth."""
    _check_json_content_type(request)
    too_large = APIError(
        413, f"request body exceeds the limit of {limit} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        body = _json_decoder.decode(b"".join(chunks))
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # NaN and Infinity: not JSON
        raise APIError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _authorized(request: Request, keys: frozenset[str]) -> bool:
    """The request's bearer token is one of ``keys`` (compared in constant time)."""
    auth = request.headers.get("authorization", "")
    token = auth[7:] if auth.lower().startswith("bearer ") else ""
    return any(secrets.compare_digest(token, k) for k in keys)


async def _stop_if_ended(
    streams: ChoiceStreams, builder: ResponseBuilder, index: int, out: EngineOutput
) -> None:
    """Abort choice ``index``'s engine request if the builder ended the choice (a stop string)
    while its engine goes on."""
    if builder.choices[index].done and not out.finished:
        await streams.stop(index)


class RequestPreparer:
    """Turns a validated OpenAI body into a ``RoutedRequest`` (what the dispatcher sends)."""

    def __init__(
        self, config: IngressConfig, tokenizer: PromptTokenizer, prompt_text: bool = True
    ) -> None:
        """``prompt_text``: give each request its prompt as text too (``RoutedRequest.prompt``,
        which only Ray's ``PrefixCacheAffinityRouter`` reads); without it the text is empty."""
        self.config, self.tokenizer, self.prompt_text = config, tokenizer, prompt_text
        self.hasher = BlockHasher(config.model, config.block_size)
        self.categories: set[str] = set()  # those passed on so far (``max_categories``)

    def category(self, request: Request, req: ChatCompletionRequest | CompletionRequest) -> str:
        """The request's type (header, else body, else "text"): a short name, one of at most
        ``max_categories`` distinct ones (each is state in every engine's CPU-tier policy)."""
        config = self.config
        header = request.headers.get(config.category_header)
        kind = header or req.kvroute_category or "text"
        param = config.category_header if header else "kvroute_category"
        if header and not re.match(CATEGORY_PATTERN, header):
            raise APIError(
                400, f"{param} must match {CATEGORY_PATTERN}, got {header[:64]!r}", param=param
            )
        if kind not in self.categories:
            if len(self.categories) >= config.max_categories:
                raise APIError(
                    400,
                    f"{param}: at most {config.max_categories} distinct request categories; "
                    f"known: {', '.join(sorted(self.categories))}",
                    param=param,
                    code="too_many_categories",
                )
            self.categories.add(kind)
        return kind

    def __call__(
        self,
        request: Request,
        req: ChatCompletionRequest | CompletionRequest,
        prompt: str | list[int] | None = None,
    ) -> tuple[RoutedRequest, str]:
        """The engine request and routing record of a validated body (tokenized once, chat
        template for chats; checked against the context, hashed, with its policy hints), and
        the response's id: the body's ``request_id`` prefixed as OpenAI's ids are, or else
        the engine request's (always a random one). ``prompt``: which of a completions body's
        prompts (default: its first)."""
        config, tokenizer = self.config, self.tokenizer
        chat = isinstance(req, ChatCompletionRequest)
        req.refusals(config.engine_kind)
        if req.n > config.max_n:
            raise APIError(400, f"n must be at most {config.max_n}, got {req.n}", param="n")
        top = req.top_candidates()
        if top is not None and top > config.max_logprobs:
            raise APIError(
                400,
                f"at most {config.max_logprobs} logprobs per token, got {top}",
                param="top_logprobs" if chat else "logprobs",
            )
        session = request.headers.get(config.session_header) or req.session_id or req.user
        node = parent = None
        if isinstance(req, ChatCompletionRequest):
            messages = [m.for_template() for m in req.messages]
            ids = tokenizer.chat(messages)
            text = "".join(m["content"] for m in messages) if self.prompt_text else ""
            turn = sum(1 for m in req.messages if m.role == "user")
            node, parent = conversation_ids(messages, session)
        elif isinstance(p := req.prompts()[0] if prompt is None else prompt, str):
            # vLLM's rule: a completions prompt gets the tokenizer's special tokens unless
            # the request says add_special_tokens: false
            special = req.add_special_tokens is not False
            ids, text, turn = tokenizer.encode(p, special), p, 1
        else:
            ids = checked_token_ids(p, tokenizer.vocab_size, "prompt")
            text, turn = " ".join(map(str, ids[:256])) if self.prompt_text else "", 1
        keep = req.truncate_prompt_tokens
        if keep is not None:  # vLLM's rule: -1 is the context less one; default side "left"
            if keep > config.max_model_len:
                raise APIError(
                    400,
                    f"truncate_prompt_tokens {keep} exceeds the context length "
                    f"{config.max_model_len}",
                    param="truncate_prompt_tokens",
                )
            keep = config.max_model_len - 1 if keep == -1 else keep
            if keep < len(ids):
                ids = ids[len(ids) - keep :] if req.truncation_side != "right" else ids[:keep]
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", param="prompt")
        room = config.max_model_len - len(ids)
        if room < 1:
            raise APIError(
                400,
                f"this model's maximum context length is {config.max_model_len} "
                f"tokens; the prompt has {len(ids)}",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = req.output_limit(default=room)
        if max_tokens > room:
            raise APIError(
                400,
                f"max_tokens {max_tokens} + prompt {len(ids)} tokens exceeds the "
                f"context length {config.max_model_len}",
                param="max_completion_tokens"
                if chat and req.max_completion_tokens  # type: ignore[union-attr]
                else "max_tokens",
                code="context_length_exceeded",
            )
        category = f"{self.category(request, req)}_{turn}"
        header = config.continuation_header
        try:
            continuation = parse_continuation(request.headers.get(header), header)
        except ValueError as e:
            raise APIError(400, str(e), param=header) from None
        if req.kvroute_continuation is not None:
            continuation = req.kvroute_continuation
        hints = (
            PolicyHints(category, turn, node, parent, continuation)
            if config.session_hints
            else PolicyHints(category, turn)
        )
        try:
            sampling = req.sampling(max_tokens, tokenizer.vocab_size)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        prefix = "chatcmpl-" if chat else "cmpl-"
        rid = prefix + uuid.uuid4().hex
        engine_req = EngineRequest(
            rid,
            ids,
            sampling,
            # a client's kv_transfer_params is empty (``RouterOnlyParams``): the hints alone
            kv_transfer_params=hints.merged_into(None),
            cache_salt=req.cache_salt,
            # whole at the end unless someone reads it first: the client, or the ingress's
            # stop strings (an engine that detokenizes applies them itself)
            stream=bool(req.stream) or (bool(sampling.stop) and config.engine_kind == "sim"),
        )
        routed = RoutedRequest(
            engine_req,
            text,
            self.hasher(ids, cache_salt=req.cache_salt),
            session_key=session,
            category=category,
        )
        return routed, prefix + req.request_id if req.request_id else rid


class Ingress:
    """The OpenAI endpoints' work, one object per app: client checks (API key, rate limit,
    admin key, model), then validate, prepare, admit, place, dispatch and answer. ``build_app``
    wires its methods to routes."""

    def __init__(
        self, config: IngressConfig, dispatcher: Dispatcher, tokenizer: PromptTokenizer
    ) -> None:
        self.config, self.dispatcher, self.tokenizer = config, dispatcher, tokenizer
        # NOTE: the prompt's text is for Ray's PrefixCacheAffinityRouter (a request router that
        # places by itself); with pre-placement nothing reads it, and a token-id prompt's
        # stand-in text costs ~30 us to build
        self.prepare = RequestPreparer(config, tokenizer, prompt_text=not dispatcher.pre_place)
        self.metrics = RouterMetrics(config.model, config.router_id, config.max_model_len)
        self.created = int(time.time())
        self.limiter = (
            RateLimiter(config.rate_limit, config.rate_burst)
            if config.rate_limit is not None
            else None
        )

    # -- client checks -------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        keys = self.config.api_keys
        if keys and not _authorized(request, keys):
            raise APIError(
                401,
                "missing or invalid API key",
                type_="authentication_error",
                code="invalid_api_key",
            )

    def check_rate(self, request: Request) -> None:
        """One request of this client's allowance (its key, or its address without keys)."""
        if self.limiter is None:
            return
        config = self.config
        auth = request.headers.get("authorization", "")
        client = auth if config.api_keys else (request.client.host if request.client else "")
        wait = self.limiter.take(client, time.monotonic())
        if wait > 0:
            raise Rejected(
                f"rate limit: {config.rate_limit:g} requests/s per client "
                f"(bursts of {config.rate_burst}); retry in {wait:.2f} s",
                wait,
                code="rate_limited",
            )

    def check_admin(self, request: Request, what: str = "the KV control API") -> None:
        if not self.config.admin_keys:
            raise APIError(
                403,
                f"{what} is off: no admin key is configured (KVROUTE_ADMIN_KEY)",
                type_="permission_error",
                code="admin_api_off",
            )
        if not _authorized(request, self.config.admin_keys):
            raise APIError(
                401,
                "missing or invalid admin key",
                type_="authentication_error",
                code="invalid_admin_key",
            )

    def check_model(self, model: str) -> None:
        if model != self.config.model:
            raise APIError(
                404,
                f"the model {model!r} does not exist; served: {self.config.model!r}",
                param="model",
                code="model_not_found",
            )

    async def read_body(self, request: Request) -> dict[str, Any]:
        return await _read_json_body(request, self.config.max_body_bytes)

    # -- endpoints -----------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "instances": len(self.dispatcher.state.load.instance_ids())}

    def prometheus(self, request: Request) -> Response:
        if self.config.metrics_admin:
            self.check_admin(request, "/metrics")
        self.metrics.observe(self.dispatcher)
        if self.config.autoscale is not None:
            self.metrics.autoscaled(self.config.autoscale())
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    def models(self, request: Request) -> dict[str, Any]:
        self.check_auth(request)
        config = self.config
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "kvroute",
                    "max_model_len": config.max_model_len,
                    # token ids a prompt may carry (loadgen fits its token-id prompts to it)
                    "vocab_size": self.tokenizer.vocab_size,
                }
            ],
        }

    async def completion(self, request: Request, chat: bool) -> Response:
        """A chat or completions request; admission's and the rate limit's refusals raise
        ``Rejected`` (429 + Retry-After, ``rejected``). A completions body with several prompts
        is vLLM's batch (``_batch``)."""
        self.check_auth(request)
        self.check_rate(request)
        body = await self.read_body(request)
        model = ChatCompletionRequest if chat else CompletionRequest
        try:
            req: ChatCompletionRequest | CompletionRequest = model.model_validate(body)
        except ValidationError as e:
            raise validation_error(e, model) from None
        self.check_model(req.model)
        if isinstance(req, CompletionRequest) and len(prompts := req.prompts()) > 1:
            return await self._batch(request, req, prompts)
        dispatcher, metrics = self.dispatcher, self.metrics
        with tracing.span("kvroute.ingress", request.headers) as span:
            routed, response_id = self.prepare(request, req)
            prompt_ids = routed.request.prompt_token_ids
            span.set_attribute("kvroute.prompt_tokens", len(prompt_ids))
            children = choice_requests(routed, req.n)
            builder = ResponseBuilder(
                req, chat, self.tokenizer, response_id, len(prompt_ids), prompt_token_ids=prompt_ids
            )
            queued_at = time.monotonic()
            ticket = await dispatcher.state.admission.acquire()
            metrics.admitted(builder, queued_at, routed.request.stream)
            streams: ChoiceStreams | None = None
            handed_off = False
            try:
                with tracing.span("kvroute.placement") as ps:
                    first = dispatcher.place(
                        dispatcher.placement_request(children[0]),
                        set(),
                        waited_s=time.monotonic() - queued_at,  # the client's TTFT counts it
                    )
                    if first is not None:
                        ps.set_attribute("kvroute.instance", first.instance_id)
                        ps.set_attribute("kvroute.cached_blocks", first.cached_blocks)
                        metrics.placed(first)
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
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            with tracing.span("kvroute.engine_call"):
                async for i, placement, out in items:
                    for chunk in builder.chunks(i, out, placement.instance_id):
                        yield f"data: {json.dumps(chunk)}\n\n".encode()
                    await _stop_if_ended(streams, builder, i, out)
            builder.estimate_cached_tokens(children[0].request.expected_cached_tokens)
            if builder.include_usage:
                yield f"data: {json.dumps(builder.usage_chunk())}\n\n".encode()
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
            yield f"data: {json.dumps(err.body())}\n\n".encode()
        finally:
            await streams.close()
            ticket.release()
        yield b"data: [DONE]\n\n"

    async def _batch(
        self, request: Request, req: CompletionRequest, prompts: list[str | list[int]]
    ) -> Response:
        """A completions body with several prompts, as vLLM's serving_completion runs it: every
        prompt checked first (a 400 before any runs), then each a request of its own (admitted
        and placed on its own), all at once; prompt ``k``'s choice ``i`` is choice ``k * n + i``
        of one response, whose usage is the sum. Streamed, chunks interleave as they come and
        the 200 waits for every prompt's first output (an engine's refusal is still a 4xx)."""
        dispatcher, n = self.dispatcher, req.n
        with tracing.span("kvroute.ingress", request.headers) as span:
            prepared = [self.prepare(request, req, p) for p in prompts]
            response_id = prepared[0][1]
            span.set_attribute(
                "kvroute.prompt_tokens",
                sum(len(r.request.prompt_token_ids) for r, _ in prepared),
            )
            runs: list[_Run] = []
            queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
            tasks: list[asyncio.Task[None]] = []

            async def pump(k: int, run: _Run) -> None:
                dispatcher.client.isolate()  # a task per prompt: engine calls of their own
                try:
                    async for item in run.streams.items():
                        queue.put_nowait((k, item, None))
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    queue.put_nowait((k, None, e))
                    return
                queue.put_nowait((k, None, None))

            async def outputs() -> AsyncIterator[tuple[int, Any]]:
                left = len(runs)
                while left:
                    k, item, err = await queue.get()
                    if err is not None:
                        raise err
                    if item is None:
                        left -= 1
                    else:
                        yield k, item

            async def close() -> None:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for run in runs:
                    await run.streams.close()
                    run.ticket.release()

            handed_off = False
            try:
                for routed, _ in prepared:
                    runs.append(await self._open(req, routed, response_id))
                tasks.extend(asyncio.create_task(pump(k, r)) for k, r in enumerate(runs))
                items = outputs()
                if req.stream:
                    head: list[dict[str, Any]] = []
                    started: set[int] = set()
                    async for k, (i, placement, out) in items:
                        head += _reindexed(
                            runs[k].builder.chunks(i, out, placement.instance_id), k * n
                        )
                        await _stop_if_ended(runs[k].streams, runs[k].builder, i, out)
                        started.add(k)
                        if len(started) == len(runs):
                            break
                    handed_off = True
                    return StreamingResponse(
                        self._batch_sse(items, runs, head, close, n),
                        media_type="text/event-stream",
                        background=BackgroundTask(close),
                    )
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
                    c | {"index": c["index"] + k * n}
                    for k, f in enumerate(finals)
                    for c in f["choices"]
                ]
                body["usage"] = _summed_usage([f["usage"] for f in finals])
                return JSONResponse(body)
            finally:
                if not handed_off:
                    await close()

    async def _open(self, req: CompletionRequest, routed: RoutedRequest, response_id: str) -> _Run:
        """One prompt of a batch admitted and placed, its engine streams not yet started."""
        dispatcher = self.dispatcher
        prompt_ids = routed.request.prompt_token_ids
        children = choice_requests(routed, req.n)
        builder = ResponseBuilder(
            req, False, self.tokenizer, response_id, len(prompt_ids), prompt_token_ids=prompt_ids
        )
        queued_at = time.monotonic()
        ticket = await dispatcher.state.admission.acquire()
        self.metrics.admitted(builder, queued_at, routed.request.stream)
        try:
            first = dispatcher.place(
                dispatcher.placement_request(children[0]),
                set(),
                waited_s=time.monotonic() - queued_at,
            )
            if first is not None:
                self.metrics.placed(first)
            streams = ChoiceStreams(dispatcher, children, first)
        except BaseException:
            ticket.release()
            raise
        return _Run(builder, streams, ticket, children[0].request.expected_cached_tokens)

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
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            with tracing.span("kvroute.engine_call"):
                async for k, (i, placement, out) in items:
                    run = runs[k]
                    for chunk in _reindexed(
                        run.builder.chunks(i, out, placement.instance_id), k * n
                    ):
                        yield f"data: {json.dumps(chunk)}\n\n".encode()
                    await _stop_if_ended(run.streams, run.builder, i, out)
            for run in runs:
                run.builder.estimate_cached_tokens(run.expected_cached_tokens)
            if runs[0].builder.include_usage:
                chunk = runs[0].builder.usage_chunk()
                chunk["usage"] = _summed_usage([r.builder.usage() for r in runs])
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            for run in runs:
                self.metrics.finished(run.builder)
        except Exception as e:  # the client already has a 200: end the stream with an error
            self.metrics.errors.labels("stream").inc()
            err = (
                e
                if isinstance(e, APIError)
                else APIError(500, f"engine failed mid-stream: {e}", type_="server_error")
            )
            yield f"data: {json.dumps(err.body())}\n\n".encode()
        finally:
            await close()
        yield b"data: [DONE]\n\n"

    # -- readiness -----------------------------------------------------------------------

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, body)``: ready once at least one engine is routable (known, healthy, and
        with a load sample on the bus within the watcher's timeout) and the buses are read
        (a sample came within that timeout: a bus that is down or refuses this router sends
        none). A router whose state is driven by hand (no buses) needs a routable engine only."""
        state = self.dispatcher.state
        views, _ = state.observe(())
        healthy = [v.instance_id for v in views if v.healthy]
        watcher = state.core.watcher
        if watcher is None:
            bus, routable = "none", healthy
        else:
            now, timeout = state.clock(), watcher.timeout_s
            heard = {i for i, t in dict(watcher.last_seen).items() if now - t <= timeout}
            bus = "connected" if heard else "silent"
            routable = [i for i in healthy if i in heard]
        ready = bool(routable) and bus != "silent"
        body = {
            "status": "ready" if ready else "not ready",
            "routable_instances": len(routable),
            "instances": len(views),
            "bus": bus,
        }
        return ready, body

    # -- errors --------------------------------------------------------------------------

    def api_error(self, e: APIError) -> JSONResponse:
        self.metrics.errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def rejected(self, e: Rejected) -> JSONResponse:
        return self.api_error(
            APIError(
                429,
                e.reason,
                type_="rate_limit_error",
                code=e.code,
                headers={"Retry-After": e.retry_after_header},
            )
        )

    def engine_error(self, e: Exception) -> JSONResponse:
        # Every attempt failed before a token was sent: the client may retry.
        return self.api_error(
            APIError(
                503,
                f"no engine could serve the request: {e}",
                type_="server_error",
                code="engine_unavailable",
                headers={"Retry-After": "1"},
            )
        )

    def internal_error(self, e: Exception) -> JSONResponse:
        log.exception("internal error")
        return self.api_error(
            APIError(500, f"internal error: {type(e).__name__}", type_="server_error")
        )


@dataclass
class _Run:
    """One prompt of a completions batch: its response builder, engine streams, admission
    ticket, and the router's estimate of its cached prefix."""

    builder: ResponseBuilder
    streams: ChoiceStreams
    ticket: Ticket
    expected_cached_tokens: int


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


class RouterIdHeader:
    """ASGI middleware: ``x-kvroute-router: <router_id>`` on every HTTP response (plain ASGI,
    not ``BaseHTTPMiddleware``: streams pass through untouched)."""

    def __init__(self, app: ASGIApp, router_id: str) -> None:
        self.app = app
        self.header = (b"x-kvroute-router", router_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, with_header)


def build_app(config: IngressConfig, dispatcher: Dispatcher, tokenizer: PromptTokenizer) -> FastAPI:
    """The FastAPI app of one ingress: the OpenAI endpoints, ``/health``, ``/metrics`` and the
    KV control API, over ``dispatcher``'s router state and engines."""
    app = FastAPI(title="kvroute", docs_url=None, redoc_url=None)
    app.add_middleware(RouterIdHeader, router_id=config.router_id)
    ingress = Ingress(config, dispatcher, tokenizer)

    async def on_api_error(_: Request, e: APIError) -> JSONResponse:
        return ingress.api_error(e)

    async def on_rejected(_: Request, e: Rejected) -> JSONResponse:
        return ingress.rejected(e)

    async def on_engine_error(_: Request, e: Exception) -> JSONResponse:
        return ingress.engine_error(e)

    async def on_internal_error(_: Request, e: Exception) -> JSONResponse:
        return ingress.internal_error(e)

    app.add_exception_handler(APIError, on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(Rejected, on_rejected)  # type: ignore[arg-type]
    app.add_exception_handler(NoInstanceError, on_engine_error)
    app.add_exception_handler(EngineError, on_engine_error)
    app.add_exception_handler(Exception, on_internal_error)
    control = KvControl(
        dispatcher.state,
        dispatcher.client,
        tokenizer,
        ingress.prepare.hasher,
        config.max_model_len,
        pins=config.pins,
    )
    app.include_router(kv_routes(control, ingress.check_admin, ingress.read_body))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness: the router process answers (it may not be able to route yet: /ready)."""
        return ingress.health()

    @app.get(
        "/ready",
        responses={
            200: {"description": "Ready: an engine is routable and the buses are read"},
            503: {"description": "Not ready yet (or any more): see the body"},
        },
    )
    async def ready() -> JSONResponse:
        """Readiness: 200 once at least one engine is routable and the cache-map bus is
        connected, 503 until then (and whenever that stops being true)."""
        ok, body = ingress.readiness()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            200: {
                "description": "Prometheus text exposition",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **(error_responses(ADMIN_ERRORS) if config.metrics_admin else {}),
        },
    )
    async def prometheus(request: Request) -> Response:
        return ingress.prometheus(request)

    @app.get("/v1/models", responses=error_responses({401: "Missing or invalid API key"}))
    async def models(request: Request) -> dict[str, Any]:
        return ingress.models(request)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=json_body_schema(ChatCompletionRequest),
        responses=openapi_responses(chat=True),
    )
    async def chat_completions(request: Request) -> Response:
        return await ingress.completion(request, chat=True)

    @app.post(
        "/v1/completions",
        openapi_extra=json_body_schema(CompletionRequest),
        responses=openapi_responses(chat=False),
    )
    async def completions(request: Request) -> Response:
        return await ingress.completion(request, chat=False)

    def openapi() -> dict[str, Any]:
        """FastAPI's document, with the bearer scheme declared (always) and required by the
        operations that check a key: /v1/* with API keys configured, the KV control API (the
        admin key), /metrics when it is the admins'."""
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            doc.setdefault("components", {})["securitySchemes"] = {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "an API key (/v1/*), or an admin key (/v1/kv/*)",
                }
            }
            for path, ops in doc["paths"].items():
                admin = path.startswith("/v1/kv/") or (path == "/metrics" and config.metrics_admin)
                if admin or (path.startswith("/v1/") and config.api_keys):
                    for op in ops.values():
                        op["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
