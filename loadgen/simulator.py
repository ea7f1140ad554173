"""The cluster simulator: a schedule replayed in virtual time on sim engines, placed by the
production routing core.

Nothing of the router is written twice. Every request is placed by a ``router.state.RouterCore``
(the object the ingress runs) with a registered scorer, on the clock of the simulation:

- the engines are ``engines.sim.VirtualInstance``s. Their KV events leave as the bytes vLLM's
  publisher sends, go through the forwarder's ``EngineEventTranslator`` (trusted-hash mode: the
  trace's block ids are the chained hashes), onto an in-process event bus, and reach the core's
  ``CacheMap`` through its ``EngineWatcher`` and ``CacheMapIngestor`` after ``event_lag_s``;
- load samples are taken on every engine each ``load_interval_s`` (the production interval),
  encoded as on the load bus, and read by the core's watcher after ``load_lag_s``. Only the
  latest sample before a placement is ever read, so only those are materialised;
- first tokens and finishes reach the core when they happen (the ingress sees the stream), so
  the core's in-flight accounting and kv_ttft's online calibration learn as in production;
- SLO admission is the core's ``Admission.check_slo``: a rejected request is a 429.

Prefill/decode disaggregation (``SimSettings.prefill_instances``): the first instances form a
``prefill`` pool and the rest a ``decode`` pool; the core's ``router.pd.PdPlanner`` places both
legs of every request as the ingress's dispatcher does. A split request's prefill leg (one
token, ``do_remote_decode``) runs on its prefill instance; when it finishes, its
``kv_transfer_params`` go with the request to the decode instance at that moment, which pulls
the KV (``transfer_gbps``, ``transfer_latency_ms``) and decodes; the client's TTFT is the
decode's first token. A request the planner keeps whole runs on its decode instance.

Truth and belief are different objects: engines run on the workload's *truth* profile stretched
per engine (a seeded speed factor, per-step jitter, optional stragglers: ``Perturbation``); the
router prices with its own profile, loaded separately (by default the same shipped profile,
unperturbed). What is not modelled: network and ingress time, the concurrency gate of admission
(``max_in_flight``), engine failures, request cancellation.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import math
import multiprocessing
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import msgspec

from cachemap.bus import InProcessBus
from cachemap.events import encode_message
from cachemap.ingest import EngineEventTranslator
from engines.base import LOAD_INTERVAL_S
from engines.forwarder import encode_load
from engines.sim.profile import LatencyProfile
from engines.sim.request import SimRequest
from engines.sim.scheduler import DEFAULT_TRANSFER_GBPS, DEFAULT_TRANSFER_LATENCY_MS
from engines.sim.virtual import VirtualInstance, trace_arrival
from loadgen.cachesim import request_info
from loadgen.records import RequestRecord
from loadgen.workloads import Planned, ideal_hits
from router import lifecycle
from router.admission import Admission, Rejected
from router.pd import (
    DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
    DEFAULT_OVERLOAD_FACTOR,
    PdPlanner,
    TransferModel,
)
from router.placement import Placement, PlacementRequest, Scorer, create_scorer
from router.pools import Pool
from router.state import PlacementRecorder, RouterCore

# VirtualInstance options an ``--engine key=value`` may set
ENGINE_OPTIONS: tuple[str, ...] = (
    "num_gpu_blocks",
    "cpu_capacity_blocks",
    "cpu_policy",
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "max_num_seqs",
    "max_model_len",
    "transfer_gbps",
    "transfer_latency_ms",
)


@dataclass(frozen=True, slots=True)
class Perturbation:
    """How the simulated engines' truth departs from the profile, all seeded.

    ``speed_sigma``: each engine's slowdown is log-normal with this sigma and mean 1;
    ``jitter``: per-step log-normal sigma (mean 1); ``stragglers``: the fraction of engines
    (rounded) that run ``straggler_slowdown`` times slower on top of their speed factor."""

    speed_sigma: float = 0.1
    jitter: float = 0.05
    stragglers: float = 0.0
    straggler_slowdown: float = 3.0
    seed: int = 0

    def __post_init__(self) -> None:
        # named by the ``kvroute simulate`` flag that sets each field
        checks = {
            "--speed-sigma": (self.speed_sigma, 0 <= self.speed_sigma < 2, "in [0, 2)"),
            "--jitter": (self.jitter, 0 <= self.jitter < 2, "in [0, 2)"),
            "--stragglers": (self.stragglers, 0 <= self.stragglers <= 1, "in [0, 1]"),
            "--straggler-slowdown": (self.straggler_slowdown, self.straggler_slowdown >= 1, ">= 1"),
        }
        for flag, (value, ok, valid) in checks.items():
            if not ok:
                raise ValueError(f"{flag} must be {valid}, got {value}")

    def slowdowns(self, n: int) -> list[float]:
        rng = random.Random(f"speed/{self.seed}")
        s = self.speed_sigma
        out = [math.exp(rng.gauss(-s * s / 2, s)) if s else 1.0 for _ in range(n)]
        for i in rng.sample(range(n), round(self.stragglers * n)):
            out[i] *= self.straggler_slowdown
        return out


EXACT = Perturbation(speed_sigma=0.0, jitter=0.0)


@dataclass(slots=True)
class SimSettings:
    """One simulated cluster: engines, their truth, the router's lags and SLO gate."""

    instances: int = 16
    block_size: int | None = None  # default: the workload's (Mooncake 512, synthetic 16)
    engine: dict[str, Any] = field(default_factory=dict)  # VirtualInstance options
    perturbation: Perturbation = field(default_factory=Perturbation)
    event_lag_s: float = 0.01
    load_lag_s: float = 0.01
    load_interval_s: float = LOAD_INTERVAL_S
    slo_ttft_s: float | None = None  # admission: reject when the best estimate breaks it
    # prefill/decode: the first ``prefill_instances`` engines are a prefill pool, the rest a
    # decode pool (0: every engine colocated)
    prefill_instances: int = 0
    pd_max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS
    pd_overload_factor: float | None = DEFAULT_OVERLOAD_FACTOR

    def gpu_blocks(self, truth: LatencyProfile, block_size: int) -> int:
        """Each engine's GPU KV blocks: ``num_gpu_blocks`` when set, else the profile's
        capacity (what the router is told an engine holds)."""
        return int(self.engine.get("num_gpu_blocks") or truth.kv_capacity_tokens // block_size)

    def validate(self) -> None:
        if self.instances < 1:
            raise ValueError(f"--instances must be >= 1, got {self.instances}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        for lag in (self.event_lag_s, self.load_lag_s):
            if not 0 <= lag < 60:
                raise ValueError(f"--lag-ms must be in [0, 60000), got {lag * 1e3:g}")
        if not self.load_interval_s > 0:
            raise ValueError(f"load_interval_s must be > 0, got {self.load_interval_s}")
        if self.prefill_instances and not 0 < self.prefill_instances < self.instances:
            raise ValueError(
                f"--prefill-instances must be in [1, --instances), got {self.prefill_instances}"
            )
        unknown = sorted(set(self.engine) - set(ENGINE_OPTIONS))
        if unknown:
            raise ValueError(
                f"--engine: unknown option {unknown[0]!r}; valid: {', '.join(ENGINE_OPTIONS)}"
            )


@dataclass(slots=True)
class SloBudget:
    """Ends a replay early once more than ``max_misses`` requests have missed the SLO: the run
    can no longer attain it, and simulating the rest would only cost time (the capacity
    planner's early exit on configurations that fail). A request misses when it is refused (a
    400 or 429), when its first token comes later than ``ttft_s`` after its arrival, or when it
    finishes with a mean time per output token over ``tpot_s``; each counts once, under the
    first of those. A request still waiting for its first token is not counted until then."""

    ttft_s: float
    tpot_s: float | None
    max_misses: int
    ttft_misses: int = 0
    tpot_misses: int = 0
    refused: int = 0

    @property
    def misses(self) -> int:
        return self.ttft_misses + self.tpot_misses + self.refused

    @property
    def exhausted(self) -> bool:
        return self.misses > self.max_misses

    def first_token(self, ttft_s: float) -> None:
        if ttft_s > self.ttft_s:
            self.ttft_misses += 1

    def finished(self, req: SimRequest) -> None:
        if self.tpot_s is None or req.num_output < 2 or req.ttft_s > self.ttft_s:
            return  # no TPOT to judge, or already counted at its first token
        if (req.finish_s - req.first_token_s) / (req.num_output - 1) > self.tpot_s:
            self.tpot_misses += 1


@dataclass(slots=True)
class SimRun:
    """What one simulated run produced."""

    router: str
    records: list[RequestRecord]
    queue: list[tuple[float, str, int, int]]  # (t, instance, waiting, running) per load sample
    span_s: float  # first arrival to last finish, virtual seconds
    wall_s: float
    calibration: dict[str, float] | None
    slowdowns: list[float]  # each engine's speed factor over the profile
    aborted: bool = False  # a ``SloBudget`` ran out: records after that point are unfinished

    @property
    def requests_per_wall_s(self) -> float:
        return len(self.records) / self.wall_s if self.wall_s > 0 else math.inf


ProgressFn = Callable[[int, int], None]  # (requests placed, total)


# the young generation's collection threshold during a replay (CPython's default: 700)
_REPLAY_GC_THRESHOLD = 20_000


class ClusterSimulator:
    """``instances`` virtual engines behind one routing core. ``run`` replays a schedule."""

    def __init__(
        self,
        truth: LatencyProfile,
        scorer: Scorer | str,
        settings: SimSettings,
        trace_block_size: int,
        *,
        router_profile: LatencyProfile | None = None,
        recorder: PlacementRecorder | None = None,
    ) -> None:
        settings.validate()
        self.settings = s = settings
        self.block_size = bs = s.block_size or trace_block_size
        self.trace_block_size = trace_block_size
        eng = dict(s.engine)
        # the engines' limits bind the router's cost model too (as ``deploy.app`` does)
        truth, _ = engine_profile(truth, s)
        belief = router_profile if router_profile is not None else LatencyProfile.load(truth.name)
        belief, _ = engine_profile(belief, s)
        p = s.perturbation
        self.slowdowns = p.slowdowns(s.instances)
        self.kv_bus, self.load_bus = InProcessBus(1 << 16), InProcessBus(1 << 16)
        gpu_blocks = s.gpu_blocks(truth, bs)
        n_prefill = s.prefill_instances
        pools, planner = None, None
        if n_prefill:
            pools = [
                Pool("prefill", "prefill", bs, belief, gpu_blocks),
                Pool("decode", "decode", bs, belief, gpu_blocks),
            ]
            transfer = TransferModel(
                belief.kv_bytes_per_token,
                float(eng.get("transfer_gbps", DEFAULT_TRANSFER_GBPS)),
                float(eng.get("transfer_latency_ms", DEFAULT_TRANSFER_LATENCY_MS)) / 1e3,
            )
            planner = PdPlanner(transfer, s.pd_max_local_prefill_tokens, s.pd_overload_factor)
        self.core = RouterCore(
            scorer,
            belief,
            bs,
            gpu_blocks,
            kv_bus=self.kv_bus,
            load_bus=self.load_bus,
            admission=Admission(slo_ttft_s=s.slo_ttft_s),
            recorder=recorder,
            pools=pools,
            planner=planner,
        )
        # PD: per decode instance (by index), the hand-overs waiting to reach it, as
        # (time, seq, request) heaps; the instances that got one since the last look; and per
        # split request its decode placement and the client's arrival time
        self._handovers: dict[int, list[tuple[float, int, SimRequest]]] = {}
        self._handed: set[int] = set()
        self._split: dict[str, tuple[Placement, PlacementRequest]] = {}
        self._output: dict[str, int] = {}  # split request -> its output length
        self._events: dict[str, deque[tuple[float, bytes]]] = {}
        self._progress: list[tuple[float, int, str, SimRequest, bool]] = []
        self._progress_seq = 0
        self._budget: SloBudget | None = None
        self.translators: dict[str, EngineEventTranslator] = {}
        self.instances: list[VirtualInstance] = []
        for i in range(s.instances):
            iid = f"sim-{i}"
            self.translators[iid] = EngineEventTranslator(iid, "sim", bs, trusted_hashes=True)
            self._events[iid] = deque()
            self.instances.append(
                VirtualInstance(
                    iid,
                    truth,
                    block_size=bs,
                    on_events=self._on_events,
                    on_progress=self._progress_fn(iid),
                    slowdown=self.slowdowns[i],
                    jitter=p.jitter,
                    seed=p.seed * 100_003 + i,
                    **eng,
                )
            )
        self.by_id = {inst.instance_id: inst for inst in self.instances}
        self._index = {inst.instance_id: i for i, inst in enumerate(self.instances)}
        if n_prefill:
            ids = list(self.by_id)
            self.core.sync_instances(ids[:n_prefill], "prefill")
            self.core.sync_instances(ids[n_prefill:], "decode")
        else:
            self.core.sync_instances(self.by_id)

    def close(self) -> None:
        """Unhook the engines from this cluster: their event and progress callbacks are its
        methods, the one reference cycle a replay leaves, so unhooked, a dropped cluster is
        freed by reference counting at once instead of by a full collector pass (the next
        replay's, which had to walk all of it). The engines stay readable; they no longer
        report, so the cluster must not run again."""
        for inst in self.instances:
            inst.on_events = inst.on_progress = None

    # -- what the engines emit ---------------------------------------------------------------

    def _on_events(self, instance: str, seq: int, payload: bytes) -> None:
        """An engine's KV event batch, through the forwarder's translator, queued for the bus
        until its lag has passed."""
        ts = self.by_id[instance].clock
        msg = self.translators[instance].feed(payload, seq, ts)
        if msg is not None:
            self._events[instance].append((ts, encode_message(msg)))

    def _progress_fn(self, iid: str) -> Callable[[float, SimRequest, bool], None]:
        def on_progress(t: float, req: SimRequest, finished: bool) -> None:
            self._progress_seq += 1
            heapq.heappush(self._progress, (t, self._progress_seq, iid, req, finished))
            if finished and req.remote_decode:
                self._hand_over(t, req)

        return on_progress

    def _hand_over(self, t: float, prefill: SimRequest) -> None:
        """A prefill leg finished at ``t``: its request goes to its decode instance with the
        prefill's ``kv_transfer_params`` (queued there until that instance runs up to ``t``).
        A prefill aborted without them (none here) would leave its request unserved."""
        rid = lifecycle.request_of_prefill_leg(prefill.request_id)
        decode, _ = self._split[rid]
        inst = self.by_id[decode.instance_id]
        _, req = trace_arrival(
            rid,
            t,
            prefill.prompt_len,
            self._output[rid],
            prefill.block_hashes[: prefill.prompt_len // inst.block_size],
            inst.block_size,
            inst.block_size,
            inst.max_model_len,
            prefill.info,
            kv_transfer_params=prefill.kv_transfer_params,
        )
        i = self._index[decode.instance_id]
        self._progress_seq += 1
        heapq.heappush(self._handovers.setdefault(i, []), (t, self._progress_seq, req))
        self._handed.add(i)

    def _run(self, i: int, t: float) -> None:
        """Run instance ``i`` up to ``t``, handing it first every request handed over before."""
        inst, q = self.instances[i], self._handovers.get(i)
        while q and q[0][0] < t:
            at, _, req = heapq.heappop(q)
            inst.run_until(at)
            inst.submit(req, at)
            decode, preq = self._split[req.request_id]
            self.core.assigned(preq, decode, at)
        inst.run_until(t)

    # -- the replay --------------------------------------------------------------------------

    def run(
        self,
        plan: Sequence[Planned],
        progress: ProgressFn | None = None,
        budget: SloBudget | None = None,
    ) -> SimRun:
        """Replay ``plan`` (send offsets in seconds, in order) to completion, or until
        ``budget`` is exhausted (then ``SimRun.aborted``: requests in flight stay unfinished
        and later ones have no record)."""
        wall0 = time.perf_counter()  # the collector's set-up counts too
        self._budget = budget
        with _replay_collector():
            return self._replay(plan, progress, wall0)

    def _replay(self, plan: Sequence[Planned], progress: ProgressFn | None, wall0: float) -> SimRun:
        s, core, bs = self.settings, self.core, self.block_size
        by_id = self.by_id
        interval, load_lag, event_lag = s.load_interval_s, s.load_lag_s, s.event_lag_s
        mml = self.instances[0].max_model_len
        preqs: dict[str, tuple[PlacementRequest, Planned]] = {}
        records: dict[str, RequestRecord] = {}
        queue: list[tuple[float, str, int, int]] = []
        roots: dict[int, int] = {}  # chat id -> its session's first chat id
        last_tick = -1
        sampled: list[tuple[tuple[int, int], Any]] = [((-1, -1), None)] * len(self.instances)
        total = len(plan)
        budget, aborted = self._budget, False
        instances = self.instances
        # NOTE: only the instances with a step to run before t are run up to it, found on a
        # heap of their wake times (entries whose time is no longer the instance's are stale);
        # they run in index order, as a loop over all of them would (progress at equal times is
        # delivered in the order it was produced).
        wake = [inst.wake_s() for inst in instances]
        due_heap = [(w, i) for i, w in enumerate(wake)]
        heapq.heapify(due_heap)
        for n, p in enumerate(plan):
            t, tr = p.offset_s, p.req
            rid = str(p.index)
            # 1. load samples: the latest taken strictly before t - lag is what the router can
            # have read. NOTE: not "at": with no lag a sample stamped t would be taken before
            # the requests placed at t, and LoadTracker counts only assignments newer than a
            # sample, so every request arriving at t (traces share millisecond stamps) went
            # unseen and --lag-ms 0 piled them on one engine.
            tick = math.ceil((t - load_lag) / interval) - 1
            if tick > last_tick and tick >= 0:
                last_tick = tick
                ts = tick * interval
                for i, inst in enumerate(self.instances):
                    self._run(i, ts)
                    state = (inst.steps, inst.submitted)
                    if state == sampled[i][0]:  # nothing changed: the same sample, restamped
                        snap = msgspec.structs.replace(sampled[i][1], ts=ts)
                    else:
                        snap = inst.load(ts)
                    sampled[i] = (state, snap)
                    self.load_bus.publish(encode_load(snap))
                    queue.append((ts, inst.instance_id, snap.waiting, snap.running))
                    w = inst.wake_s()
                    if w != wake[i]:
                        wake[i] = w
                        heapq.heappush(due_heap, (w, i))
            due = []
            while due_heap and due_heap[0][0] < t:
                w, i = heapq.heappop(due_heap)
                if w == wake[i]:
                    wake[i] = -math.inf  # taken: a second entry of the same time is stale
                    due.append(i)
            due.sort()
            for i in due:
                self._run(i, t)
                wake[i] = w = instances[i].wake_s()
                heapq.heappush(due_heap, (w, i))
            if self._handed:  # PD: decode instances handed requests while prefills ran
                for i in sorted(self._handed):
                    q = self._handovers[i]
                    if q and q[0][0] < t:
                        self._run(i, t)
                    w = min(instances[i].wake_s(), q[0][0] if q else math.inf)
                    if w != wake[i]:
                        wake[i] = w
                        heapq.heappush(due_heap, (w, i))
                self._handed.clear()
            # 2. what the ingress saw of the streams up to t
            self._deliver_progress(t, preqs)
            if budget is not None and budget.exhausted:
                aborted = True
                break
            # 3. KV events older than the lag, through the bus into the map
            horizon = t - event_lag
            for dq in self._events.values():
                while dq and dq[0][0] <= horizon:
                    self.kv_bus.publish(dq.popleft()[1])
            self._pump(t)
            # 4. place, admit, send
            rec = RequestRecord(
                p.index,
                tr.category,
                tr.chat_id,
                tr.input_length,
                tr.output_length,
                t,
                sent_s=t,
                prompt_tokens=tr.input_length,
            )
            records[rid] = rec
            session = _session_key(tr.chat_id, tr.parent_chat_id, roots)
            try:
                _, req = trace_arrival(
                    rid,
                    t,
                    tr.input_length,
                    tr.output_length,
                    tr.hash_ids,
                    self.trace_block_size,
                    bs,
                    mml,
                    request_info(tr, p.index),
                )
            except ValueError as e:
                rec.error, rec.status, rec.error_detail, rec.done_s = "http_400", 400, str(e), t
                self._refused()
                continue
            preq = PlacementRequest(
                rid,
                tr.input_length,
                req.block_hashes[: tr.input_length // bs],
                max_tokens=max(tr.output_length, 1),
                session_key=session,
                category=tr.category,
            )
            try:
                placement = lifecycle.admit(core, preq, t)
            except Rejected as e:
                rec.error, rec.status, rec.error_detail, rec.done_s = "http_429", 429, e.reason, t
                self._refused()
                continue
            leg, leg_place = req, placement
            if placement.prefill is not None:  # PD: the prefill leg now, the decode on handover
                leg_place = placement.prefill
                _, leg = trace_arrival(
                    lifecycle.prefill_leg_id(rid),
                    t,
                    tr.input_length,
                    1,
                    tr.hash_ids,
                    self.trace_block_size,
                    bs,
                    mml,
                    req.info,
                    kv_transfer_params=lifecycle.prefill_params(None),
                )
            inst = by_id[leg_place.instance_id]
            try:
                inst.submit(leg, t)
            except ValueError as e:
                rec.error, rec.status, rec.error_detail, rec.done_s = "http_400", 400, str(e), t
                self._refused()
                continue
            i = self._index[leg_place.instance_id]
            w = inst.wake_s()
            if w != wake[i]:
                wake[i] = w
                heapq.heappush(due_heap, (w, i))
            rec.instance = placement.instance_id
            preqs[rid] = (preq, p)
            if leg is req:
                core.assigned(preq, placement, t)
            else:
                leg_preq = replace(preq, request_id=leg.request_id)
                core.assigned(leg_preq, leg_place, t)
                preqs[leg.request_id] = (leg_preq, p)
                self._split[rid] = (placement, preq)
                self._output[rid] = max(tr.output_length, 1)
            if progress is not None and n % 1000 == 999:
                progress(n + 1, total)
        if not aborted:
            for i in range(len(self.instances)):  # prefill instances first: their hand-overs
                self._run(i, math.inf)
            self._deliver_progress(math.inf, preqs)
        wall = time.perf_counter() - wall0
        if progress is not None:
            progress(total, total)
        for inst in self.instances:
            for r in inst.finished:
                if r.remote_decode:  # a prefill leg: its request's record is its decode's
                    continue
                rec = records[r.request_id]
                rec.first_token_s, rec.done_s = r.first_token_s, r.finish_s
                rec.output_tokens = r.num_output
                # NOTE: a decode leg reports the prefill's cache hit (vLLM's usage does too)
                rec.cached_tokens = r.reported_cached_tokens
                rec.cpu_cached_tokens = r.cpu_cached_tokens
                rec.preemptions, rec.status = r.num_preemptions, 200
        out = sorted(records.values(), key=lambda r: r.index)
        done = [r.done_s for r in out if not math.isnan(r.done_s)]
        first = out[0].intended_s if out else 0.0
        cal = getattr(core.scorer, "calibration", None)
        return SimRun(
            router=core.scorer.name,
            records=out,
            queue=queue,
            span_s=(max(done) - first) if done else 0.0,
            wall_s=wall,
            calibration=(
                {"a": cal.a, "b": cal.b, "c": cal.c, "d": cal.d, "samples": cal.samples}
                if cal is not None
                else None
            ),
            slowdowns=self.slowdowns,
            aborted=aborted,
        )

    def _refused(self) -> None:
        if self._budget is not None:
            self._budget.refused += 1

    def _deliver_progress(
        self, t: float, preqs: dict[str, tuple[PlacementRequest, Planned]]
    ) -> None:
        heap, core, budget = self._progress, self.core, self._budget
        while heap and heap[0][0] <= t:
            at, _, iid, req, finished = heapq.heappop(heap)
            if finished:
                entry = preqs.pop(req.request_id, None)
                if entry is not None:
                    core.finished(entry[0], iid)
                if budget is not None:
                    budget.finished(req)
            else:
                core.first_token(req.request_id, at)
                if budget is not None and not req.remote_decode:
                    # NOTE: a decode leg arrived at its hand-over; the client at the plan's time
                    entry = preqs.get(req.request_id)
                    budget.first_token(at - (entry[1].offset_s if entry else req.arrival_s))

    def _pump(self, now: float) -> None:
        core = self.core
        while True:  # a burst larger than one bus read is applied whole, as a busy pump would
            fetched = core.fetch()
            core.apply(fetched, now)
            if fetched is None or max(len(fetched[0].items), len(fetched[1].items)) < 4096:
                return


@contextlib.contextmanager
def _replay_collector() -> Iterator[None]:
    """The garbage collector's settings for one replay. A replay allocates millions of small
    objects, most short-lived: with the default young-generation threshold (700) the collector
    runs every few placements, and its full passes walk the whole heap again each time (the
    plan alone: a million requests at scale). So the heap the replay starts with is frozen out
    of collection (unless the process froze its own), and the young generation is collected
    less often; both are restored afterwards. Cycles are still collected. NOTE: nothing is
    collected before the freeze (a full pass over the heap, ~0.05 s with only the Mooncake plan
    in it): ``simulate`` frees a finished replay's cluster by reference counting
    (``ClusterSimulator.close``), and cyclic garbage a caller left is only kept through this
    replay, then collected as usual once unfrozen."""
    thresholds = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(_REPLAY_GC_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if freeze:
            gc.unfreeze()


def _session_key(chat_id: int | None, parent: int | None, roots: dict[int, int]) -> str | None:
    """The session a Bailian-shaped request belongs to (its first turn's chat id), as the
    ingress's session header would carry it; None for session-less traces (Mooncake)."""
    if chat_id is None:
        return None
    roots[chat_id] = root = chat_id if parent is None else roots.get(parent, parent)
    return str(root)


def simulate(
    plan: Sequence[Planned],
    trace_block_size: int,
    truth: LatencyProfile,
    router: str,
    settings: SimSettings,
    *,
    scorer_options: dict[str, Any] | None = None,
    router_profile: LatencyProfile | None = None,
    recorder: PlacementRecorder | None = None,
    progress: ProgressFn | None = None,
    budget: SloBudget | None = None,
) -> SimRun:
    """One router over one schedule on a fresh cluster (see ``ClusterSimulator``)."""
    scorer = create_scorer(router, **(scorer_options or {}))
    sim = ClusterSimulator(
        truth,
        scorer,
        settings,
        trace_block_size,
        router_profile=router_profile,
        recorder=recorder,
    )
    try:
        return sim.run(plan, progress, budget)
    finally:
        sim.close()


def engine_profile(truth: LatencyProfile, settings: SimSettings) -> tuple[LatencyProfile, int]:
    """``truth`` with the scheduler limits of the engines of ``settings`` (what they run, and
    what the router prices with), and their ``max_model_len``, before any ``Perturbation``."""
    eng = settings.engine
    prof = truth.with_limits(
        eng.get("max_num_batched_tokens"), eng.get("long_prefill_token_threshold")
    )
    return prof, int(eng.get("max_model_len") or prof.max_model_len)


def ideal_ttfts(
    plan: Sequence[Planned], trace_block_size: int, truth: LatencyProfile, settings: SimSettings
) -> list[float]:
    """Each request's ideal TTFT in seconds, in plan order: alone on an idle engine of the
    truth profile (``engine_profile``: unperturbed), with every block that any earlier request
    of the plan carried already in its GPU cache (``ideal_hits``; a full hit still computes the
    last token). NaN for a prompt the engines refuse (at or over ``max_model_len``).

    No router can place a request faster, up to the perturbation: a request on an engine that
    ``Perturbation`` made faster than the profile (its speed factor or a step's jitter below
    1) can come in under it, so the excess over it can be slightly negative there; with
    ``EXACT`` every measured TTFT is at least this. The capacity planner's ceiling
    (``PlanSetup.ceiling``) is the attainment of these TTFTs."""
    prof, max_len = engine_profile(truth, settings)
    out: list[float] = []
    for r, k in ideal_hits(p.req for p in plan):
        if r.input_length >= max_len:
            out.append(math.nan)
            continue
        cached = min(k * trace_block_size, r.input_length - 1) if r.input_length else 0
        out.append(prof.ttft_s(r.input_length, max(cached, 0)))
    return out


def check_jobs(jobs: int) -> None:
    """A process count for ``fork_pool``: raises naming ``--jobs`` below 1."""
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")


def fork_pool(jobs: int) -> ProcessPoolExecutor | None:
    """``jobs`` worker processes forked from this one (they inherit its memory: a workload
    and profiles are shared, not pickled), or None for ``jobs`` == 1 (run here)."""
    check_jobs(jobs)
    if jobs == 1:
        return None
    sys.stdout.flush()  # a buffer a worker inherited would be written twice
    sys.stderr.flush()
    return ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))


T = TypeVar("T")

# the calls ``run_each``'s forked workers make (inherited at the fork, never pickled)
_INHERITED: list[Callable[[], Any]] = []


def _call_inherited(k: int) -> Any:
    return _INHERITED[k]()


def run_each(
    calls: Sequence[Callable[[], T]],
    jobs: int,
    poll: Callable[[], None] | None = None,
    poll_s: float = 0.1,
) -> list[T]:
    """Every call's result, in order: made here one after another when ``jobs`` is 1, else
    ``jobs`` at a time in forked workers (``fork_pool``); the calls (closures too) are
    inherited, only their results are pickled. ``poll`` runs every ``poll_s`` while workers
    run (a progress bar's refresh). The first call to raise ends the batch (calls not started
    are cancelled) and its exception is raised here as the call would have raised it."""
    check_jobs(jobs)
    pool = fork_pool(max(1, min(jobs, len(calls))))
    if pool is None:
        return [call() for call in calls]
    if _INHERITED:
        raise RuntimeError("run_each: already running a batch in this process")
    _INHERITED[:] = calls
    try:
        with pool:
            futures = [pool.submit(_call_inherited, k) for k in range(len(calls))]
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=poll_s, return_when=FIRST_EXCEPTION)
                if poll is not None:
                    poll()
                failed = [f for f in futures if f in done and f.exception() is not None]
                if failed:
                    pool.shutdown(cancel_futures=True)
                    failed[0].result()
            return [f.result() for f in futures]
    finally:
        _INHERITED.clear()
