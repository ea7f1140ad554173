"""The engine protocol: what the router and the Serve deployment need from any engine.

Two implementations: ``engines.sim`` (model-free, behaves like vLLM's scheduler where routing
cares) and ``engines.vllm`` (one vLLM ``AsyncLLM``). Both publish KV events as vLLM does (ZMQ
frames ``(topic, seq, msgpack KVEventBatch)``), so one forwarder (``engines.forwarder``) serves
both, translating them into stamped ``cachemap`` messages on the event bus.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

import msgspec


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """The subset of sampling that routing and the sim engine need; passed through to vLLM."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


class EngineRequest(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # Opaque to the engine core; carries PD handover data and kvroute's policy hints
    # (``{"kvroute": {"category": "text_2", "continuation": 0.6}}``).
    kv_transfer_params: dict[str, Any] | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    # The router's cache-map estimate of the prompt's cached prefix. An engine that cannot see
    # its own cache before scheduling (vLLM) counts only the rest as queued prefill work.
    expected_cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache (GPU or CPU tier)


class EngineOutput(msgspec.Struct):
    """One streamed step of a request: the tokens new since the previous output."""

    request_id: str
    token_ids: list[int]
    text: str | None = None  # detokenized delta, where the engine detokenizes
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    usage: Usage | None = None  # on the final output
    kv_transfer_params: dict[str, Any] | None = None  # PD: returned by a prefill engine
    instance_id: str | None = None  # the instance that ran it, on the first output (Serve)


# Seconds between two load samples of one engine on the load bus (the production interval).
LOAD_INTERVAL_S = 0.1


class LoadSnapshot(msgspec.Struct, array_like=True, tag="load"):
    """An engine's load, published on the bus every ``LOAD_INTERVAL_S``."""

    instance_id: str
    ts: float
    waiting: int  # requests queued, not yet scheduled
    running: int  # requests being prefilled or decoded
    gpu_kv_usage: float  # fraction of GPU KV blocks in use by running requests, 0..1
    cpu_kv_usage: float  # fraction of the CPU tier occupied, 0..1 (0 without a CPU tier)
    queued_prefill_tokens: int  # prompt tokens still to prefill (waiting + running)
    running_context_tokens: int = 0  # tokens of context held by running requests


class EngineError(RuntimeError):
    """The engine failed a request or is unhealthy."""


class Engine(ABC):
    """An async LLM engine with a stable ``instance_id`` (the key used in the cache map)."""

    instance_id: str
    block_size: int

    @abstractmethod
    async def start(self) -> None:
        """Bring the engine up (load the model, bind the KV event socket)."""

    @abstractmethod
    async def stop(self) -> None:
        """Abort everything in flight and release resources; idempotent."""

    @abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream outputs until one with ``finished=True``; raises ``EngineError`` on failure."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with ``finish_reason="abort"``."""

    @abstractmethod
    def load(self) -> LoadSnapshot:
        """The current load (cheap; called every ~100 ms)."""

    async def clear_cache(self) -> bool:
        """Drop every cached block that no running request holds, on every tier (vLLM's
        ``reset_prefix_cache``), publishing ``AllBlocksCleared``. False when the engine refused
        because requests are running; raises ``EngineError`` if it cannot clear at all."""
        raise EngineError(f"{type(self).__name__} cannot clear its cache")

    @abstractmethod
    async def check_health(self) -> None:
        """Raise ``EngineError`` if the engine cannot serve."""

    @property
    @abstractmethod
    def kv_events_endpoint(self) -> str | None:
        """ZMQ endpoint where the engine publishes vLLM-format KV events, if any."""

    @property
    def kv_events_replay_endpoint(self) -> str | None:
        """ZMQ ROUTER endpoint serving vLLM's replay protocol for missed batches, if any."""
        return None


class KvCommand(msgspec.Struct):
    """An operator's order for one engine instance (the KV control API), sent through the engine
    deployment's handle to ``target_instance``. ``op``: ``"clear"`` (``Engine.clear_cache``)."""

    op: str
    target_instance: str


async def run_kv_command(engine: Engine, instance_id: str, cmd: KvCommand) -> dict[str, Any]:
    """``cmd`` on ``engine`` (instance ``instance_id``): the answer the KV control API reports."""
    if cmd.target_instance != instance_id:
        raise EngineError(f"command for {cmd.target_instance!r} delivered to {instance_id!r}")
    if cmd.op == "clear":
        return {"instance": instance_id, "cleared": await engine.clear_cache()}
    raise EngineError(f"unknown KV command {cmd.op!r}")


class RoutedRequest(msgspec.Struct):
    """What the ingress sends through the engine deployment's handle: the engine request plus
    what request routers look at. ``prompt`` is the prompt text (Ray's PrefixCacheAffinityRouter
    reads ``.prompt``); ``block_hashes`` are kvroute's chained hashes of the prompt tokens;
    ``target_instance`` is the placement already chosen by the ingress (the request router honours
    it while that instance is a healthy candidate, and places the request itself otherwise)."""

    request: EngineRequest
    prompt: str
    block_hashes: list[int] = msgspec.field(default_factory=list)
    session_key: str | None = None
    category: str = "all"
    target_instance: str | None = None
