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
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from engines.base import LoadSnapshot
from engines.sim.blocks import KVBlockManager, cdiv
from engines.sim.profile import LatencyProfile
from engines.sim.request import TOKEN_OFFSET, VOCAB_SIZE, SimRequest, Status
from policies.base import EvictionPolicy


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

    @classmethod
    def from_profile(cls, profile: LatencyProfile, **overrides: int | None) -> SchedulerConfig:
        """The profile's limits, with any non-None ``overrides`` (same field names)."""
        values = {
            "long_prefill_token_threshold": profile.long_prefill_token_threshold,
            "max_num_batched_tokens": profile.max_num_batched_tokens,
            "max_num_seqs": profile.max_num_seqs,
            "max_model_len": profile.max_model_len,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclass(slots=True)
class Step:
    """One scheduled step: ``(request, new tokens, tokens computed before)`` per request."""

    scheduled: list[tuple[SimRequest, int, int]] = field(default_factory=list)
    preempted: list[SimRequest] = field(default_factory=list)
    admitted: list[SimRequest] = field(default_factory=list)
    duration_s: float = 0.0
    load_tokens: int = 0


class Scheduler:
    """Owns the waiting queue and running batch of one engine instance."""

    def __init__(self, blocks: KVBlockManager, profile: LatencyProfile, config: SchedulerConfig):
        if config.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {config.max_model_len}")
        self.blocks = blocks
        self.profile = profile
        self.config = config
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._admission_blocked = False
        self.num_preemptions = 0
        # over the requests admitted so far, each counted once (on its first admission, not
        # again after a preemption): prompt tokens, and of those served from cache (GPU or CPU
        # tier) and loaded from the CPU tier
        self.requests_admitted = 0
        self.prompt_tokens_admitted = 0
        self.cached_tokens_admitted = 0
        self.cpu_cached_tokens_admitted = 0

    @classmethod
    def for_profile(
        cls,
        profile: LatencyProfile,
        *,
        block_size: int | None = None,
        num_gpu_blocks: int | None = None,
        cpu_capacity_blocks: int = 0,
        cpu_policy: str | EvictionPolicy = "lru",
        enable_events: bool = False,
        max_model_len: int | None = None,
        **limits: int | None,
    ) -> Scheduler:
        """One instance sized by ``profile``: its KV capacity in ``block_size`` blocks (plus the
        null block) unless ``num_gpu_blocks`` is given, ``max_model_len`` at most what the pool
        holds, and the profile's other limits unless ``limits`` override them."""
        bs = block_size or profile.block_size
        n_blocks = num_gpu_blocks or profile.kv_capacity_tokens // bs + 1
        blocks = KVBlockManager(
            n_blocks,
            bs,
            cpu_capacity_blocks=cpu_capacity_blocks,
            cpu_policy=cpu_policy,
            enable_events=enable_events,
        )
        mml = max_model_len or min(profile.max_model_len, (n_blocks - 1) * bs)
        return cls(
            blocks, profile, SchedulerConfig.from_profile(profile, max_model_len=mml, **limits)
        )

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
        return not self.running and not self.waiting

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: a waiting request's beyond its cached prefix as of
        now (GPU or CPU tier), a running one's beyond what it has computed."""
        bs, lookup = self.blocks.block_size, self.blocks.lookup
        tokens = 0
        for r in self.waiting:
            hit, n_cpu = lookup(r)
            tokens += max(r.num_tokens - (len(hit) + n_cpu) * bs, 0)
        return tokens + sum(max(r.prompt_len - r.num_computed, 0) for r in self.running)

    def load_snapshot(self, instance_id: str, ts: float, waiting: int) -> LoadSnapshot:
        """This instance's ``LoadSnapshot``; ``waiting`` is the caller's count (it may include
        requests not yet handed to the scheduler)."""
        return LoadSnapshot(
            instance_id=instance_id,
            ts=ts,
            waiting=waiting,
            running=len(self.running),
            gpu_kv_usage=self.blocks.gpu_usage(),
            cpu_kv_usage=self.blocks.cpu_usage(),
            queued_prefill_tokens=self.queued_prefill_tokens(),
            running_context_tokens=sum(r.num_computed for r in self.running),
        )

    # -- one step ----------------------------------------------------------------------------

    def schedule(self, now_s: float) -> Step:
        """Pick this step's work and allocate its blocks; progress is advanced right away."""
        cfg, blocks = self.config, self.blocks
        blocks.now_s = now_s
        step = Step()
        budget = cfg.max_num_batched_tokens
        running = self.running
        # as vLLM: the cap holds only when there is another request to make room for
        cap = cfg.long_prefill_token_threshold if len(running) + len(self.waiting) > 1 else 0
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = min(r.num_tokens - r.num_computed, budget, cap or budget)
            if n <= 0:
                i += 1
                continue
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
            budget = self._admit(step, budget, cap or budget)
        step.duration_s = self._duration_s(step)
        return step

    def _admit(self, step: Step, budget: int, cap: int) -> int:
        cfg, blocks, waiting, bs = self.config, self.blocks, self.waiting, self.blocks.block_size
        while budget > 0 and waiting:
            if len(self.running) >= cfg.max_num_seqs:
                self._admission_blocked = True
                break
            r = waiting[0]
            blocks.begin_request(r)  # once per request
            hit, n_cpu = blocks.lookup(r)
            computed = (len(hit) + n_cpu) * bs
            n = min(r.num_tokens - computed, budget, cap)
            if not blocks.allocate_new(r, n, hit, n_cpu, cfg.max_model_len):
                self._admission_blocked = True
                break
            waiting.popleft()
            self.running.append(r)
            r.status = Status.RUNNING
            if r.cached_tokens < 0:
                r.cached_tokens, r.cpu_cached_tokens = computed, n_cpu * bs
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

    def _preempt(self, r: SimRequest) -> None:
        self.blocks.free(r)
        r.status = Status.PREEMPTED
        r.num_computed = 0
        r.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(r)

    def _duration_s(self, step: Step) -> float:
        p = self.profile
        if not step.scheduled:
            return 0.0
        ms, batch, ctx = p.base_ms, 0, 0
        for r, n, before in step.scheduled:
            if n == 1 and r.num_output > 0 and before == r.num_tokens - 1:
                batch += 1
                ctx += before + 1
            else:
                ms += p.chunk_ms(n, before)
        if batch:
            ms += p.decode_seq_ms * batch + p.decode_ctx_ms * ctx
        return ms / 1e3 + p.load_s(step.load_tokens)

    def complete(self, step: Step, end_s: float) -> list[tuple[SimRequest, list[int]]]:
        """Sample tokens for the requests the step finished computing; finish those done.

        Returns ``(request, new token ids)`` for each request that produced a token (token ids
        are empty for hash-only requests); finished ones have ``status == FINISHED``.
        """
        cfg, blocks = self.config, self.blocks
        out: list[tuple[SimRequest, list[int]]] = []
        finished = False
        for r, _, _ in step.scheduled:
            if r.status != Status.RUNNING or r.num_computed < r.num_tokens:
                continue
            toks = r.append_outputs(1, cfg.vocab_size, cfg.token_offset)
            if r.num_tokens % blocks.block_size == 0:
                r.extend_hashes(blocks.block_size)
            if r.first_token_s < 0:
                r.first_token_s = end_s
            if r.num_output >= r.target_output:
                blocks.now_s = end_s
                blocks.free(r)
                blocks.end_request(r)
                r.status = Status.FINISHED
                r.finish_s = end_s
                finished = True
            out.append((r, toks))
        if finished:
            self.running = [r for r in self.running if r.status == Status.RUNNING]
            self._admission_blocked = False  # freed blocks and a batch slot
        return out

    # -- virtual time: skip a run of pure-decode steps ---------------------------------------

    def decode_run(self, now_s: float, limit_s: float) -> tuple[int, float]:
        """Advance every running request by the same number of decode steps, all starting
        before ``limit_s``, as long as nothing can change the batch: no finish, no admission
        (queue empty or its head blocked), enough free blocks. Returns (steps, seconds)."""
        running, cfg, blocks, p = self.running, self.config, self.blocks, self.profile
        if not running or (self.waiting and not self._admission_blocked) or now_s >= limit_s:
            return 0, 0.0
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
        a = p.base_ms + p.decode_seq_ms * batch + p.decode_ctx_ms * ctx0  # first step, ms
        d = p.decode_ctx_ms * batch  # growth per step, ms
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
        return k, (k * a + d * k * (k - 1) / 2) / 1e3


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
