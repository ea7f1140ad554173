"""Virtual-time sim engines: the same block manager, scheduler and profile as the real-time engine,
driven by a discrete-event loop instead of asyncio, so an hour of trace replays in seconds.

``VirtualInstance`` is one engine with its own clock: ``submit`` queues a request at a time,
``run_until(t)`` executes every step that starts before ``t`` (skipping runs of pure-decode
steps in closed form), ``drain`` runs to idle. KV events, when a callback is given, are delivered
per step as the event objects vLLM's ZMQ publisher encodes (``(instance_id, seq, events)``, for
``EngineEventTranslator.translate``: a virtual cluster skips the bytes; the served sim engine,
``engines.sim.engine``, publishes them encoded, as vLLM does); first tokens and finishes are
announced to ``on_progress``. Placement is not this module's business:
the cluster simulator (``simulation.cluster``) runs the production routing core over instances.

An instance may run *slower than its profile*, as real engines do: ``slowdown`` stretches every
step (a per-engine speed factor, a straggler) and ``jitter`` multiplies each step by a seeded
log-normal draw of that sigma with mean 1 (a run of ``n`` decode steps skipped in closed form
draws one factor of sigma ``jitter / sqrt(n)``, the spread of the mean of ``n`` draws). The
profile the router prices with stays the unperturbed one: the truth is not the belief.

Prefill/decode disaggregation comes from the scheduler (see ``engines.sim.scheduler``): a
finished prefill (``do_remote_decode``) carries ``SimRequest.kv_transfer_params`` for the decode
engine; a decode request (``do_remote_prefill``) records ``remote_tokens`` and ``transfer_s``,
and the instance wakes when its KV arrives (``wake_s``). KV transfers are network time: neither
``slowdown`` nor ``jitter`` stretches them.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engines.base import LoadSnapshot
from engines.profile import LatencyProfile
from engines.sim.options import DEFAULT_OPTIONS, SimEngineOptions
from engines.sim.pool import SimPool
from engines.sim.request import SimRequest, Status, make_request
from engines.sim.scheduler import Scheduler
from policies.base import RequestInfo

# (instance id, the batch's sequence number, the step's events: vLLM's event objects)
EventCallback = Callable[[str, int, list[Any]], None]
# (time, request, finished): the request's first token (finished False) or its end (True)
ProgressCallback = Callable[[float, SimRequest, bool], None]


class VirtualInstance:
    """One sim engine on a virtual clock, shaped by ``options`` (``SimEngineOptions``). Its
    ``block_size`` may differ from the profile's (e.g. a trace's 512-token blocks for speed);
    the KV capacity in tokens stays the profile's. ``slowdown``, ``jitter`` and ``seed``: how it
    runs slower than its profile (above). ``pool``: the cluster's KV pool it stores to and loads
    from (``engines.sim.pool``), shared with the other engines; None: none."""

    def __init__(
        self,
        instance_id: str,
        profile: LatencyProfile,
        *,
        options: SimEngineOptions = DEFAULT_OPTIONS,
        on_events: EventCallback | None = None,
        on_progress: ProgressCallback | None = None,
        slowdown: float = 1.0,
        jitter: float = 0.0,
        seed: int = 0,
        pool: SimPool | None = None,
    ) -> None:
        if not (slowdown > 0 and math.isfinite(slowdown)):
            raise ValueError(f"slowdown must be a positive number, got {slowdown}")
        if not 0 <= jitter < 2:
            raise ValueError(f"jitter must be in [0, 2), got {jitter}")
        self.instance_id = instance_id
        self.profile = profile
        self.scheduler = Scheduler.for_profile(
            profile, options, enable_events=on_events is not None, engine_id=instance_id
        )
        self.blocks = self.scheduler.blocks
        self.blocks.pool = pool
        self.on_events = on_events
        self.on_progress = on_progress
        self.slowdown, self.jitter = slowdown, jitter
        self._rng = random.Random(seed)
        self._overhead_s = profile.request_overhead_ms / 1e3
        # (ready time, request): arrived, not yet at the scheduler (the request overhead)
        self._pending: deque[tuple[float, SimRequest]] = deque()
        self.clock = 0.0
        self.event_seq = 0
        self.steps = 0
        self.submitted = 0
        self.finished: list[SimRequest] = []

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
        self.submitted += 1
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
            if not sched.running and not sched.waiting:  # only pulls in flight
                ready = sched.pulling[0].kv_ready_s
                if ready > self.clock:  # idle until a KV arrives or a request
                    wake = min(ready, pending[0][0]) if pending else ready
                    if wake >= t:
                        return
                    self.clock = wake
                    continue
            if self.clock >= t:
                return
            self._step(min(t, pending[0][0]) if pending else t)

    def wake_s(self) -> float:
        """The earliest ``t`` for which ``run_until(t)`` runs a step: below it, a call only
        hands requests that reached the scheduler's time to its queue, which the next call
        that steps does first. So a driver of many instances may skip those calls, but not
        the one before ``load`` (whose queued prefill counts the scheduler's queue only).
        With only KV pulls in flight, it is the first KV's arrival (the step admitting it)."""
        pending, sched = self._pending, self.scheduler
        if sched.running or sched.waiting or (pending and pending[0][0] <= self.clock):
            return self.clock
        wake = pending[0][0] if pending else math.inf
        if sched.pulling:  # the first KV to arrive
            wake = min(wake, max(sched.pulling[0].kv_ready_s, self.clock))
        return wake

    def drain(self) -> None:
        self.run_until(float("inf"))

    def _stretch(self, steps: int) -> float:
        """The truth's factor over the profile for ``steps`` steps (mean ``slowdown``)."""
        if not self.jitter:
            return self.slowdown
        sigma = self.jitter / math.sqrt(steps)
        return self.slowdown * math.exp(self._rng.gauss(-sigma * sigma / 2, sigma))

    def _step(self, limit_s: float) -> None:
        sched = self.scheduler
        step = sched.schedule(self.clock)
        if not step.scheduled and not step.preempted:
            # the queue's head waits for blocks that pulls in flight hold (the step may have
            # started pulls): idle until a KV arrives
            ready = sched.next_kv_ready_s()
            if math.isinf(ready):
                raise RuntimeError(f"instance {self.instance_id}: requests queued but none can run")
            self.clock = max(self.clock, min(ready, limit_s))
            self.steps += 1
            self._flush_events()
            return
        end = self.clock + step.duration_s * self._stretch(1)
        progress = self.on_progress
        for r, _ in sched.complete(step, end):
            if progress is not None and r.first_token_s == end:
                progress(end, r, False)
            if r.status == Status.FINISHED:
                self.finished.append(r)
                if progress is not None:
                    progress(end, r, True)
        self.clock = end
        self.steps += 1
        self._flush_events()
        if sched.pulling:  # no skipping past a KV's arrival: the next step admits it
            limit_s = min(limit_s, sched.next_kv_ready_s(end))
        if end < limit_s:
            # NOTE: the run is sized on the profile's clock, so stretch the horizon to match.
            n, dur = sched.decode_run(end, end + (limit_s - end) / self.slowdown)
            if n:
                self.clock = end + dur * self._stretch(n)
                self.steps += n
                self._flush_events()

    def _flush_events(self) -> None:
        if self.on_events is None:
            return
        events = self.blocks.take_events()
        if events:
            self.on_events(self.instance_id, self.event_seq, events)
            self.event_seq += 1

    # -- what the router may read ---------------------------------------------------------------

    def load(self, ts: float | None = None) -> LoadSnapshot:
        """This engine's load sample, stamped ``ts`` (default: its clock)."""
        s, at = self.scheduler, self.clock if ts is None else ts
        # NOTE: pulls in flight wait, as vLLM's num_requests_waiting gauge counts them
        return s.load_snapshot(
            self.instance_id, at, len(s.waiting) + len(self._pending) + len(s.pulling), at
        )


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
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> tuple[float, SimRequest]:
    """One trace line (Mooncake/Bailian fields, normalised units) as a hash-only arrival
    (the prefill or decode half of a PD request with ``kv_transfer_params``).

    Raises ``ValueError`` for a prompt that does not fit ``max_model_len`` or malformed
    ``kv_transfer_params``."""
    hashes = expand_trace_hashes(hash_ids, input_length, trace_block_size, block_size)
    req = make_request(
        request_id,
        block_size=block_size,
        max_tokens=max(output_length, 1),
        prompt_len=input_length,
        prompt_block_hashes=hashes,
        max_model_len=max_model_len,
        info=info,
        kv_transfer_params=kv_transfer_params,
    )
    return timestamp_s, req


def expand_trace_hashes(
    hash_ids: Sequence[int], input_length: int, trace_block_size: int, block_size: int
) -> list[int]:
    """Engine block hashes for a trace request's full blocks.

    Trace ids identify a whole prefix, so they serve as hashes directly when the engine block
    size equals the trace's; a smaller size that divides it gets ``id * ratio + sub-block``; a
    multiple of it takes the id of the last trace block it covers (which names the same prefix).
    """
    n_full = input_length // block_size
    if block_size == trace_block_size:
        return list(hash_ids[:n_full])
    if block_size % trace_block_size == 0:
        k = block_size // trace_block_size
        return [hash_ids[(i + 1) * k - 1] for i in range(n_full)]
    if trace_block_size % block_size:
        raise ValueError(
            f"block_size {block_size} must divide, equal or be a multiple of the trace's "
            f"{trace_block_size}"
        )
    ratio = trace_block_size // block_size
    return [hash_ids[i // ratio] * ratio + i % ratio for i in range(n_full)]
