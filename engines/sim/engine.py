"""The real-time sim engine: ``engines.base.Engine`` over the sim scheduler, on asyncio.

One background task runs the step loop: schedule, sleep for the step's profiled duration
(times ``time_scale``), sample, stream outputs. KV events go out after every step on a ZMQ PUB
socket exactly as vLLM's ``ZmqEventPublisher`` sends them: frames ``(topic, sequence number as
8 big-endian bytes starting at 0, msgpack KVEventBatch)``.

Prefill/decode disaggregation follows vLLM's ``kv_transfer_params`` contract (see
``engines.sim.scheduler``): a request with ``do_remote_decode`` ends with an output carrying the
params for the decode engine; one with ``do_remote_prefill`` pulls its prompt's KV (waiting
``transfer_s`` times ``time_scale``) and reports the cached tokens as vLLM does
(``SimRequest.reported_cached_tokens``). Malformed PD params are an ``EngineError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator

import zmq

from cachemap.events import KVEventBatch, encode_vllm_batch
from engines.base import (
    Engine,
    EngineError,
    EngineOutput,
    EngineRequest,
    LoadSnapshot,
    Usage,
    refusal,
)
from engines.profile import DEFAULT_PROFILE, LatencyProfile
from engines.sim.options import DEFAULT_OPTIONS, SimEngineOptions
from engines.sim.request import SimRequest, Status, make_request
from engines.sim.scheduler import Scheduler
from policies.base import RequestInfo

log = logging.getLogger(__name__)


class SimEngine(Engine):
    """A model-free engine that schedules, caches and times requests like vLLM.

    ``kv_events_endpoint``: where to bind the PUB socket (``tcp://127.0.0.1:*`` picks a free
    port; the bound address is the ``kv_events_endpoint`` property after ``start``); None turns
    events off. ``time_scale`` multiplies every step's duration and KV transfer (0: as fast as
    possible). ``options``: its block size, KV capacity, CPU tier, limits, output token ids
    and PD transfer speed (``SimEngineOptions``; the profile's where unset).
    """

    def __init__(
        self,
        instance_id: str,
        profile: LatencyProfile | str = DEFAULT_PROFILE,
        *,
        model: str = "sim",
        options: SimEngineOptions = DEFAULT_OPTIONS,
        kv_events_endpoint: str | None = "tcp://127.0.0.1:*",
        kv_events_topic: str = "",
        time_scale: float = 1.0,
    ) -> None:
        if time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        self.profile = (
            profile if isinstance(profile, LatencyProfile) else LatencyProfile.load(profile)
        )
        self.instance_id = instance_id
        self.model = model
        self.scheduler = Scheduler.for_profile(
            self.profile,
            options,
            enable_events=kv_events_endpoint is not None,
            engine_id=instance_id,
            time_scale=time_scale,
        )
        self.blocks, self.config = self.scheduler.blocks, self.scheduler.config
        self.block_size = self.blocks.block_size
        self.time_scale = time_scale
        self._bind = kv_events_endpoint
        self._topic = kv_events_topic.encode()
        self._endpoint: str | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._seq = 0
        self._requests: dict[str, SimRequest] = {}
        # ids of requests nobody streams (``EngineRequest.stream`` false): one output at the end,
        # as vLLM's ``RequestOutputKind.FINAL_ONLY`` gives, not one per step
        self._final_only: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        if self._bind is not None:
            self._ctx = zmq.Context()
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, 100_000)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(self._bind)
            self._endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task = asyncio.create_task(self._run(), name=f"sim-engine-{self.instance_id}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for req in list(self._requests.values()):
            self._abort(req)
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    @property
    def kv_events_endpoint(self) -> str | None:
        return self._endpoint

    async def check_health(self) -> None:
        if self._failure is not None:
            raise EngineError(f"sim engine {self.instance_id} failed: {self._failure!r}")
        if self._task is None or self._task.done():
            raise EngineError(f"sim engine {self.instance_id} is not running")

    def load(self) -> LoadSnapshot:
        s = self.scheduler
        # waiting: queued, pulling its KV (as vLLM's num_requests_waiting gauge counts it), or
        # still in the request overhead
        return s.load_snapshot(self.instance_id, time.time(), len(self._requests) - len(s.running))

    async def clear_cache(self) -> bool:
        cleared = self.blocks.clear_cache()
        self._publish()
        return cleared

    # -- requests ------------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        await self.check_health()
        if request.request_id in self._requests:
            raise EngineError(f"request id {request.request_id!r} is already running")
        sp = request.sampling
        queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        try:
            req = make_request(
                request.request_id,
                block_size=self.block_size,
                max_tokens=sp.max_tokens,
                prompt_token_ids=request.prompt_token_ids,
                model=self.model,
                lora_name=request.lora_name,
                cache_salt=request.cache_salt,
                seed=sp.seed,
                stop_token_ids=sp.stop_token_ids,
                min_tokens=sp.min_tokens,
                max_model_len=self.config.max_model_len,
                vocab_size=self.config.vocab_size,
                token_offset=self.config.token_offset,
                arrival_s=time.monotonic(),
                info=RequestInfo.from_hints(request.kv_transfer_params),
                tag=queue,
                kv_transfer_params=request.kv_transfer_params,
            )
            self.scheduler.check(req)
        except ValueError as e:
            # NOTE: the request itself is invalid (its PD parameters, its length ...): refused
            # as vLLM refuses what its validation rejects, a 400 for the client; raised, it
            # would read as this engine failing and be retried on every other one (then a 503)
            yield refusal(request.request_id, len(request.prompt_token_ids), e)
            return
        self._requests[req.request_id] = req
        if not request.stream:
            self._final_only.add(req.request_id)
        finished = False
        try:
            overhead_s = self.profile.request_overhead_ms / 1e3 * self.time_scale
            if overhead_s > 0:
                await asyncio.sleep(overhead_s)  # input processing, IPC to the engine core
            if req.status != Status.FINISHED:  # not aborted meanwhile
                self.scheduler.add(req)
                self._wake.set()
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            self._final_only.discard(req.request_id)
            if not finished:
                self._abort(req)

    async def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            self._abort(req)

    def _abort(self, req: SimRequest) -> None:
        self._requests.pop(req.request_id, None)
        if req.status == Status.FINISHED:
            return
        if not self.scheduler.abort(req):  # not at the scheduler yet (its request overhead)
            req.status, req.finish_reason = Status.FINISHED, "abort"
        req.tag.put_nowait(self._final(req, []))
        self._publish()

    def _final(self, req: SimRequest, tokens: list[int]) -> EngineOutput:
        usage = Usage(req.prompt_len, req.num_output, req.reported_cached_tokens)
        # a "stop" finish is always a stop token here (the sim has no EOS): vLLM reports its id
        stop_reason = req.token_ids[-1] if req.finish_reason == "stop" and req.token_ids else None
        first = req.first_token_s  # the monotonic end of the step that made it (-1: none yet)
        return EngineOutput(
            req.request_id,
            tokens,
            None,
            True,
            req.finish_reason,
            usage,
            kv_transfer_params=req.kv_transfer_params,
            stop_reason=stop_reason,
            first_token_age_s=max(time.monotonic() - first, 0.0) if first >= 0 else None,
        )

    # -- the step loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        sched = self.scheduler
        try:
            while True:
                if not sched.running and not sched.waiting:  # idle, or only pulls in flight
                    ready = sched.next_kv_ready_s()
                    if ready > time.monotonic():
                        await self._idle(ready)
                        continue
                start = time.monotonic()
                step = sched.schedule(start)
                if not step.scheduled and not step.preempted:
                    # the queue's head waits for blocks that pulls in flight hold
                    self._publish()
                    await self._idle(sched.next_kv_ready_s())
                    continue
                # NOTE: the step's events (blocks it fills, evictions it made room with) go out
                # when it ends, with its outputs, as vLLM's scheduler publishes them in
                # update_from_output: a prompt's blocks are not announced before they exist
                delay = step.duration_s * self.time_scale - (time.monotonic() - start)
                await asyncio.sleep(max(delay, 0.0))
                final_only = self._final_only
                for req, tokens in sched.complete(step, time.monotonic()):
                    if req.status == Status.FINISHED:
                        self._requests.pop(req.request_id, None)
                        if req.request_id in final_only and req.token_ids is not None:
                            tokens = req.token_ids[req.prompt_len :]
                        req.tag.put_nowait(self._final(req, tokens))
                    elif req.request_id not in final_only:
                        req.tag.put_nowait(EngineOutput(req.request_id, tokens))
                self._publish()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug: fail every request instead of hanging them
            log.exception("sim engine %s: step loop failed", self.instance_id)
            self._failure = e
            for req in list(self._requests.values()):
                self._requests.pop(req.request_id, None)
                req.tag.put_nowait(EngineOutput(req.request_id, [], None, True, "error", None))

    async def _idle(self, until: float) -> None:
        """Sleep until the monotonic time ``until`` (inf: for ever) or a new request."""
        delay = until - time.monotonic()
        if delay <= 0:
            await asyncio.sleep(0)
            return
        self._wake.clear()
        if math.isinf(delay):
            await self._wake.wait()
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    def _publish(self) -> None:
        events = self.blocks.take_events()
        if not events or self._pub is None:
            return
        payload = encode_vllm_batch(KVEventBatch(ts=time.time(), events=events))
        try:
            self._pub.send_multipart(
                (self._topic, self._seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
            )
        except zmq.Again:
            log.warning("sim engine %s: KV event batch %d dropped", self.instance_id, self._seq)
        self._seq += 1
