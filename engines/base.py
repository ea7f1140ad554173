"""The engine protocol: what the router and the Serve deployment need from any engine.

Two implementations: ``engines.sim`` (model-free, behaves like vLLM's scheduler where routing
cares) and ``engines.vllm`` (one vLLM ``AsyncLLM``). Both publish KV events as vLLM does (ZMQ
frames ``(topic, seq, msgpack KVEventBatch)``), so one forwarder (``engines.bus.forwarder``) serves
both, translating them into stamped ``cachemap`` messages on the event bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """How to sample one sequence; every field means what vLLM's ``SamplingParams`` field of the
    same name means, and a vLLM engine receives them all. The sim engine honours ``max_tokens``,
    ``seed``, ``stop_token_ids`` and ``min_tokens``; it has no token distribution, so the knobs
    that shape one (temperature ... repetition_penalty) change nothing there, and the ingress
    refuses what it cannot honour (logprobs, logit_bias, structured outputs ...). ``stop``
    strings are applied by the engine where it detokenizes (vLLM), else by the ingress on the
    text it detokenizes (the sim engine ignores them).

    None on a distribution knob means the engine's default: the model's generation config,
    else OpenAI's (temperature 1, top_p 1, no top_k/min_p, no penalties).
    """

    max_tokens: int = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1: off
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    # top candidates returned per output token besides the sampled one (None: no logprobs)
    logprobs: int | None = None
    logprob_token_ids: list[int] | None = None  # these ids' logprobs instead of the top-k
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = msgspec.field(default_factory=list)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's ``StructuredOutputsParams`` as keyword arguments (json, regex, choice, grammar,
    # json_object, ...); None: unconstrained
    structured_outputs: dict[str, Any] | None = None
    stream_interval: int | None = None
    extra_args: dict[str, Any] | None = None  # vLLM's extra_args (the request's vllm_xargs)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or >= 1, got {self.top_k}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty is not None and not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(f"logprobs must be >= 0 (or -1: all), got {self.logprobs}")


class TopLogprob(msgspec.Struct, array_like=True):
    """One candidate token at one output position."""

    token_id: int
    logprob: float
    token: str | None = None  # decoded by the engine; None: the ingress decodes it


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
    # False: nobody reads the output before it ends (a non-streaming client, no stop strings
    # to apply at the ingress), so the engine replica may deliver it whole, as one output
    stream: bool = True


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
    # per new token (when ``sampling.logprobs`` or ``logprob_token_ids`` is set), in vLLM's
    # order: the sampled token first, then the candidates by rank (or the requested ids)
    logprobs: list[list[TopLogprob]] | None = None
    # on a final output with finish_reason "stop": the stop string or stop token id that ended it
    # (None: the EOS token)
    stop_reason: int | str | None = None
    # the engine refused the request as invalid (a client error, e.g. a JSON schema its
    # structured-output backend cannot compile): the only output, finished, reason "error"
    error: str | None = None
    # on a final output of a request that made a token: seconds from its first token to this
    # output, on the engine's own monotonic clock. An interval, so no clock is compared across
    # processes: the ingress, which gets a response nobody streams whole, dates its first token
    # that long before the response came (``router.metrics.RequestTimer``). Outputs merged into
    # one keep the last's, which is the merged output's.
    first_token_age_s: float | None = None


def refusal(request_id: str, prompt_tokens: int, reason: Exception | str) -> EngineOutput:
    """The one output of a request the engine refused as invalid (a client error: the ingress
    answers 400 with ``reason``), where an exception would read as the engine failing and send
    the request to every other engine in turn."""
    return EngineOutput(
        request_id,
        [],
        finished=True,
        finish_reason="error",
        usage=Usage(prompt_tokens, 0, 0),
        error=str(reason),
    )


def merge_outputs(outputs: Sequence[EngineOutput]) -> EngineOutput:
    """Consecutive outputs of one request as one: their tokens, text and logprobs in order;
    what ends a request (finished, reasons, usage, error, PD params) from the last; the
    instance id from the first."""
    if len(outputs) == 1:
        return outputs[0]
    first, last = outputs[0], outputs[-1]
    texts = [o.text for o in outputs]
    logprobs = [o.logprobs for o in outputs]
    return msgspec.structs.replace(
        last,
        token_ids=[t for o in outputs for t in o.token_ids],
        text=None if all(t is None for t in texts) else "".join(t or "" for t in texts),
        logprobs=None
        if all(lp is None for lp in logprobs)
        else [p for lp in logprobs for p in lp or ()],
        instance_id=first.instance_id,
    )


async def whole(outputs: AsyncIterator[EngineOutput]) -> EngineOutput:
    """Every output of one request as one (``merge_outputs``): the answer to a request nobody
    streams. ``outputs`` is closed on the way out, so a caller cancelled while it waits aborts
    the engine request. Raises ``EngineError`` if the engine ended the request with nothing."""
    try:
        got = [out async for out in outputs]
    finally:
        close = getattr(outputs, "aclose", None)
        if close is not None:
            await close()
    if not got:
        raise EngineError("the engine ended the request without an output")
    return merge_outputs(got)


async def coalesce(outputs: AsyncIterator[EngineOutput]) -> AsyncIterator[EngineOutput]:
    """``outputs``, with those that queued up while the consumer was busy merged into one
    (``merge_outputs``): an output is never held back, but a consumer slower than the engine
    (a loaded replica sending each output through Serve) gets fewer, larger ones. Closing the
    result closes ``outputs`` (the engine aborts the request)."""
    queue: asyncio.Queue[EngineOutput | BaseException | None] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for out in outputs:
                queue.put_nowait(out)
        except BaseException as e:  # handed to the consumer, raised there
            queue.put_nowait(e)
        else:
            queue.put_nowait(None)

    task = asyncio.create_task(pump())
    try:
        batch: list[EngineOutput] = []
        while True:
            item = await queue.get()
            while isinstance(item, EngineOutput):
                batch.append(item)
                if item.finished or queue.empty():
                    break
                item = queue.get_nowait()
            if batch:
                merged, last = merge_outputs(batch), batch[-1]
                batch = []
                yield merged
                if last.finished:
                    return
                if last is item:
                    continue
            if isinstance(item, BaseException):
                raise item
            return  # None: the engine's stream ended
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        close = getattr(outputs, "aclose", None)
        if close is not None:
            await close()


# Seconds between two load samples of one engine on the load bus (the production interval).
LOAD_INTERVAL_S = 0.1
# Seconds a busy engine's KV-event batches are gathered into one bus call (the forwarder's; the
# first batch after a quiet spell goes at once). A bus call costs the same whatever it carries
# (benchmarks/bus_bench.py: ~1 ms of CPU per publish on the Ray bus, caller and hub, ~0.25-0.4 ms on
# Redis), so this sets what a busy engine's events cost. A router learns of a block up to this much
# later (plus its ``RouterSettings.bus_poll_s``), which the cluster simulator prices at nothing
# measurable up to 150 ms of lag (kv_ttft, 16 engines: on the Mooncake trace at 2x and 3x, 3 seeds,
# and synthetic to-b and mix at 40 req/s, 2 seeds, the hit rate stays within 0.25 points of 10 ms
# lag's and TTFT p50/p90/p99 within the seeds' spread; at 300 ms the hit rate slips by 0.05-0.45
# points). At 100 ms a busy engine's load sample goes in every call: one bus call per engine per 100
# ms.
PUBLISH_INTERVAL_S = 0.1
# Seconds between two load samples of an engine that reports from inside its scheduler
# (``engines.core_report``): a new report makes the forwarder publish a sample at once, but not
# sooner than this after the last one. Fresher samples did not route better: the routing suite
# (kv_ttft, 3 seeds, every workload at L1 and L2) sampled every 25 ms against every 100 ms moved
# mean excess TTFT by -1 to +10 ms and was worse in 9 of 12 cells (docs/simulation.md), while a
# sample costs a bus call where no KV batch goes with it. Where the router reads its samples,
# ``router.load`` corrects them to now with what it sent and saw come back.
REPORT_INTERVAL_S = LOAD_INTERVAL_S
# KV hand-over between a prefill and a decode engine (assumed, not measured here): a 200 Gb/s
# RDMA NIC (ConnectX-6/7 class, what NIXL's UCX backend reads over) moves 25 GB/s at line rate;
# 1 ms stands for the per-request fixed cost (the READ's setup, the completion notification and
# the scheduler noticing it a step later). NVLink inside a node is faster, TCP across a CPU
# cluster slower: configured per deployment. The sim engine's transfers and the router's
# pricing of a split both default to it.
DEFAULT_TRANSFER_GBPS = 25.0
DEFAULT_TRANSFER_LATENCY_MS = 1.0


class LoadSnapshot(msgspec.Struct, array_like=True, tag="load"):
    """An engine's load, published on the bus every ``LOAD_INTERVAL_S``."""

    instance_id: str
    ts: float
    waiting: int  # requests queued, not yet scheduled
    running: int  # requests being prefilled or decoded
    gpu_kv_usage: float  # fraction of GPU KV blocks in use by running requests, 0..1
    cpu_kv_usage: float  # fraction of the CPU tier occupied, 0..1 (0 without a CPU tier)
    # uncached prompt tokens of the requests without their first token yet (waiting, or in
    # prefill: chunks computed and the step computing them included, as a vLLM engine, which
    # cannot see a prompt's chunks, counts them); a router takes a prompt out of an older
    # snapshot when it sees that prompt's first token (``router.load``)
    queued_prefill_tokens: int
    running_context_tokens: int = 0  # tokens of context held by running requests
    # the engine pool the instance serves in (its deployment's name; router.pools): a router
    # that learns the instance from the bus files it there. "": the router's default pool
    pool: str = ""
    # from inside the engine's scheduler where the engine reports from there (kvroute's vLLM
    # engine: ``engines.core_report``), else 0: the prompt tokens of ``queued_prefill_tokens``
    # not yet scheduled, and the last step's scheduled tokens, start and end (wall clock)
    prefill_tokens_left: int = 0
    step_tokens: int = 0
    step_start: float = 0.0
    step_end: float = 0.0
    # when the engine last took the requests sent to it, where that is before ``ts`` (vLLM's
    # engine core takes them between steps): a request sent after it may not be counted yet,
    # though sent before ``ts`` (0: ``ts``; ``router.load`` reads it so)
    inputs_ts: float = 0.0


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

    @property
    def load_report_endpoint(self) -> str | None:
        """ZMQ endpoint where the engine's scheduler publishes a ``CoreReport`` every step and
        on a heartbeat when idle (``engines.core_report``), if it does."""
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
    reads ``.prompt``; the ingress leaves it empty when it places requests itself, as nothing else
    reads it); ``block_hashes`` are kvroute's chained hashes of the prompt tokens;
    ``target_instance`` is the placement already chosen by the ingress (the request router honours
    it while that instance is a healthy candidate, and places the request itself otherwise)."""

    request: EngineRequest
    prompt: str
    block_hashes: Sequence[int] = msgspec.field(default_factory=list)
    session_key: str | None = None
    category: str = "all"
    target_instance: str | None = None
