"""Continuous batching with a per-step token budget and chunked prefill, like vLLM v1's scheduler.

Each step (``Scheduler.schedule``):

1. Running requests first, in order: each gets ``min(tokens it still lacks, budget left)``
   (one token when decoding, a chunk when prefilling). If its blocks cannot be allocated, the
   last running request is preempted (blocks freed, progress reset, back to the front of the
   waiting queue) until they can, or until it is the one preempted.
2. Then, unless something was preempted, waiting requests in FCFS order while budget and
   ``max_num_seqs`` allow: the prefix-cache lookup happens at admission (GPU hit, then the CPU
   tier), the whole prompt must fit in free blocks, and the first chunk is what the budget
   leaves. A head that does not fit blocks the queue.

A request samples a token in the step that computes its last known token; it finishes when it
reaches its ``target_output``. The step's duration comes from the ``LatencyProfile``.
``decode_run`` skips over a run of pure-decode steps in one call (virtual time only).

KV that comes from elsewhere (a prefill engine's hand-over, the cluster KV pool) waits aside
in ``pulling`` while it arrives: ``engines.sim.remote`` says how, as vLLM does it.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from engines.base import DEFAULT_TRANSFER_GBPS, DEFAULT_TRANSFER_LATENCY_MS, LoadSnapshot
from engines.profile import LatencyProfile
from engines.sim.blocks import Block, KVBlockManager, cdiv
from engines.sim.options import DEFAULT_OPTIONS, SimEngineOptions
from engines.sim.remote import handover_params
from engines.sim.request import TOKEN_OFFSET, VOCAB_SIZE, SimRequest, Status


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    vocab_size: int = VOCAB_SIZE
    token_offset: int = TOKEN_OFFSET
    # vLLM's long_prefill_token_threshold: while more than one request is running or waiting,
    # no request prefills more than this many tokens in a step (0: no cap)
    long_prefill_token_threshold: int = 0
    # PD decode side: a pull of n tokens takes n * kv_bytes_per_token / (transfer_gbps * 1e9)
    # + transfer_latency_ms / 1e3 seconds (see DEFAULT_TRANSFER_GBPS)
    transfer_gbps: float = DEFAULT_TRANSFER_GBPS
    transfer_latency_ms: float = DEFAULT_TRANSFER_LATENCY_MS
    # the load report's count (``SimEngineOptions``', whose default this is)
    queued_until_first_token: bool = DEFAULT_OPTIONS.queued_until_first_token

    def __post_init__(self) -> None:
        if not (self.transfer_gbps > 0 and math.isfinite(self.transfer_gbps)):
            raise ValueError(f"transfer_gbps must be a positive number, got {self.transfer_gbps}")
        if not (self.transfer_latency_ms >= 0 and math.isfinite(self.transfer_latency_ms)):
            raise ValueError(
                f"transfer_latency_ms must be a number >= 0, got {self.transfer_latency_ms}"
            )

    @classmethod
    def from_profile(
        cls, profile: LatencyProfile, **overrides: int | float | None
    ) -> SchedulerConfig:
        """The profile's limits, with any non-None ``overrides`` (same field names).

        NOTE: ``int | float``, not ``float``: compiled (deploy/native.py), a ``float`` value
        is one, and an int limit passed through would reach an int field as a float."""
        values: dict[str, Any] = {
            "long_prefill_token_threshold": profile.long_prefill_token_threshold,
            "max_num_batched_tokens": profile.max_num_batched_tokens,
            "max_num_seqs": profile.max_num_seqs,
            "max_model_len": profile.max_model_len,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


class Step:
    """One scheduled step: ``(request, new tokens, tokens computed before)`` per request.
    NOTE: a plain class, not a dataclass: compiled (``deploy.native``), a dataclass still runs
    the interpreted ``__init__`` the dataclass decorator generates, once per engine step."""

    __slots__ = ("admitted", "duration_s", "load_tokens", "preempted", "scheduled", "start_s")

    def __init__(self, start_s: float = 0.0) -> None:
        self.scheduled: list[tuple[SimRequest, int, int]] = []
        self.preempted: list[SimRequest] = []
        self.admitted: list[SimRequest] = []
        self.duration_s = 0.0
        self.load_tokens = 0
        self.start_s = start_s


class Scheduler:
    """Owns the waiting queue, the running batch and the pulls in flight of one engine instance.

    ``engine_id`` names it in the ``kv_transfer_params`` it hands over (``remote_engine_id``);
    ``time_scale`` is the clock's seconds per profile second for KV transfers (the real-time
    engine's ``time_scale``; 1 in virtual time)."""

    def __init__(
        self,
        blocks: KVBlockManager,
        profile: LatencyProfile,
        config: SchedulerConfig,
        *,
        engine_id: str = "sim",
        time_scale: float = 1.0,
    ):
        if config.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {config.max_model_len}")
        self.blocks = blocks
        self.profile = profile
        self.config = config
        self.engine_id = engine_id
        self.time_scale = time_scale
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        # PD decode: requests whose KV is being pulled, by kv_ready_s (vLLM's
        # WAITING_FOR_REMOTE_KVS requests, and those whose KV arrived and wait for a slot)
        self.pulling: list[SimRequest] = []
        self._admission_blocked = False
        self._pulls_blocked = False  # a pull whose KV arrived waits for a batch slot
        self._link_free_s = 0.0  # when this engine's link to the KV pool ends its last load
        self.last_step = (0, 0.0, 0.0)  # the last step done: scheduled tokens, start, end
        self.num_preemptions = 0
        # over the requests admitted so far, each counted once (on its first admission, not
        # again after a preemption): prompt tokens, and of those served from cache (GPU or CPU
        # tier) and loaded from the CPU tier
        self.requests_admitted = 0
        self.prompt_tokens_admitted = 0
        self.cached_tokens_admitted = 0
        self.cpu_cached_tokens_admitted = 0
        self.remote_tokens_admitted = 0  # PD decode: prompt tokens pulled (not in the above)

    @classmethod
    def for_profile(
        cls,
        profile: LatencyProfile,
        options: SimEngineOptions = DEFAULT_OPTIONS,
        *,
        enable_events: bool = False,
        engine_id: str = "sim",
        time_scale: float = 1.0,
    ) -> Scheduler:
        """One instance of ``profile`` shaped by ``options`` (see ``SimEngineOptions``)."""
        o = options
        bs = o.block_size or profile.block_size
        n_blocks = o.num_gpu_blocks or profile.kv_capacity_tokens // bs + 1
        blocks = KVBlockManager(
            n_blocks,
            bs,
            cpu_capacity_blocks=o.cpu_capacity_blocks,
            cpu_policy=o.cpu_policy,
            enable_events=enable_events,
        )
        mml = o.max_model_len or min(profile.max_model_len, (n_blocks - 1) * bs)
        config = SchedulerConfig.from_profile(
            profile,
            max_model_len=mml,
            transfer_gbps=o.transfer_gbps,
            transfer_latency_ms=o.transfer_latency_ms,
            max_num_batched_tokens=o.max_num_batched_tokens,
            long_prefill_token_threshold=o.long_prefill_token_threshold,
            max_num_seqs=o.max_num_seqs,
            vocab_size=o.vocab_size,
            token_offset=o.token_offset,
            queued_until_first_token=o.queued_until_first_token,
        )
        return cls(blocks, profile, config, engine_id=engine_id, time_scale=time_scale)

    # -- queue -------------------------------------------------------------------------------

    def add(self, req: SimRequest) -> None:
        """Queue a request. Raises ``ValueError`` if it can never fit this instance."""
        self.check(req)
        req.status = Status.WAITING
        self.waiting.append(req)

    def check(self, req: SimRequest) -> None:
        """Raise ``ValueError`` if ``req`` can never run here (too long, too many blocks)."""
        cfg = self.config
        if req.prompt_len >= cfg.max_model_len:
            raise ValueError(
                f"prompt of {req.prompt_len} tokens >= max_model_len {cfg.max_model_len}"
            )
        full = cdiv(
            min(req.prompt_len + req.target_output, cfg.max_model_len), self.blocks.block_size
        )
        if full > self.blocks.num_gpu_blocks - 1:
            raise ValueError(
                f"request needs {full} KV blocks, the instance has {self.blocks.num_gpu_blocks - 1}"
            )

    def abort(self, req: SimRequest) -> bool:
        """Drop a waiting or running request; False if it already finished."""
        if req.status == Status.FINISHED:
            return False
        if req in self.running:
            self.running.remove(req)
        elif req.status == Status.WAITING_FOR_REMOTE_KVS:
            self.pulling.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                return False
        self.blocks.free(req)
        self.blocks.end_request(req)
        self._admission_blocked = False
        req.status = Status.FINISHED
        req.finish_reason = "abort"
        return True

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting and not self.pulling

    def next_kv_ready_s(self, after_s: float = -math.inf) -> float:
        """When the first pull still in flight after ``after_s`` delivers its KV (inf: none)."""
        for r in self.pulling:
            if r.kv_ready_s > after_s:
                return r.kv_ready_s
        return math.inf

    def transfer_s(self, tokens: int) -> float:
        """Seconds (profile time) to pull ``tokens`` of KV from a prefill engine."""
        cfg = self.config
        return (
            tokens * self.profile.kv_bytes_per_token / (cfg.transfer_gbps * 1e9)
            + cfg.transfer_latency_ms / 1e3
        )

    def prefill_counts(self, now_s: float = math.inf) -> tuple[int, int]:
        """Prompt tokens still to compute, (queued, left): a waiting request's beyond its cached
        prefix as of now (GPU or CPU tier, then the KV pool; a pool load's past its hit); a PD
        decode's prompt is pulled but for its last token, recomputed (one token per pull). In
        ``queued`` a running prompt counts beyond its admitted hit until its first token is out
        at ``now_s``, as ``LoadSnapshot.queued_prefill_tokens`` defines it (the step computing
        it, and chunks computed before, included); in ``left`` beyond what it has computed (or
        was scheduled to: ``LoadSnapshot.prefill_tokens_left``)."""
        bs, lookup = self.blocks.block_size, self.blocks.lookup
        pooled = self.blocks.pool is not None
        tokens = 0
        for r in self.pulling:  # a PD pull recomputes one token; a pool load past its hit
            tokens += 1 if r.remote_prefill else r.num_tokens - r.pool_hit_tokens
        for r in self.waiting:
            if r.remote_prefill and r.kv_ready_s < 0:
                tokens += 1
                continue
            hit, n_cpu = lookup(r)
            n = len(hit) + n_cpu
            if pooled and r.pool_load:  # the KV pool's blocks past them are loaded
                n += self.blocks.pool_hit(r, n)
            tokens += max(r.num_tokens - n * bs, 0)
        queued = left = tokens
        for r in self.running:
            left += max(r.prompt_len - r.num_computed, 0)
            if r.first_token_s < 0 or r.first_token_s > now_s:
                queued += 1 if r.remote_tokens else max(r.prompt_len - r.cached_tokens, 0)
        return queued, left

    def load_snapshot(
        self, instance_id: str, ts: float, waiting: int, now_s: float = math.inf
    ) -> LoadSnapshot:
        """This instance's ``LoadSnapshot``; ``waiting`` is the caller's count (it may include
        requests not yet handed to the scheduler); ``now_s``: the steps' clock, where a step
        is completed before it ends (the virtual engine's; a served engine completes a step
        once it has ended)."""
        queued, left = self.prefill_counts(now_s)
        tokens, start, end = self.last_step
        return LoadSnapshot(
            instance_id=instance_id,
            ts=ts,
            waiting=waiting,
            running=len(self.running),
            gpu_kv_usage=self.blocks.gpu_usage(),
            cpu_kv_usage=self.blocks.cpu_usage(),
            queued_prefill_tokens=queued if self.config.queued_until_first_token else left,
            running_context_tokens=sum(r.num_computed for r in self.running),
            prefill_tokens_left=left,
            step_tokens=tokens,
            step_start=start,
            step_end=end,
        )

    # -- one step ----------------------------------------------------------------------------

    def schedule(self, now_s: float) -> Step:
        """Pick this step's work and allocate its blocks; progress is advanced right away."""
        cfg, blocks = self.config, self.blocks
        blocks.now_s = now_s
        step = Step(now_s)
        budget = cfg.max_num_batched_tokens
        running = self.running
        # as vLLM: the cap holds only when there is another request to make room for
        cap = cfg.long_prefill_token_threshold if len(running) + len(self.waiting) > 1 else 0
        bs = blocks.block_size
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            computed = r.num_computed
            n = min(r.num_tokens - computed, budget, cap or budget)
            if n <= 0:
                i += 1
                continue
            # NOTE: for a decode token inside its last block that completes no block,
            # ``allocate_running`` would do nothing (no new block, none to cache)
            if (
                n > 1
                or len(r.blocks) * bs <= computed
                or r.num_cached_blocks < (computed + 1) // bs
            ):
                while not blocks.allocate_running(r, n, cfg.max_model_len):
                    victim = running.pop()
                    self._preempt(victim)
                    step.preempted.append(victim)
                    if victim is r:
                        break
                if r.status != Status.RUNNING:
                    break
            step.scheduled.append((r, n, r.num_computed))
            r.num_computed += n
            budget -= n
            i += 1
        self._admission_blocked = False
        if not step.preempted:
            if self.pulling:
                budget = self._admit_pulled(step, budget, now_s)
            budget = self._admit(step, budget, cap or budget)
        step.duration_s = self._duration_s(step)
        return step

    def _admit(self, step: Step, budget: int, cap: int) -> int:
        cfg, blocks, waiting, bs = self.config, self.blocks, self.waiting, self.blocks.block_size
        pooled = blocks.pool is not None
        while budget > 0 and waiting:
            if len(self.running) >= cfg.max_num_seqs:
                self._admission_blocked = True
                break
            r = waiting[0]
            blocks.begin_request(r)  # once per request
            hit, n_cpu = blocks.lookup(r)
            n_pool = blocks.pool_hit(r, len(hit) + n_cpu) if pooled and r.pool_load else 0
            if n_pool and not r.pool_loaded:
                self._start_pool_load(r, n_pool, (len(hit) + n_cpu + n_pool) * bs)
                continue
            computed = (len(hit) + n_cpu + n_pool) * bs
            if r.remote_prefill and r.kv_ready_s < 0:
                if not self._start_pull(r, hit, n_cpu):
                    self._admission_blocked = True
                    break
                continue
            n = min(r.num_tokens - computed, budget, cap)
            if not blocks.allocate_new(r, n, hit, n_cpu, cfg.max_model_len, n_pool=n_pool):
                self._admission_blocked = True
                break
            waiting.popleft()
            self.running.append(r)
            r.status = Status.RUNNING
            if r.cached_tokens < 0:
                r.cached_tokens, r.cpu_cached_tokens = computed, n_cpu * bs
                r.scheduled_s = blocks.now_s
                self.requests_admitted += 1
                self.prompt_tokens_admitted += r.prompt_len
                self.cached_tokens_admitted += computed
                self.cpu_cached_tokens_admitted += n_cpu * bs
            step.load_tokens += n_cpu * bs
            step.admitted.append(r)
            step.scheduled.append((r, n, computed))
            r.num_computed = computed + n
            budget -= n
        return budget

    def _start_pull(self, r: SimRequest, hit: list[Block], n_cpu: int) -> bool:
        """Admit a PD decode request to pull its prompt's KV beyond the local hit: blocks for
        the whole prompt, cached when the KV arrives. False: not enough free blocks."""
        blocks, bs = self.blocks, self.blocks.block_size
        local = (len(hit) + n_cpu) * bs
        # NOTE: the local hit stops short of the last token, so there is always one to pull.
        pulled = r.prompt_len - local
        if not blocks.allocate_new(
            r, pulled, hit, n_cpu, self.config.max_model_len, delay_cache_blocks=True
        ):
            return False
        self.waiting.popleft()
        now = blocks.now_s
        r.status = Status.WAITING_FOR_REMOTE_KVS
        r.cached_tokens, r.cpu_cached_tokens, r.scheduled_s = local, n_cpu * bs, now
        r.remote_tokens, r.transfer_s = pulled, self.transfer_s(pulled)
        # NOTE: the local hit's CPU-tier part is loaded while the pull runs, not in a step
        r.kv_ready_s = now + (r.transfer_s + self.profile.load_s(n_cpu * bs)) * self.time_scale
        r.num_computed = r.prompt_len
        self.requests_admitted += 1
        self.prompt_tokens_admitted += r.prompt_len
        self.cached_tokens_admitted += local
        self.cpu_cached_tokens_admitted += n_cpu * bs
        self.remote_tokens_admitted += pulled
        pulling = self.pulling
        pulling.insert(bisect.bisect_right(pulling, r.kv_ready_s, key=_ready_s), r)
        return True

    def _start_pool_load(self, r: SimRequest, n_pool: int, hit_tokens: int) -> None:
        """The waiting queue's head ``r`` loads ``n_pool`` blocks from the KV pool, after the
        link's earlier loads; it waits in ``pulling`` meanwhile (the module's docstring)."""
        blocks = self.blocks
        start = max(blocks.now_s, self._link_free_s)
        r.kv_ready_s = self._link_free_s = start + blocks.pool_load_s(n_pool) * self.time_scale
        r.pool_loaded, r.pool_hit_tokens = True, hit_tokens
        r.status = Status.WAITING_FOR_REMOTE_KVS
        self.waiting.popleft()
        pulling = self.pulling
        pulling.insert(bisect.bisect_right(pulling, r.kv_ready_s, key=_ready_s), r)

    def _admit_pulled(self, step: Step, budget: int, now_s: float) -> int:
        """Admit the pulls whose KV has arrived, before the waiting queue (vLLM drains its
        requests that hold KV blocks first): cache the pulled blocks, recompute the last
        prompt token (``_update_waiting_for_remote_kv``). Pool loads that arrived go back to
        the queue's head, in the order they arrived."""
        cfg, blocks, pulling = self.config, self.blocks, self.pulling
        self._pulls_blocked = False
        loaded = [r for r in pulling if r.kv_ready_s <= now_s and not r.remote_prefill]
        if loaded:
            for r in loaded:
                pulling.remove(r)
                r.status = Status.WAITING
            self.waiting.extendleft(reversed(loaded))
        while budget > 0 and pulling and pulling[0].kv_ready_s <= now_s:
            if len(self.running) >= cfg.max_num_seqs:
                self._pulls_blocked = True
                break
            r = pulling.pop(0)
            blocks.cache_blocks(r, r.prompt_len)
            r.num_computed = r.num_tokens - 1
            if not blocks.allocate_running(r, 1, cfg.max_model_len):
                raise RuntimeError(f"request {r.request_id}: pulled blocks lack a slot")
            self.running.append(r)
            r.status = Status.RUNNING
            step.admitted.append(r)
            step.scheduled.append((r, 1, r.num_computed))
            r.num_computed += 1
            budget -= 1
        return budget

    def _preempt(self, r: SimRequest) -> None:
        self.blocks.free(r)
        r.status = Status.PREEMPTED
        r.num_computed = 0
        r.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(r)

    def _duration_s(self, step: Step) -> float:
        """The step's duration by the profile: its requests sorted into decodes (one new token
        after a sampled one) and prefill chunks."""
        batch, ctx = 0, 0
        chunks: list[tuple[int, int]] = []
        for r, n, before in step.scheduled:
            if n == 1 and r.num_output > 0 and before == r.num_tokens - 1:
                batch += 1
                ctx += before + 1
            else:
                chunks.append((n, before))
        return self.profile.step_s(chunks, batch, ctx, step.load_tokens)

    def complete(self, step: Step, end_s: float) -> list[tuple[SimRequest, list[int]]]:
        """Sample tokens for the requests the step finished computing; finish those done.

        Returns ``(request, new token ids)`` for each request that produced a token (token ids
        are empty for hash-only requests); finished ones have ``status == FINISHED``.
        """
        cfg, blocks = self.config, self.blocks
        out: list[tuple[SimRequest, list[int]]] = []
        finished = False
        scheduled = 0
        for r, n, before in step.scheduled:
            scheduled += n
            if blocks.pool is not None:
                blocks.store_to_pool(r, before, n, end_s)
            if r.status != Status.RUNNING or r.num_computed < r.num_tokens:
                continue
            toks = r.append_outputs(1, cfg.vocab_size, cfg.token_offset)
            if r.num_tokens % blocks.block_size == 0:
                r.extend_hashes(blocks.block_size)
            if r.first_token_s < 0:
                r.first_token_s = end_s
            if r.num_output >= r.target_output:
                blocks.now_s = end_s
                if r.remote_decode:
                    r.kv_transfer_params = handover_params(self.engine_id, r)
                blocks.free(r)
                blocks.end_request(r)
                r.status = Status.FINISHED
                r.finish_s = end_s
                finished = True
            out.append((r, toks))
        if finished:
            self.running = [r for r in self.running if r.status == Status.RUNNING]
            self._admission_blocked = self._pulls_blocked = False  # freed blocks and a slot
        self.last_step = (scheduled, step.start_s, end_s)
        return out

    # -- virtual time: skip a run of pure-decode steps ---------------------------------------

    def decode_run(self, now_s: float, limit_s: float) -> tuple[int, float]:
        """Advance every running request by the same number of decode steps, all starting
        before ``limit_s``, as long as nothing can change the batch: no finish, no admission
        (queue empty or its head blocked), enough free blocks. Returns (steps, seconds)."""
        running, cfg, blocks, p = self.running, self.config, self.blocks, self.profile
        if not running or (self.waiting and not self._admission_blocked) or now_s >= limit_s:
            return 0, 0.0
        pulling = self.pulling
        if pulling and pulling[0].kv_ready_s <= now_s and not self._pulls_blocked:
            return 0, 0.0  # a pull's KV has arrived: the next step admits it
        batch = len(running)
        if batch > cfg.max_num_batched_tokens:
            return 0, 0.0
        k = cfg.max_model_len
        ctx0 = 0
        for r in running:
            if r.num_tokens - r.num_computed != 1 or r.num_output == 0:
                return 0, 0.0
            k = min(k, r.target_output - r.num_output - 1)
            ctx0 += r.num_tokens
        if k <= 0:
            return 0, 0.0
        # the first step, ms
        a = p.decode_ms(batch, ctx0, p.base_ms)
        d = p.decode_growth_ms(batch)  # growth per step, ms
        k = min(k, _steps_starting_before(a, d, (limit_s - now_s) * 1e3))
        bs, free = blocks.block_size, blocks.num_free

        def need(steps: int) -> int:
            return sum(max(cdiv(r.num_computed + steps, bs) - len(r.blocks), 0) for r in running)

        # NOTE: a request's blocks cover what it computed, so k more tokens need at most
        # cdiv(k, bs) new blocks each: when that fits, the exact count (a pass over the batch)
        # is not needed.
        if batch * cdiv(k, bs) > free and need(k) > free:
            lo, hi = 0, k  # largest steps with need <= free
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if need(mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        if k <= 0:
            return 0, 0.0
        blocks.now_s = now_s
        vocab, off = cfg.vocab_size, cfg.token_offset
        for r in running:
            r.append_outputs(k, vocab, off)
            r.extend_hashes(bs)
            if not blocks.allocate_running(r, k, cfg.max_model_len):
                raise RuntimeError("decode_run: block budget was checked but allocation failed")
            r.num_computed += k
        total_s = (k * a + d * k * (k - 1) / 2) / 1e3
        # the run's last step, on the profile's clock (a perturbed engine stretches it)
        last_s = (a + d * (k - 1)) / 1e3
        self.last_step = (batch, now_s + total_s - last_s, now_s + total_s)
        return k, total_s


def _ready_s(r: SimRequest) -> float:
    return r.kv_ready_s


def _steps_starting_before(a: float, d: float, horizon: float) -> int:
    """Largest m such that step m-1 starts before ``horizon`` (steps last a, a+d, a+2d, ...)."""

    def start(j: int) -> float:
        return j * a + d * j * (j - 1) / 2

    if horizon <= 0:
        return 0
    if (a <= 0 and d <= 0) or math.isinf(horizon):
        return 1 << 30  # free steps: only finishes and blocks bound the run
    if d <= 0:
        m = math.ceil(horizon / a)
    else:
        b = a - d / 2
        m = math.ceil((-b + math.sqrt(b * b + 2 * d * horizon)) / d)
    m = max(m, 1)
    while m > 1 and start(m - 1) >= horizon:
        m -= 1
    while start(m) < horizon:
        m += 1
    return m
