"""The runner: sends a schedule to an OpenAI-compatible endpoint and records what happened.

Open loop (default): request ``i`` is started at ``t0 + offset_i`` on an absolute clock, so a
slow server or a slow send never shifts later sends; requests due together start together.
Latency is measured from the intended send time, so queueing in an overloaded server (or in
this client) shows up instead of being hidden. ``max_inflight`` caps concurrent requests; a
send it delays is flagged. Closed loop (``concurrency``): N workers each send the next request
as soon as their previous one finishes.

Sessions: in ``live`` mode a later turn waits for its parent's reply and carries it (text
prompts), and its intended time becomes ``max(scheduled, parent done)``; in ``recorded`` mode
every prompt is synthesized from its ``hash_ids`` and the schedule alone orders the turns.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Literal

import aiohttp
from yarl import URL

from loadgen.client import encode_json, endpoint_url, loop_factory, raise_fd_limit, send
from loadgen.prompts import PromptSynth
from loadgen.records import RequestRecord
from loadgen.workloads import Planned

Api = Literal["completions", "chat"]


_TIMER_TICK_S = 1e-3  # uvloop (libuv) timer granularity


@dataclass(slots=True)
class RunConfig:
    url: str  # base URL; "/v1/completions" or "/v1/chat/completions" is appended
    model: str
    synth: PromptSynth
    api: Api = "completions"
    stream: bool = True
    ignore_eos: bool = True
    timeout_s: float = 600.0
    max_inflight: int | None = None
    concurrency: int | None = None
    max_connections: int = 4096
    sessions: Literal["recorded", "live"] = "recorded"
    extra_body: dict[str, Any] = field(default_factory=dict)
    # sent on every request (``--api-key``'s Authorization, ``--header``s)
    headers: dict[str, str] = field(default_factory=dict)
    # send each request's type (trace ``type``: text, search, api ...) as ``kvroute_category``,
    # the field kvroute's ingress turns into the CPU-tier policy's category (``{type}_{turn}``)
    send_category: bool = False

    @property
    def endpoint(self) -> str:
        return endpoint_url(self.url, self.api)


@dataclass(slots=True)
class LiveStats:
    """Counters the progress display reads while the run goes on."""

    planned: int = 0
    sent: int = 0
    done: int = 0
    errors: int = 0
    inflight: int = 0
    cap_delayed: int = 0
    recent_ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=2000))


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    duration_s: float
    requested_span_s: float
    config: RunConfig
    interrupted: bool = False

    @property
    def mode(self) -> str:
        n = self.config.concurrency
        return f"closed({n})" if n is not None else "open"


class Runner:
    def __init__(self, config: RunConfig, plan: list[Planned]) -> None:
        if config.max_inflight is not None and config.max_inflight <= 0:
            raise ValueError(f"--max-inflight must be > 0, got {config.max_inflight}")
        if config.concurrency is not None and config.concurrency <= 0:
            raise ValueError(f"--concurrency must be > 0, got {config.concurrency}")
        if config.max_connections <= 0:
            raise ValueError(f"--max-connections must be > 0, got {config.max_connections}")
        if config.concurrency is not None and config.max_inflight is not None:
            raise ValueError("--max-inflight caps the open loop; --concurrency already bounds it")
        self.cfg = config
        self.plan = plan
        self.stats = LiveStats(planned=len(plan))
        self.records: list[RequestRecord] = [
            RequestRecord(
                p.index,
                p.req.category,
                p.req.chat_id,
                p.req.input_length,
                max(1, p.req.output_length),
                p.offset_s,
            )
            for p in plan
        ]
        live = config.sessions == "live"
        self._done_events: dict[int, asyncio.Event] = {}
        self._history: dict[int, list[dict[str, str]]] = {}
        self._children: dict[int, int] = {}
        if live:
            for p in plan:
                if p.parent is not None:
                    self._children[p.parent] = self._children.get(p.parent, 0) + 1
        self._live = live
        self._t0 = 0.0
        self._sem: asyncio.Semaphore | None = None
        self._session: aiohttp.ClientSession
        self._prepared: dict[int, tuple[bytes, list[dict[str, str]] | None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._url = URL(config.endpoint)  # NOTE: parsed once, not per request

    def run_blocking(self) -> RunResult:
        """``run`` to the end on an event loop of its own, the one ``kvroute loadgen`` uses
        (uvloop where installed)."""
        with asyncio.Runner(loop_factory=loop_factory()) as loop:
            return loop.run(self.run())

    async def run(self) -> RunResult:
        cfg = self.cfg
        # NOTE: bounded pool. Past it, requests wait for a connection (and that wait shows in
        # their latency from the intended time) instead of an overloaded run opening thousands
        # of sockets, which costs CPU on both ends and ends in fd / ephemeral-port exhaustion.
        raise_fd_limit()
        connector = aiohttp.TCPConnector(limit=cfg.max_connections, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        async with aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            read_bufsize=2**20,
            skip_auto_headers=["User-Agent"],
            headers=cfg.headers,
        ) as session:
            self._session = session
            for i in self._children:
                self._done_events[i] = asyncio.Event()
            if cfg.max_inflight is not None:
                self._sem = asyncio.Semaphore(cfg.max_inflight)
            self._t0 = perf_counter() + 0.02
            interrupted = False
            try:
                if cfg.concurrency is not None:
                    await self._closed_loop(cfg.concurrency)
                else:
                    await self._open_loop()
            except asyncio.CancelledError:
                # NOTE: Ctrl-C cancels the run; stop what is in flight and keep the partial
                # records, so the report still covers what was sent.
                interrupted = True
                for task in self._tasks:
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
            duration = perf_counter() - self._t0
        span = 0.0  # closed loop or no plan: no requested rate
        if cfg.concurrency is None and self.plan:
            span = self.plan[-1].offset_s - self.plan[0].offset_s
        return RunResult(self.records, duration, span, cfg, interrupted)

    async def _open_loop(self) -> None:
        tasks = self._tasks
        t0, sem, plan = self._t0, self._sem, self.plan
        ahead = 0
        for i, p in enumerate(plan):
            target = t0 + p.offset_s
            if target > perf_counter():
                ahead = self._prepare_ahead(max(ahead, i), target)
                # NOTE: uvloop's millisecond timers wake a sleep up to ~1 ms early on
                # perf_counter. Nothing may leave before its time, so a remainder waits one
                # more timer tick (at most ~1 ms late) instead of spinning the loop on it.
                while (delay := target - perf_counter()) > 0:
                    await asyncio.sleep(max(delay, _TIMER_TICK_S))
            rec = self.records[p.index]
            if sem is not None:
                if sem.locked():
                    rec.cap_delayed = True
                    self.stats.cap_delayed += 1
                await sem.acquire()
            task = asyncio.create_task(self._one(p, rec))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if sem is not None:
                task.add_done_callback(lambda _t: sem.release())
        while tasks:
            await asyncio.gather(*list(tasks))

    def _prepare_ahead(self, start: int, deadline: float) -> int:
        """Encode bodies of upcoming requests while waiting for ``deadline``; returns the next
        index to prepare. NOTE: live-session turns need their parent's reply: never prepared."""
        plan, prepared = self.plan, self._prepared
        horizon = deadline - self._t0 + 0.5
        i = start
        while i < len(plan) and i - start < 256 and plan[i].offset_s < horizon:
            if perf_counter() > deadline - 0.002:
                break
            p = plan[i]
            if i not in prepared and not (self._live and p.parent is not None):
                prepared[i] = self._body(p)
            i += 1
        return i

    async def _closed_loop(self, n: int) -> None:
        queue = iter(self.plan)

        async def worker() -> None:
            for p in queue:
                rec = self.records[p.index]
                rec.intended_s = perf_counter() - self._t0
                await self._one(p, rec)

        self._tasks.update(asyncio.create_task(worker()) for _ in range(n))
        await asyncio.gather(*self._tasks)

    async def _one(self, p: Planned, rec: RequestRecord) -> None:
        st = self.stats
        try:
            if self._live and p.parent is not None:
                parent_done = self._done_events.get(p.parent)
                if parent_done is not None and not parent_done.is_set():
                    await parent_done.wait()
                    rec.intended_s = max(rec.intended_s, self.records[p.parent].done_s)
            prepared = self._prepared.pop(p.index, None)
            data, messages = prepared if prepared is not None else self._body(p)
            st.sent += 1
            st.inflight += 1
            await send(
                self._session,
                self._url,
                data,
                rec,
                self._t0,
                stream=self.cfg.stream,
                chat=self.cfg.api == "chat",
                keep_reply=p.index in self._children,
            )
            st.inflight -= 1
            st.done += 1
            if rec.error is not None:
                st.errors += 1
            elif not math.isnan(rec.first_token_s):
                st.recent_ttft_s.append(rec.ttft_s)
            if messages is not None and p.index in self._children:
                reply = rec.reply or self.cfg.synth.words(
                    self.cfg.synth.token_ids(p.req.hash_ids, p.req.input_length)[
                        : p.req.output_length
                    ]
                )
                self._history[p.index] = [*messages, {"role": "assistant", "content": reply}]
        finally:
            ev = self._done_events.get(p.index)
            if ev is not None:
                ev.set()

    def _body(self, p: Planned) -> tuple[bytes, list[dict[str, str]] | None]:
        cfg, req, synth = self.cfg, p.req, self.cfg.synth
        body: dict[str, Any] = {"model": cfg.model, "max_tokens": max(1, req.output_length)}
        messages: list[dict[str, str]] | None = None
        if self._live and (p.parent is not None or p.index in self._children):
            messages = self._live_messages(p)
        if cfg.api == "chat":
            if messages is None:
                messages = [{"role": "user", "content": synth.text(req.hash_ids, req.input_length)}]
            body["messages"] = messages
        elif messages is not None:
            body["prompt"] = "".join(m["content"] for m in messages)
        else:
            body["prompt"] = synth.token_ids(req.hash_ids, req.input_length).tolist()
        if cfg.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        if cfg.send_category and req.type is not None:
            body["kvroute_category"] = req.type
        body.update(cfg.extra_body)
        return encode_json(body), messages

    def _live_messages(self, p: Planned) -> list[dict[str, str]]:
        req, synth = p.req, self.cfg.synth
        tokens = synth.token_ids(req.hash_ids, req.input_length)
        history = None
        if p.parent is not None:
            history = self._history.get(p.parent)
            left = self._children.get(p.parent, 0) - 1
            if left <= 0:
                self._history.pop(p.parent, None)
                self._children.pop(p.parent, None)
            else:
                self._children[p.parent] = left
        if history is None:
            return [{"role": "user", "content": synth.words(tokens)}]
        prev = self.plan[p.parent].req  # type: ignore[index]
        # NOTE: the new user message keeps the trace's length: what this turn adds beyond the
        # previous prompt and reply; its tokens are the tail of this request's own blocks.
        n_new = max(1, req.input_length - prev.input_length - prev.output_length)
        return [*history, {"role": "user", "content": synth.words(tokens[-n_new:])}]
