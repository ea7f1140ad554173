"""One ingress's configuration: the served model and its context, the client keys and limits,
the headers it reads, and what the engines behind it can do."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from router.api_fields import EngineKind
from router.keys import ApiKeys


@dataclass
class IngressConfig:
    model: str  # the served model name clients ask for
    max_model_len: int
    block_size: int
    # the client keys (none: the API is open); each authenticates an id (rate limits) and a
    # cache namespace (``router.keys``). A set of secrets is taken too, each its own client.
    api_keys: ApiKeys = field(default_factory=ApiKeys)
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
    # to the engines' CPU-tier policies, which keep state per category, the documented ones
    # included; a new one past it is carried as ``api_fields.OVERFLOW_CATEGORY``
    max_categories: int = 64
    # /metrics and /openapi.json answer without a key even when API keys are set (they name
    # the engines and their load); off by default
    open_service_routes: bool = False
    # what the server raises in a handler when the client has gone, besides Starlette's
    # ClientDisconnect (Ray Serve's ASGI receive: ray's TaskCancelledError): counted as
    # kvroute_errors_total{status="499"}, logged at INFO
    client_aborts: tuple[type[Exception], ...] = ()
    # the online autoscaling decisions of the app's pools (``deploy.autoscaling``'s
    # ``DecisionPoller``: a ``DecisionLog.snapshot``), shown in /metrics; None: none autoscale
    autoscale: Callable[[], Mapping[str, Any]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.api_keys, ApiKeys):  # a set of bare secrets
            self.api_keys = ApiKeys(self.api_keys)
