"""The KV control API (admin): what is cached where, and an operator's orders to the engines'
KV caches. Served by the ingress under ``/v1/kv/`` behind the admin key.

- ``POST /v1/kv/lookup``: a prompt (text, chat messages or token ids) -> per instance, its
  leading tokens cached on GPU and, after them, on the CPU tier, as this router's cache map
  knows them (fed by the engines' KV events, so a few ms behind), and the prompt tokens the
  instance would spare a request (``cached_tokens``, the engine's own count: the last prompt
  token is always computed).
- ``POST /v1/kv/pin`` / ``unpin``: run the prompt once (one output token) on the chosen
  instances (default: all) with a pin (unpin) order in the request's policy hints. The engines'
  CPU tiers keep pinned blocks whatever their eviction policy says, until unpinned, cleared or
  the engine restarts. Pins live in the CPU tier only: vLLM's GPU prefix cache has no pinning
  (it is LRU and not pluggable), so a pinned prefix is still evicted from GPU memory and comes
  back from the CPU tier at its load cost. A deployment without a CPU tier refuses pins (409).
- ``POST /v1/kv/clear``: the chosen instances (default: all) drop every cached block no running
  request holds, on both tiers (vLLM's prefix-cache reset); an engine with requests running
  refuses (``cleared: false``), as vLLM's reset does.
- ``POST /v1/kv/warm``: run the prompt once on the chosen instances, or on the ``count``
  least-loaded healthy instances that do not already hold all of it: how an operator (or a
  hot-prefix rule) replicates a hot system prompt before its holder's queue builds.

Every error is OpenAI-shaped; pin, unpin, clear and warm answer per instance (``ok``, and why
not), never all-or-nothing.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cachemap import BlockHasher
from cachemap.match import Match
from engines.base import EngineError, EngineRequest, KvCommand, RoutedRequest, SamplingParams
from policies.hints import PolicyHints
from router.api import checked_token_ids
from router.api_errors import APIError, validation_error
from router.api_fields import CATEGORY_PATTERN, CacheSalt, ChatMessage, StrictBody
from router.dispatch import EngineClient
from router.keys import NAME_PATTERN, tenant_salt
from router.openapi import ADMIN_ERRORS, BODY_ERRORS, error_responses
from router.openapi import json_body_schema as _schema
from router.placement import InstanceView, cached_tokens
from router.state import RouterState
from router.tokenizer import PromptTokenizer


class _Body(StrictBody):
    """A KV control body: strict as the OpenAI bodies are (unknown fields, NaN: 400s)."""


class KvPrompt(_Body):
    """A prompt as the OpenAI endpoints take it: exactly one of ``text`` (a completion prompt),
    ``messages`` (a chat, through the model's chat template) or ``token_ids``."""

    # NOTE: typed without None (a null is a 400, as the documented oneOf says): absent is None
    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        json_schema_extra={"oneOf": [{"required": [k]} for k in ("text", "messages", "token_ids")]},
    )

    text: str = Field(None, min_length=1)  # type: ignore[assignment]
    messages: list[ChatMessage] = Field(None, min_length=1)  # type: ignore[arg-type]
    token_ids: list[Annotated[int, Field(ge=0)]] = Field(None, min_length=1)  # type: ignore[arg-type]
    cache_salt: CacheSalt | None = None  # as the OpenAI endpoints take it
    namespace: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="the cache namespace of the API keys whose KV this prompt is (their id, or "
        "the name router.key_namespaces gives them); with API keys set, a prompt with none "
        "matches no client's requests",
    )

    @property
    def salt(self) -> str | None:
        """The cache salt the prompt's KV is hashed and stored under (``router.keys``)."""
        return tenant_salt(self.namespace, self.cache_salt)

    @model_validator(mode="after")
    def _one(self) -> KvPrompt:
        given = [k for k in ("text", "messages", "token_ids") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of text, messages and token_ids"
                + (f"; got {', '.join(given)}" if given else "")
            )
        for m in self.messages or ():
            m.text()
        return self


class LookupBody(KvPrompt):
    pass


class PinBody(KvPrompt):
    instances: list[str] | None = Field(
        None, min_length=1, description="instance ids; default: every instance"
    )
    category: str = Field(
        "text",
        pattern=CATEGORY_PATTERN,
        description="request type the CPU-tier policy files the blocks under (a short name: "
        "each one is state in every engine's CPU-tier policy)",
    )


class WarmBody(PinBody):
    instances: list[str] | None = Field(
        None, min_length=1, description="instance ids; default: the `count` least-loaded ones"
    )
    count: int = Field(1, ge=1, description="instances to warm when `instances` is not given")


class ClearBody(_Body):
    instances: list[str] | None = Field(
        None, min_length=1, description="instance ids; default: every instance"
    )


class InstanceCache(BaseModel):
    instance: str
    gpu_tokens: int = Field(description="leading prompt tokens resident on GPU")
    cpu_tokens: int = Field(description="tokens after those, resident on the CPU tier")
    cached_tokens: int = Field(description="prompt tokens a request would be spared")


class LookupResponse(BaseModel):
    object: Literal["kv.lookup"] = "kv.lookup"
    prompt_tokens: int
    block_size: int
    instances: list[InstanceCache] = Field(description="every known instance, most cached first")


class InstanceResult(BaseModel):
    instance: str
    ok: bool
    cached_tokens: int | None = Field(
        None, description="pin/unpin/warm: prompt tokens that were cached when it ran"
    )
    cleared: bool | None = Field(None, description="clear: whether the engine reset its cache")
    error: str | None = None


class ActionResponse(BaseModel):
    object: Literal["kv.pin", "kv.unpin", "kv.warm", "kv.clear"]
    prompt_tokens: int | None = None
    instances: list[InstanceResult]


class KvControl:
    """The API's logic, HTTP-free: the router's state and the engine client it dispatches with.
    ``pins``: the engines have a CPU tier that honours pins."""

    def __init__(
        self,
        state: RouterState,
        client: EngineClient,
        tokenizer: PromptTokenizer,
        hasher: BlockHasher,
        max_model_len: int,
        pins: bool,
    ) -> None:
        self.state, self.client, self.tokenizer, self.hasher = state, client, tokenizer, hasher
        self.max_model_len = max_model_len
        self.pins = pins

    # -- prompts and instances -----------------------------------------------------------------

    def tokens(self, p: KvPrompt) -> list[int]:
        if p.messages is not None:
            ids = self.tokenizer.chat([m.for_template() for m in p.messages])
        elif p.text is not None:
            ids = self.tokenizer.encode(p.text, add_special_tokens=True)  # as completions do
        else:
            ids = checked_token_ids(p.token_ids or (), self.tokenizer.vocab_size, "token_ids")
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", param="text")
        if len(ids) >= self.max_model_len:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; the context length is {self.max_model_len}",
                param="messages" if p.messages is not None else "text",
                code="context_length_exceeded",
            )
        return ids

    def known(self, wanted: Sequence[str] | None) -> list[str]:
        """``wanted`` (default: every instance), each checked to be known (404 otherwise)."""
        ids = sorted(self.state.load.instance_ids())
        if wanted is None:
            return ids
        unknown = [i for i in wanted if i not in ids]
        if unknown:
            raise APIError(
                404,
                f"unknown instance {unknown[0]!r}; known: {', '.join(ids) or 'none'}",
                param="instances",
                code="instance_not_found",
            )
        return list(dict.fromkeys(wanted))

    def _cache(self, iid: str, m: Match | None, n: int) -> InstanceCache:
        bs = self.state.block_size
        gpu, total = (m.gpu_blocks, m.total_blocks) if m is not None else (0, 0)
        return InstanceCache(
            instance=iid,
            gpu_tokens=gpu * bs,
            cpu_tokens=(total - gpu) * bs,
            cached_tokens=cached_tokens(n, total, bs),
        )

    # -- the operations ------------------------------------------------------------------------

    def lookup(self, body: LookupBody) -> LookupResponse:
        ids = self.tokens(body)
        _, match = self.state.observe(self.hasher(ids, cache_salt=body.salt))
        rows = [self._cache(iid, match.get(iid), len(ids)) for iid in self.known(None)]
        rows.sort(key=lambda r: (-r.cached_tokens, -r.gpu_tokens, r.instance))
        return LookupResponse(
            prompt_tokens=len(ids), block_size=self.state.block_size, instances=rows
        )

    async def pin(self, body: PinBody, pin: bool) -> ActionResponse:
        if not self.pins:
            raise APIError(
                409,
                "pins live in the engines' CPU tier, and these engines have none "
                "(engines.engine.cpu_tier); vLLM's GPU prefix cache cannot pin",
                code="no_cpu_tier",
            )
        ids = self.tokens(body)
        targets = self.known(body.instances)
        results = await self._run_all(body, ids, targets, pin)
        return ActionResponse(
            object="kv.pin" if pin else "kv.unpin", prompt_tokens=len(ids), instances=results
        )

    async def warm(self, body: WarmBody) -> ActionResponse:
        ids = self.tokens(body)
        if body.instances is not None:
            targets = self.known(body.instances)
        else:
            views, match = self.state.observe(self.hasher(ids, cache_salt=body.salt))
            targets = least_loaded_without(views, match, len(ids) // self.state.block_size)
            targets = targets[: body.count]
            if not targets:
                raise APIError(503, "no healthy engine instance to warm", code="no_instance")
        results = await self._run_all(body, ids, targets, None)
        return ActionResponse(object="kv.warm", prompt_tokens=len(ids), instances=results)

    async def clear(self, body: ClearBody) -> ActionResponse:
        targets = self.known(body.instances)

        async def one(iid: str) -> InstanceResult:
            try:
                out = await self.client.command(KvCommand("clear", iid))
            except EngineError as e:
                return InstanceResult(instance=iid, ok=False, error=str(e))
            cleared = bool(out.get("cleared"))
            return InstanceResult(
                instance=iid,
                ok=cleared,
                cleared=cleared,
                error=None if cleared else "requests are running on it; retry when idle",
            )

        results = await asyncio.gather(*(one(i) for i in targets))
        return ActionResponse(object="kv.clear", instances=list(results))

    async def _run_all(
        self, body: PinBody, ids: list[int], targets: list[str], pin: bool | None
    ) -> list[InstanceResult]:
        hashes = self.hasher(ids, cache_salt=body.salt)
        hints = PolicyHints(f"{body.category}_1", 1, pin=pin)

        async def one(iid: str) -> InstanceResult:
            self.client.isolate()  # a task of its own (gather): one engine call each
            request = EngineRequest(
                f"kvctl-{uuid.uuid4().hex}",
                ids,
                SamplingParams(max_tokens=1, temperature=0.0),
                kv_transfer_params=hints.merged_into(None),
                cache_salt=body.salt,
            )
            routed = RoutedRequest(
                request, "", hashes, category=hints.category, target_instance=iid
            )
            ran_on, cached = iid, None
            try:
                async for out in self.client.stream(routed):
                    ran_on = out.instance_id or ran_on
                    if out.usage is not None:
                        cached = out.usage.cached_tokens
            except (EngineError, ConnectionError, OSError) as e:
                return InstanceResult(instance=iid, ok=False, error=f"engine failed: {e}")
            if ran_on != iid:
                return InstanceResult(
                    instance=iid, ok=False, error=f"Serve delivered it to {ran_on!r} instead"
                )
            return InstanceResult(instance=iid, ok=True, cached_tokens=cached)

        return list(await asyncio.gather(*(one(i) for i in targets)))


def least_loaded_without(
    views: Sequence[InstanceView], match: Mapping[str, Match], full_blocks: int
) -> list[str]:
    """Healthy instances, those not holding all ``full_blocks`` leading blocks first, each
    group least loaded first (requests in flight, then queued prefill tokens)."""
    healthy = [v for v in views if v.healthy]

    def key(v: InstanceView) -> tuple[bool, int, int, str]:
        m = match.get(v.instance_id)
        holds = m is not None and m.total_blocks >= full_blocks
        return holds, v.waiting + v.running, v.pending_prefill_tokens, v.instance_id

    return [v.instance_id for v in sorted(healthy, key=key)]


def kv_routes(control: KvControl, check_admin: Any, read_body: Any) -> APIRouter:
    """The ``/v1/kv/`` endpoints. ``check_admin(request)`` raises unless the admin key is
    given; ``read_body(request)`` is the ingress's bounded JSON reader."""
    api = APIRouter(prefix="/v1/kv", tags=["kv control (admin)"])

    async def body_of(request: Request, model: type[_Body]) -> Any:
        check_admin(request)
        try:
            return model.model_validate(await read_body(request))
        except ValidationError as e:
            raise validation_error(e, model) from None

    def errors(**more: str) -> dict[int | str, dict[str, Any]]:
        extra = {int(k.removeprefix("e")): v for k, v in more.items()}
        return error_responses({**BODY_ERRORS, **ADMIN_ERRORS, **extra})

    def post(path: str, body: type[_Body], response: type, act: Any, **errs: str) -> None:
        """``POST /v1/kv/<path>``: the admin's ``body`` validated, then ``act(body)`` (a
        coroutine's result is awaited) answers; ``errs``: ``e<status>="what it means"``."""

        async def endpoint(request: Request) -> Any:
            out = act(await body_of(request, body))
            return await out if inspect.isawaitable(out) else out

        api.add_api_route(
            f"/{path}",
            endpoint,
            methods=["POST"],
            name=path,
            response_model=response,
            openapi_extra=_schema(body),
            responses=errors(**errs),
        )

    unknown = "An instance named is not known"
    pins = {"e404": unknown, "e409": "These engines have no CPU tier to pin in"}
    no_engine = "No healthy engine instance to warm"
    post("lookup", LookupBody, LookupResponse, control.lookup)
    post("pin", PinBody, ActionResponse, lambda b: control.pin(b, True), **pins)
    post("unpin", PinBody, ActionResponse, lambda b: control.pin(b, False), **pins)
    post("warm", WarmBody, ActionResponse, control.warm, e404=unknown, e503=no_engine)
    post("clear", ClearBody, ActionResponse, control.clear, e404=unknown)
    return api
