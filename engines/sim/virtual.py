"""Virtual-time sim engines: the same block manager, scheduler and profile as the real-time engine,
driven by a discrete-event loop instead of asyncio, so an hour of trace replays in seconds.

``VirtualInstance`` is one engine with its own clock: ``submit`` queues a request at a time,
``run_until(t)`` executes every step that starts before ``t`` (skipping runs of pure-decode
steps in closed form), ``drain`` runs to idle. ``VirtualCluster.replay`` feeds time-ordered
arrivals to a placement function that sees every instance as of the arrival time. KV events,
when a callback is given, are delivered per step as the exact bytes vLLM's ZMQ publisher sends
(``(instance_id, seq, payload)``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cachemap.events import KVEventBatch, encode_vllm_batch
from engines.base import LoadSnapshot
from engines.sim.profile import LatencyProfile
from engines.sim.request import SimRequest, Status, make_request
from engines.sim.scheduler import Scheduler
from policies.base import EvictionPolicy, RequestInfo

EventCallback = Callable[[str, int, bytes], None]


@dataclass(slots=True, frozen=True)
class RequestRecord:
    """What happened to one request (times in virtual seconds)."""

    request_id: str
    instance: str
    arrival_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    cpu_cached_tokens: int
    preemptions: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


class VirtualInstance:
    """One sim engine on a virtual clock. ``block_size`` may differ from the profile's (e.g. a
    trace's 512-token blocks for speed); the KV capacity in tokens stays the profile's."""

    def __init__(
        self,
        instance_id: str,
        profile: LatencyProfile,
        *,
        block_size: int | None = None,
        num_gpu_blocks: int | None = None,
        cpu_capacity_blocks: int = 0,
        cpu_policy: str | EvictionPolicy = "lru",
        on_events: EventCallback | None = None,
        max_num_batched_tokens: int | None = None,
        long_prefill_token_threshold: int | None = None,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.profile = profile
        self.scheduler = Scheduler.for_profile(
            profile,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            cpu_capacity_blocks=cpu_capacity_blocks,
            cpu_policy=cpu_policy,
            enable_events=on_events is not None,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            max_num_seqs=max_num_seqs,
        )
        self.blocks = self.scheduler.blocks
        self.on_events = on_events
        self._overhead_s = profile.request_overhead_ms / 1e3
        # (ready time, request): arrived, not yet at the scheduler (the request overhead)
        self._pending: deque[tuple[float, SimRequest]] = deque()
        self.clock = 0.0
        self.event_seq = 0
        self.steps = 0
        self.finished: list[RequestRecord] = []

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def submit(self, req: SimRequest, at_s: float) -> None:
        """``req`` arrives at ``at_s`` (non-decreasing across calls; run up to ``at_s`` first).

        Raises ``ValueError`` if it can never fit this instance."""
        self.scheduler.check(req)
        req.arrival_s = at_s
        self._pending.append((at_s + self._overhead_s, req))

    def run_until(self, t: float) -> None:
        """Run every step that starts before ``t``."""
        sched, pending = self.scheduler, self._pending
        while True:
            while pending and pending[0][0] <= self.clock:
                sched.add(pending.popleft()[1])
            if sched.idle:
                if not pending or pending[0][0] >= t:
                    return
                self.clock = pending[0][0]  # idle until the next request reaches the scheduler
                continue
            if self.clock >= t:
                return
            self._step(min(t, pending[0][0]) if pending else t)

    def drain(self) -> None:
        self.run_until(float("inf"))

    def _step(self, limit_s: float) -> None:
        sched = self.scheduler
        step = sched.schedule(self.clock)
        if not step.scheduled and not step.preempted:
            raise RuntimeError(f"instance {self.instance_id}: requests queued but none can run")
        end = self.clock + step.duration_s
        for r, _ in sched.complete(step, end):
            if r.status == Status.FINISHED:
                self.finished.append(_record(self.instance_id, r))
        self.clock = end
        self.steps += 1
        self._flush_events()
        if end < limit_s:
            n, dur = sched.decode_run(end, limit_s)
            if n:
                self.clock = end + dur
                self.steps += n
                self._flush_events()

    def _flush_events(self) -> None:
        if self.on_events is None:
            return
        events = self.blocks.take_events()
        if events:
            payload = encode_vllm_batch(KVEventBatch(ts=self.clock, events=events))
            self.on_events(self.instance_id, self.event_seq, payload)
            self.event_seq += 1

    # -- what a placement may look at ---------------------------------------------------------

    def load(self) -> LoadSnapshot:
        s = self.scheduler
        return s.load_snapshot(self.instance_id, self.clock, len(s.waiting) + len(self._pending))

    def outstanding(self) -> int:
        return len(self._pending) + len(self.scheduler.waiting) + len(self.scheduler.running)

    def cached_prefix_blocks(self, req: SimRequest) -> tuple[int, int]:
        """Leading blocks of ``req`` this instance would hit now: (GPU, CPU after GPU)."""
        hit, n_cpu = self.blocks.lookup(req)
        return len(hit), n_cpu


def _record(instance: str, r: SimRequest) -> RequestRecord:
    return RequestRecord(
        r.request_id,
        instance,
        r.arrival_s,
        r.first_token_s,
        r.finish_s,
        r.prompt_len,
        r.num_output,
        r.cached_tokens,
        r.cpu_cached_tokens,
        r.num_preemptions,
    )


Placement = Callable[[SimRequest, "VirtualCluster"], int]


class VirtualCluster:
    """Several virtual instances replaying one arrival stream."""

    def __init__(self, instances: Sequence[VirtualInstance]) -> None:
        if not instances:
            raise ValueError("a cluster needs at least one instance")
        self.instances = list(instances)

    @classmethod
    def build(cls, n: int, profile: LatencyProfile, **options: Any) -> VirtualCluster:
        """``n`` instances ``sim-0`` .. with the same ``VirtualInstance`` options."""
        return cls([VirtualInstance(f"sim-{i}", profile, **options) for i in range(n)])

    def replay(
        self, arrivals: Iterable[tuple[float, SimRequest]], place: Placement
    ) -> list[RequestRecord]:
        """Run time-ordered ``(arrival_s, request)`` pairs to completion; records by arrival."""
        instances = self.instances
        for t, req in arrivals:
            for inst in instances:
                inst.run_until(t)
            instances[place(req, self)].submit(req, t)
        for inst in instances:
            inst.drain()
        records = [rec for inst in instances for rec in inst.finished]
        records.sort(key=lambda rec: rec.arrival_s)
        return records


def round_robin() -> Placement:
    counter = itertools.count()
    return lambda req, cluster: next(counter) % len(cluster.instances)


def least_loaded(req: SimRequest, cluster: VirtualCluster) -> int:
    """Fewest outstanding requests; ties go to the lowest index."""
    loads = [inst.outstanding() for inst in cluster.instances]
    return loads.index(min(loads))


def prefix_affinity(req: SimRequest, cluster: VirtualCluster) -> int:
    """Longest GPU prefix hit, then fewest outstanding requests."""
    best, best_key = 0, None
    for i, inst in enumerate(cluster.instances):
        key = (-inst.cached_prefix_blocks(req)[0], inst.outstanding())
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def trace_arrival(
    request_id: str,
    timestamp_s: float,
    input_length: int,
    output_length: int,
    hash_ids: Sequence[int],
    trace_block_size: int,
    block_size: int,
    max_model_len: int | None = None,
    info: RequestInfo | None = None,
) -> tuple[float, SimRequest]:
    """One trace line (Mooncake/Bailian fields, normalised units) as a hash-only arrival.

    Raises ``ValueError`` for a prompt that does not fit ``max_model_len``."""
    hashes = expand_trace_hashes(hash_ids, input_length, trace_block_size, block_size)
    req = make_request(
        request_id,
        block_size=block_size,
        max_tokens=max(output_length, 1),
        prompt_len=input_length,
        prompt_block_hashes=hashes,
        max_model_len=max_model_len,
        info=info,
    )
    return timestamp_s, req


def expand_trace_hashes(
    hash_ids: Sequence[int], input_length: int, trace_block_size: int, block_size: int
) -> list[int]:
    """Engine block hashes for a trace request's full blocks.

    Trace ids identify a whole prefix, so they serve as hashes directly when the engine block
    size equals the trace's; a smaller size that divides it gets ``id * ratio + sub-block``.
    """
    n_full = input_length // block_size
    if block_size == trace_block_size:
        return list(hash_ids[:n_full])
    if trace_block_size % block_size:
        raise ValueError(
            f"block_size {block_size} must equal or divide the trace's {trace_block_size}"
        )
    ratio = trace_block_size // block_size
    return [hash_ids[i // ratio] * ratio + i % ratio for i in range(n_full)]
