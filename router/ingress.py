"""The OpenAI-compatible HTTP front door (FastAPI): validate, tokenize once, hash, admit, place,
stream. Every client mistake is an OpenAI-shaped 4xx; nothing accepted is dropped silently.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engines.base import EngineError
from router.admission import Rejected
from router.api import ChatCompletionRequest, CompletionRequest
from router.api_errors import APIError, validation_error
from router.completion import Completions
from router.dispatch import Dispatcher
from router.http_checks import (
    authorized,
    bearer_token,
    declared_length,
    json_object,
    read_body,
    require_key,
    unauthorized,
)
from router.ingress_config import IngressConfig
from router.keys import ApiKey
from router.kv_control import KvControl, kv_routes
from router.metrics import RouterMetrics
from router.openapi import (
    ADMIN_ERRORS,
    error_responses,
    json_body_schema,
    openapi_responses,
    with_bearer_scheme,
)
from router.placement import NoInstanceError
from router.prepare import RequestPreparer
from router.ratelimit import RateLimiter
from router.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")


class Ingress:
    """The OpenAI endpoints' work, one object per app: client checks (API key, rate limit,
    admin key, model), then validate, and ``Completions`` prepares, admits, places, dispatches
    and answers. ``build_app`` wires its methods to routes."""

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
        self.completions = Completions(dispatcher, tokenizer, self.prepare, self.metrics)

    # -- client checks -------------------------------------------------------------------

    def check_auth(self, request: Request) -> ApiKey | None:
        """The client's key (401 unless it is one of the API keys), None when the API is open."""
        keys = self.config.api_keys
        if not keys:
            return None
        key = keys.identify(bearer_token(request))
        if key is None:
            raise unauthorized("API")
        return key

    def check_rate(self, request: Request, key: ApiKey | None) -> None:
        """One request of this client's allowance: its key's id (never the header's text, which
        has many spellings of one key), or its address without keys."""
        if self.limiter is None:
            return
        config = self.config
        client = key.id if key is not None else (request.client.host if request.client else "")
        wait = self.limiter.take(client, time.monotonic())
        if wait > 0:
            raise Rejected(
                f"rate limit: {config.rate_limit:g} requests/s per client "
                f"(bursts of {config.rate_burst}); retry in {wait:.2f} s",
                wait,
                code="rate_limited",
            )

    def check_service(self, request: Request, what: str) -> None:
        """``/metrics`` and ``/openapi.json``: an admin key with ``metrics_admin`` (``/metrics``
        only), else an API key when keys are set, unless the config opens them."""
        config = self.config
        if what == "/metrics" and config.metrics_admin:
            self.check_admin(request, what)
        elif config.api_keys and not config.open_service_routes:
            admin = bool(config.admin_keys) and authorized(request, config.admin_keys)
            if not admin:
                self.check_auth(request)

    def check_admin(self, request: Request, what: str = "the KV control API") -> None:
        if not self.config.admin_keys:
            raise APIError(
                403,
                f"{what} is off: no admin key is configured (KVROUTE_ADMIN_KEY)",
                type_="permission_error",
                code="admin_api_off",
            )
        require_key(request, self.config.admin_keys, "admin")

    def check_model(self, model: str) -> None:
        if model != self.config.model:
            raise APIError(
                404,
                f"the model {model!r} does not exist; served: {self.config.model!r}",
                param="model",
                code="model_not_found",
            )

    async def read_body(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object (``http_checks``), parsed as ``parsed_body`` says."""
        return await self.parsed_body(request, json_object)

    async def parsed_body(self, request: Request, parse: Callable[[bytes], T]) -> T:
        """``parse`` of the body's bytes; a body of more than a few KiB is parsed off the event
        loop (``PrepareLanes``), and refused (429) from its Content-Length, before it is read,
        when that lane is full."""
        lanes = self.prepare.lanes
        lanes.check_room(declared_length(request))
        raw = await read_body(request, self.config.max_body_bytes)
        return await lanes.run(len(raw), partial(parse, raw))

    def _validated(self, raw: bytes, chat: bool) -> ChatCompletionRequest | CompletionRequest:
        """A chat or completions body parsed and validated; what its size alone refuses
        (``RequestPreparer.precheck``) is refused before validation. Off the loop for a large
        body, where the parsed body is also dropped."""
        body = json_object(raw)
        self.prepare.precheck(body, chat)
        model = ChatCompletionRequest if chat else CompletionRequest
        try:
            return model.model_validate(body)
        except ValidationError as e:
            raise validation_error(e, model) from None

    # -- endpoints -----------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "instances": len(self.dispatcher.state.load.instance_ids())}

    def prometheus(self, request: Request) -> Response:
        self.check_service(request, "/metrics")
        self.metrics.observe(self.dispatcher)
        self.metrics.category_overflow.set(self.prepare.category_overflow)
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
        is vLLM's batch (``Completions.batch``)."""
        key = self.check_auth(request)
        self.check_rate(request, key)
        req = await self.parsed_body(request, partial(self._validated, chat=chat))
        self.check_model(req.model)
        namespace = key.namespace if key is not None else None
        if isinstance(req, CompletionRequest) and len(prompts := req.prompts()) > 1:
            return await self.completions.batch(request, req, prompts, namespace)
        return await self.completions.single(request, req, chat, namespace)

    # -- readiness -----------------------------------------------------------------------

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, body)``: ready once at least one engine is routable (known, healthy, and
        with a load sample on the bus within the watcher's timeout) and the buses are read
        (a sample came within that timeout: a bus that is down or refuses this router sends
        none). A router whose state is driven by hand (no buses) needs a routable engine only."""
        state = self.dispatcher.state
        views, _ = state.observe(())
        healthy = [v.instance_id for v in views if v.healthy]
        watcher = state.watcher
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
        if isinstance(e, (ClientDisconnect, *self.config.client_aborts)):
            # nobody reads this answer: counted as nginx counts it, logged without a traceback
            log.info("client closed the connection mid-request (%s)", type(e).__name__)
            return self.api_error(
                APIError(499, "client closed request", type_="client_error", code="client_closed")
            )
        log.exception("internal error")
        return self.api_error(
            APIError(500, f"internal error: {type(e).__name__}", type_="server_error")
        )


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
    # NOTE: no FastAPI /openapi.json route: ours checks a key first (``check_service``)
    app = FastAPI(title="kvroute", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RouterIdHeader, router_id=config.router_id)
    ingress = Ingress(config, dispatcher, tokenizer)
    _add_error_handlers(app, ingress)
    control = KvControl(
        dispatcher.state,
        dispatcher.client,
        tokenizer,
        ingress.prepare.hasher,
        config.max_model_len,
        pins=config.pins,
    )
    app.include_router(kv_routes(control, ingress.check_admin, ingress.read_body))
    _add_service_routes(app, ingress)
    _add_openai_routes(app, ingress)

    def openapi() -> dict[str, Any]:
        """FastAPI's document with the bearer scheme (``with_bearer_scheme``), built once."""
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = with_bearer_scheme(
                doc,
                api_keys=bool(config.api_keys),
                metrics_admin=config.metrics_admin,
                metrics_keyed=bool(config.api_keys) and not config.open_service_routes,
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_document(request: Request) -> JSONResponse:
        ingress.check_service(request, "/openapi.json")
        return JSONResponse(openapi())

    return app


def _add_error_handlers(app: FastAPI, ingress: Ingress) -> None:
    """Every error an endpoint raises answered OpenAI-shaped (``Ingress.api_error`` ...)."""

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


def _add_service_routes(app: FastAPI, ingress: Ingress) -> None:
    """``/health``, ``/ready`` and ``/metrics``: for probes and scrapers, not clients."""

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
            **(error_responses(ADMIN_ERRORS) if ingress.config.metrics_admin else {}),
        },
    )
    async def prometheus(request: Request) -> Response:
        return ingress.prometheus(request)


def _add_openai_routes(app: FastAPI, ingress: Ingress) -> None:
    """The OpenAI endpoints: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``."""

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
