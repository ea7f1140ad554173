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
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import msgspec

from cachemap.bus import MAX_READ_ITEMS, InProcessBus
from cachemap.events import Cleared, InstanceGone, encode_message
from cachemap.hashing import Tier
from cachemap.ingest import EngineEventTranslator
from engines.base import LOAD_INTERVAL_S
from engines.forwarder import encode_load
from engines.sim.profile import LatencyProfile
from engines.sim.request import SimRequest
from engines.sim.scheduler import SimEngineOptions
from engines.sim.virtual import VirtualInstance, trace_arrival
from loadgen.cachesim import request_info
from loadgen.records import RequestRecord
from loadgen.workloads import Planned, ideal_hits
from router import lifecycle
from router.admission import Admission, Rejected
from router.autoscale import DEFAULT_COLD_START_S, Autoscaler, EngineLoad, Observation, Slo
from router.core import RouterCore
from router.pd import (
    DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
    DEFAULT_OVERLOAD_FACTOR,
    PdPlanner,
    TransferModel,
)
from router.placement import Placement, PlacementRequest, Scorer, create_scorer
from router.pools import Pool
from router.recorder import PlacementRecorder

# the engines' options (``SimEngineOptions``) an ``--engine key=value`` may set: all but the
# block size (``--block-size``) and the token ids of generated text (virtual engines make none)
ENGINE_OPTIONS: tuple[str, ...] = tuple(
    f.name
    for f in fields(SimEngineOptions)
    if f.name not in ("block_size", "vocab_size", "token_offset")
)

# the request ids of warming prefills (``SimSettings.warm_prefixes``)
WARM_PREFIX = "warm-"


def hot_prefixes(recent: Sequence[Planned], k: int) -> list[tuple[Any, tuple[int, ...]]]:
    """The ``k`` prefixes (trace block ids) of ``recent`` whose caching saves the most prefill:
    per first block, the prefix length maximising length x the requests sharing it (at least
    two), ranked by that; each with one request that carries it (its category and info)."""
    groups: dict[int, list[tuple[int, ...]]] = {}
    carrier: dict[int, Any] = {}
    for p in recent:
        h = p.req.hash_ids
        if h:
            groups.setdefault(h[0], []).append(h)
            carrier.setdefault(h[0], p.req)
    ranked = []
    for first, hs in groups.items():
        if len(hs) < 2:
            continue
        best, best_len, prefix = 0, 0, hs[0][:1]
        length = 1
        while True:
            counts: dict[tuple[int, ...], int] = {}
            for h in hs:
                if len(h) >= length:
                    key = h[:length]
                    counts[key] = counts.get(key, 0) + 1
            if not counts:
                break
            key, c = max(counts.items(), key=lambda kv: kv[1])
            if c < 2:
                break
            if c * length > best:
                best, best_len, prefix = c * length, length, key
            length = length * 2 if length < 8 else length + max(1, length // 4)
        if best_len:
            ranked.append((best, first, prefix))
    ranked.sort(key=lambda x: (-x[0], x[1]))
    return [(carrier[first], prefix) for _, first, prefix in ranked[:k]]


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

    def joiner_slowdown(self, i: int) -> float:
        """The speed factor of engine ``i`` when it joins during a run (autoscaling): drawn
        from its index's own seeded stream, so the starting engines' factors are those of a
        fixed-size run, and a joiner's do not depend on how many joined before it."""
        rng = random.Random(f"speed/{self.seed}/{i}")
        s = self.speed_sigma
        out = math.exp(rng.gauss(-s * s / 2, s)) if s else 1.0
        if rng.random() < self.stragglers:
            out *= self.straggler_slowdown
        return out

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
    engine: dict[str, Any] = field(default_factory=dict)  # ENGINE_OPTIONS, by name
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
    # membership (``ClusterSimulator.run`` with an autoscaler): seconds from the scale decision
    # to a new engine's first step (see ``DEFAULT_COLD_START_S``)
    cold_start_s: float = DEFAULT_COLD_START_S
    # the engines' KV events keep every event_stride-th block (EngineConfig.event_stride)
    event_stride: int = 1
    # the router counts the prompts it sent that no KV event shows yet (RouterCore's option)
    inflight_prompts: bool = False
    # the autoscaler's simulator (``Observation.what_if``: a ``WhatIfSimulator`` every
    # decision), sampling the requests of the last ``what_if_history_s`` seconds
    what_if: bool = True
    what_if_history_s: float = 120.0
    # warming (KV-aware scale-up): a joining engine, at the end of its cold start and before
    # it is routable, prefills the ``warm_prefixes`` hottest prefixes of the requests placed
    # in the last ``what_if_history_s`` (``hot_prefixes``); 0: it joins cold
    warm_prefixes: int = 0

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
        if self.event_stride < 1:
            raise ValueError(f"--event-stride must be >= 1, got {self.event_stride}")
        if self.warm_prefixes < 0:
            raise ValueError(f"--warm-prefixes must be >= 0, got {self.warm_prefixes}")
        if not 0 <= self.cold_start_s < 86_400:
            raise ValueError(f"--cold-start-s must be in [0, 86400), got {self.cold_start_s}")
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
    # GPU-seconds of every engine from its scale decision (the first arrival for the starting
    # engines) to its release (drained after leaving; else the last finish)
    gpu_seconds: float = 0.0
    # the pool's target replica count over time: (t, n, reason) at the start and each change
    replicas: list[tuple[float, int, str]] = field(default_factory=list)
    # KV event messages and blocks (stored and removed) the engines put on the bus
    kv_messages: int = 0
    kv_blocks: int = 0
    # each engine's billing, (from, to): ``gpu_seconds`` is their sum (see ``gpu_seconds_in``)
    billed: list[tuple[float, float]] = field(default_factory=list)
    # autoscaling: each decision's cost in seconds of this process's CPU (what-ifs included)
    decision_cpu_s: list[float] = field(default_factory=list)
    # per engine that joined during the run: (routable from, its id, warmed first)
    joins: list[tuple[float, str, bool]] = field(default_factory=list)

    def gpu_seconds_in(self, t0: float, t1: float = math.inf) -> float:
        """GPU-seconds billed within ``[t0, t1]``."""
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in self.billed)

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
        options = SimEngineOptions(block_size=bs, **s.engine)
        # the engines' limits bind the router's cost model too (as ``deploy.app`` does)
        truth, _ = engine_profile(truth, s)
        belief = router_profile if router_profile is not None else LatencyProfile.load(truth.name)
        belief, _ = engine_profile(belief, s)
        p = s.perturbation
        self.slowdowns = p.slowdowns(s.instances)
        self.kv_bus, self.load_bus = InProcessBus(1 << 16), InProcessBus(1 << 16)
        n_prefill = s.prefill_instances
        self.core = self._router_core(scorer, belief, s.gpu_blocks(truth, bs), options, recorder)
        # what the engines' KV events put on the bus (after the stride): the event volume
        self.kv_messages = self.kv_blocks = 0
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
        self._scaler: Autoscaler | None = None
        self._replicas: list[tuple[float, int, str]] = []
        self._target = settings.instances
        # the replay's state, shared by its steps (set by ``_replay``)
        self._preqs: dict[str, tuple[PlacementRequest, Planned]] = {}
        self._queue: list[tuple[float, str, int, int]] = []
        self._last_tick = -1
        self._sampled: list[tuple[tuple[int, int], Any]] = []
        self._wake: list[float] = []
        self._due_heap: list[tuple[float, int]] = []
        self._next_tick = math.inf
        self._arrivals: deque[tuple[float, int, int, int]] = deque()
        self._ttfts: deque[tuple[float, float]] = deque()
        self._tpots: deque[tuple[float, float]] = deque()
        self._recent: deque[Planned] = deque()  # the what-if's sample of recent requests
        self._decision_cpu: list[float] = []
        self._joins: list[tuple[float, str, bool]] = []
        self._warmed: set[int] = set()
        self._belief = belief
        self.translators: dict[str, EngineEventTranslator] = {}
        self.instances: list[VirtualInstance] = []
        self.by_id: dict[str, VirtualInstance] = {}
        self._index: dict[str, int] = {}
        self._truth, self._options = truth, options
        # membership: whether each engine publishes load samples (routable: ready and not
        # leaving), and its billing (from, to: NaN while held)
        self._publishing: list[bool] = []
        self._billed: list[list[float]] = []
        self._starting: dict[int, float] = {}  # engine -> its ready time (cold start)
        self._leaving: dict[int, float] = {}  # engine -> when it was told to leave
        for i in range(s.instances):
            self._new_engine(self.slowdowns[i])
        if n_prefill:
            ids = list(self.by_id)
            self.core.sync_instances(ids[:n_prefill], "prefill")
            self.core.sync_instances(ids[n_prefill:], "decode")
        else:
            self.core.sync_instances(self.by_id)

    def _router_core(
        self,
        scorer: Scorer | str,
        belief: LatencyProfile,
        gpu_blocks: int,
        options: SimEngineOptions,
        recorder: PlacementRecorder | None,
    ) -> RouterCore:
        """The production router core on the simulation's buses, pricing with ``belief``:
        prefill and decode pools, and their planner, where the settings split the cluster."""
        s, bs = self.settings, self.block_size
        pools, planner = None, None
        if s.prefill_instances:
            pools = [
                Pool("prefill", "prefill", bs, belief, gpu_blocks),
                Pool("decode", "decode", bs, belief, gpu_blocks),
            ]
            transfer = TransferModel(
                belief.kv_bytes_per_token,
                float(options.transfer_gbps),
                float(options.transfer_latency_ms) / 1e3,
            )
            planner = PdPlanner(transfer, s.pd_max_local_prefill_tokens, s.pd_overload_factor)
        core = RouterCore(
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
            event_stride=s.event_stride,
            inflight_prompts=s.inflight_prompts,
        )
        if core.watcher is not None:  # it reads the buses only when a request arrives
            core.watcher.lag_warn_s = math.inf
        return core

    def _new_engine(self, slowdown: float) -> int:
        """A new engine at the next index, ``sim-<index>``, with an empty cache: its index."""
        i, p = len(self.instances), self.settings.perturbation
        iid = f"sim-{i}"
        self.translators[iid] = EngineEventTranslator(
            iid, "sim", self.block_size, trusted_hashes=True, stride=self.settings.event_stride
        )
        self._events[iid] = deque()
        inst = VirtualInstance(
            iid,
            self._truth,
            options=self._options,
            on_events=self._on_events,
            on_progress=self._progress_fn(iid),
            slowdown=slowdown,
            jitter=p.jitter,
            seed=p.seed * 100_003 + i,
        )
        self.instances.append(inst)
        self.by_id[iid] = inst
        self._index[iid] = i
        self._publishing.append(True)
        self._billed.append([0.0, math.nan])
        return i

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
            self.kv_messages += 1
            self.kv_blocks += sum(len(u.hashes) for u in msg.updates if not isinstance(u, Cleared))

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
        autoscaler: Autoscaler | None = None,
    ) -> SimRun:
        """Replay ``plan`` (send offsets in seconds, in order) to completion, or until
        ``budget`` is exhausted (then ``SimRun.aborted``: requests in flight stay unfinished
        and later ones have no record).

        ``autoscaler`` (colocated clusters only): every ``interval_s`` of virtual time from the
        first arrival it is handed what the router saw (``_observe``) and its target is
        applied. A new engine (``sim-<next index>``, empty cache, its speed factor seeded by
        its index) is billed from the decision and joins the router ``cold_start_s`` later, as
        Serve's replica set would add it (``RouterCore.add_instance``); its KV events and load
        samples then flow like the others'. Scale-down cancels engines still starting (newest
        first), then removes the serving engines whose cache is worth least (fewest GPU blocks
        in the router's map, then fewest requests in flight): removed from routing at once,
        they stop sampling, finish what they run, and on the last finish publish
        ``InstanceGone`` on the KV bus (the forwarder's clean scale-down), which takes their
        blocks out of the map; their billing ends there. After the last arrival the decisions
        go on until every request has finished."""
        wall0 = time.perf_counter()  # the collector's set-up counts too
        self._budget = budget
        if autoscaler is not None and self.settings.prefill_instances:
            raise ValueError("--autoscale: prefill/decode pools are not autoscaled yet")
        self._scaler = autoscaler
        with _replay_collector():
            return self._replay(plan, progress, wall0)

    # -- the replay's steps (one arrival's, and one autoscaling tick's) --------------------------

    def _sample_loads(self, t: float) -> None:
        """Load samples: the latest taken strictly before t - lag is what the router can have
        read. NOTE: not "at": with no lag a sample stamped t would be taken before the
        requests placed at t, and LoadTracker counts only assignments newer than a sample, so
        every request arriving at t (traces share millisecond stamps) went unseen and
        --lag-ms 0 piled them on one engine. Only routable engines sample."""
        s = self.settings
        tick = math.ceil((t - s.load_lag_s) / s.load_interval_s) - 1
        if tick > self._last_tick and tick >= 0:
            self._last_tick = tick
            ts = tick * s.load_interval_s
            sampled, wake, due_heap, publishing = (
                self._sampled,
                self._wake,
                self._due_heap,
                self._publishing,
            )
            for i, inst in enumerate(self.instances):
                if not publishing[i]:
                    continue
                self._run(i, ts)
                state = (inst.steps, inst.submitted)
                if state == sampled[i][0]:  # nothing changed: the same sample, restamped
                    snap = msgspec.structs.replace(sampled[i][1], ts=ts)
                else:
                    snap = inst.load(ts)
                sampled[i] = (state, snap)
                self.load_bus.publish(encode_load(snap))
                self._queue.append((ts, inst.instance_id, snap.waiting, snap.running))
                w = inst.wake_s()
                if w != wake[i]:
                    wake[i] = w
                    heapq.heappush(due_heap, (w, i))

    def _run_due(self, t: float) -> None:
        """Run up to ``t`` the instances with a step to run before it (see ``_replay``)."""
        wake, due_heap, instances = self._wake, self._due_heap, self.instances
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

    def _publish_events(self, t: float) -> None:
        """KV events older than the lag, through the bus into the map."""
        horizon = t - self.settings.event_lag_s
        for dq in self._events.values():
            while dq and dq[0][0] <= horizon:
                self.kv_bus.publish(dq.popleft()[1])
        self._pump(t)

    def _replay(self, plan: Sequence[Planned], progress: ProgressFn | None, wall0: float) -> SimRun:
        self._preqs, self._queue = {}, []
        records: dict[str, RequestRecord] = {}
        roots: dict[int, int] = {}  # chat id -> its session's first chat id
        self._last_tick = -1
        self._sampled = [((-1, -1), None)] * len(self.instances)
        total = len(plan)
        budget, aborted = self._budget, False
        instances = self.instances
        # NOTE: only the instances with a step to run before t are run up to it, found on a
        # heap of their wake times (entries whose time is no longer the instance's are stale);
        # they run in index order, as a loop over all of them would (progress at equal times is
        # delivered in the order it was produced).
        self._wake = wake = [inst.wake_s() for inst in instances]
        self._due_heap = due_heap = [(w, i) for i, w in enumerate(wake)]
        heapq.heapify(due_heap)
        scaler = self._scaler
        start = plan[0].offset_s if plan else 0.0
        for b in self._billed:
            b[0] = start
        if scaler is not None:
            self._scale_start(start)
        for n, p in enumerate(plan):
            t = p.offset_s
            if scaler is not None:
                self._control(t)
            # 1. load samples
            self._sample_loads(t)
            self._run_due(t)
            # 2. what the ingress saw of the streams up to t
            self._deliver_progress(t, self._preqs)
            if budget is not None and budget.exhausted:
                aborted = True
                break
            # 3. KV events older than the lag, through the bus into the map
            self._publish_events(t)
            # 4. place, admit, send
            self._arrive(p, records, roots)
            if progress is not None and n % 1000 == 999:
                progress(n + 1, total)
        if scaler is not None and not aborted:  # decisions go on while requests run
            while any(len(inst.finished) < inst.submitted for inst in instances):
                self._control(self._next_tick + 1e-9)
            self._control(self._next_tick + 1e-9)  # release what drained since the last
            self._publish_events(self._next_tick - scaler.interval_s)  # their InstanceGone
        if not aborted:
            for i in range(len(self.instances)):  # prefill instances first: their hand-overs
                self._run(i, math.inf)
            self._deliver_progress(math.inf, self._preqs)
        wall = time.perf_counter() - wall0
        if progress is not None:
            progress(total, total)
        return self._result(records, wall, aborted)

    def _arrive(self, p: Planned, records: dict[str, RequestRecord], roots: dict[int, int]) -> None:
        """Request ``p`` arrives now (its offset): recorded, placed by the router core (both
        legs of a split), admitted or refused, and sent to its engine."""
        core, bs, t, tr = self.core, self.block_size, p.offset_s, p.req
        mml = self.instances[0].max_model_len
        rid = str(p.index)
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
            return
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
            return
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
        inst = self.by_id[leg_place.instance_id]
        try:
            inst.submit(leg, t)
        except ValueError as e:
            rec.error, rec.status, rec.error_detail, rec.done_s = "http_400", 400, str(e), t
            self._refused()
            return
        i = self._index[leg_place.instance_id]
        w = inst.wake_s()
        if w != self._wake[i]:
            self._wake[i] = w
            heapq.heappush(self._due_heap, (w, i))
        rec.instance = placement.instance_id
        if self._scaler is not None:
            self._arrivals.append(
                (t, tr.input_length, tr.output_length, core.cached_tokens(preq, placement))
            )
            self._recent.append(p)
        preqs = self._preqs
        preqs[rid] = (preq, p)
        if leg is req:
            core.assigned(preq, placement, t)
        else:
            leg_preq = replace(preq, request_id=leg.request_id)
            core.assigned(leg_preq, leg_place, t)
            preqs[leg.request_id] = (leg_preq, p)
            self._split[rid] = (placement, preq)
            self._output[rid] = max(tr.output_length, 1)

    def _result(self, records: dict[str, RequestRecord], wall: float, aborted: bool) -> SimRun:
        """The replay's outcome: each request's record completed from its engine's finish, the
        GPU-seconds billed, the router's calibration."""
        core = self.core
        for inst in self.instances:
            for r in inst.finished:
                if r.remote_decode or r.request_id.startswith(WARM_PREFIX):
                    continue  # a prefill leg (its record is its decode's), or warming
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
        end = max(done) if done else first
        gpu_s = 0.0
        for i, (b0, b1) in enumerate(self._billed):
            if math.isnan(b1):  # held to the end (a cancelled start was billed when cancelled)
                b1 = max(end, b0)
            gpu_s += max(0.0, b1 - b0)
            self._billed[i][1] = b1
        return SimRun(
            router=core.scorer.name,
            records=out,
            queue=self._queue,
            span_s=(max(done) - first) if done else 0.0,
            wall_s=wall,
            calibration=(
                {"a": cal.a, "b": cal.b, "c": cal.c, "d": cal.d, "samples": cal.samples}
                if cal is not None
                else None
            ),
            slowdowns=self.slowdowns,
            aborted=aborted,
            kv_messages=self.kv_messages,
            kv_blocks=self.kv_blocks,
            gpu_seconds=gpu_s,
            replicas=list(self._replicas),
            billed=[(a, b) for a, b in self._billed],
            decision_cpu_s=list(self._decision_cpu),
            joins=list(self._joins),
        )

    # -- membership and the autoscaler -------------------------------------------------------

    def _scale_start(self, start: float) -> None:
        scaler = self._scaler
        assert scaler is not None
        self._next_tick = start + scaler.interval_s
        n = len(self.instances)
        self._target = n
        self._replicas.append((start, n, "initial"))

    def _control(self, t: float) -> None:
        """Every membership event and autoscaling tick strictly before ``t``, in time order
        (an engine's readiness before a tick at the same time)."""
        scaler = self._scaler
        assert scaler is not None
        while True:
            ready = min(self._starting.items(), key=lambda kv: (kv[1], kv[0]), default=None)
            if ready is not None and ready[1] <= self._next_tick and ready[1] < t:
                i, at = ready
                del self._starting[i]
                self._join(i, at)
                continue
            if self._next_tick >= t:
                return
            now = self._next_tick
            self._next_tick = now + scaler.interval_s
            self._tick(now)

    def _join(self, i: int, at: float) -> None:
        """Engine ``i`` finished its cold start at ``at``: routable from now on, or, with
        warming, once it has prefilled the hot prefixes (then it joins again at that time)."""
        k = self.settings.warm_prefixes
        if k and i not in self._warmed:
            self._warmed.add(i)
            done = self._warm(i, at, k)
            if done > at:
                self._starting[i] = done
                return
        self._publishing[i] = True  # it samples from the next load tick on
        self.core.add_instance(self.instances[i].instance_id)
        self._joins.append((at, self.instances[i].instance_id, i in self._warmed))

    def _warm(self, i: int, at: float, k: int) -> float:
        """Prefill on engine ``i`` (not routable: it runs nothing else) the ``k`` hottest
        prefixes of the recent requests, each a one-token request ``warm-<i>-<j>`` submitted at
        ``at``, as the KV control API's warm path would; its KV events reach the map like any
        others'. Returns when the last finished (``at`` when there was nothing to warm)."""
        self._recent_since(at)
        inst = self.instances[i]
        n = 0
        for j, (tr, blocks) in enumerate(hot_prefixes(self._recent, k)):
            length = min(len(blocks) * self.trace_block_size, inst.max_model_len - 1)
            if length < self.block_size:
                continue
            try:
                _, req = trace_arrival(
                    f"{WARM_PREFIX}{i}-{j}",
                    at,
                    length,
                    1,
                    blocks,
                    self.trace_block_size,
                    self.block_size,
                    inst.max_model_len,
                    request_info(tr, -1),
                )
                inst.submit(req, at)
            except ValueError:
                continue
            n += 1
        if not n:
            return at
        inst.drain()
        return max(at, inst.clock)

    def _recent_since(self, now: float) -> None:
        recent = self._recent
        while recent and recent[0].offset_s < now - self.settings.what_if_history_s:
            recent.popleft()

    def _tick(self, now: float) -> None:
        """One autoscaling decision at ``now``: bring the cluster up to ``now`` as the
        arrival steps do, release drained engines, observe, decide, apply."""
        scaler = self._scaler
        assert scaler is not None
        self._sample_loads(now)
        self._run_due(now)
        self._deliver_progress(now, self._preqs)
        for i in sorted(self._leaving):
            inst = self.instances[i]
            self._run(i, now)
            if len(inst.finished) < inst.submitted:
                continue
            released = max([self._leaving[i], *(r.finish_s for r in inst.finished[-1:])])
            del self._leaving[i]
            self._billed[i][1] = released
            iid = inst.instance_id
            self._events[iid].append((released, encode_message(InstanceGone(iid))))
        self._publish_events(now)
        cpu0 = time.process_time()
        decision = scaler.decide(self._observe(now, scaler.interval_s))
        self._decision_cpu.append(time.process_time() - cpu0)
        if decision.target != self._target:
            self._scale_to(decision.target, now)
            self._replicas.append((now, decision.target, decision.reason))

    def _observe(self, now: float, window_s: float) -> Observation:
        """What the router saw over the last ``window_s``: arrivals and their token mix,
        TTFTs and TPOTs it measured, the load views of the routable engines."""
        since = now - window_s
        for dq in (self._arrivals, self._ttfts, self._tpots):
            while dq and dq[0][0] < since:
                dq.popleft()
        arr = self._arrivals
        views = self.core.load.views(now)
        self._recent_since(now)
        recent = self._recent
        what_if = None
        if self.settings.what_if and recent:
            what_if = WhatIfSimulator(
                self._belief,
                self.core.scorer.name,
                self.trace_block_size,
                list(recent),
                waiting=sum(v.waiting for v in views),
                ready=len(views),
                settings=self.settings,
            )
        return Observation(
            now=now,
            replicas=self._target,
            ready=sum(self._publishing),
            window_s=window_s,
            arrivals=len(arr),
            prompt_tokens=sum(a[1] for a in arr),
            output_tokens=sum(a[2] for a in arr),
            cached_tokens=sum(a[3] for a in arr),
            engines=tuple(
                EngineLoad(
                    v.instance_id, v.waiting, v.running, v.gpu_kv_usage, v.pending_prefill_tokens
                )
                for v in views
            ),
            ttfts=tuple(x for _, x in self._ttfts),
            tpots=tuple(x for _, x in self._tpots),
            what_if=what_if,
        )

    def _scale_to(self, target: int, now: float) -> None:
        """Start or stop engines until ``target`` count against the pool (see ``run``)."""
        n = self._target
        while n < target:
            i = len(self.instances)
            self._new_engine(self.settings.perturbation.joiner_slowdown(i))
            self._publishing[i] = False
            self._billed[i][0] = now
            self._starting[i] = now + self.settings.cold_start_s
            self._wake.append(math.inf)
            self._sampled.append(((-1, -1), None))
            n += 1
        while n > target and self._starting:  # cancel the newest starts: nothing to drain
            i = max(self._starting)
            del self._starting[i]
            self._billed[i][1] = now
            n -= 1
        if n > target:
            cmap = self.core.cache_map
            views = {v.instance_id: v for v in self.core.load.views(now)}
            serving = [i for i, pub in enumerate(self._publishing) if pub]

            def worth(i: int) -> tuple[int, int, int]:
                iid = self.instances[i].instance_id
                v = views.get(iid)
                busy = v.waiting + v.running if v is not None else 0
                return (cmap.count(iid, Tier.GPU), busy, -i)

            for i in sorted(serving, key=worth)[: n - target]:
                self._publishing[i] = False
                self._leaving[i] = now
                self.core.remove_instance(self.instances[i].instance_id)
            n = target
        self._target = n

    def _refused(self) -> None:
        if self._budget is not None:
            self._budget.refused += 1

    def _deliver_progress(
        self, t: float, preqs: dict[str, tuple[PlacementRequest, Planned]]
    ) -> None:
        heap, core, budget = self._progress, self.core, self._budget
        while heap and heap[0][0] <= t:
            at, _, iid, req, finished = heapq.heappop(heap)
            if req.request_id.startswith(WARM_PREFIX):  # warming: no client sees it
                continue
            if finished:
                entry = preqs.pop(req.request_id, None)
                if entry is not None:
                    core.finished(entry[0], iid)
                if self._scaler is not None and req.num_output >= 2:
                    gaps = req.num_output - 1
                    self._tpots.append((at, (req.finish_s - req.first_token_s) / gaps))
                if budget is not None:
                    budget.finished(req)
            else:
                core.first_token(req.request_id, at)
                if self._scaler is not None:
                    entry = preqs.get(req.request_id)
                    self._ttfts.append((at, at - (entry[1].offset_s if entry else req.arrival_s)))
                if budget is not None and not req.remote_decode:
                    # NOTE: a decode leg arrived at its hand-over; the client at the plan's time
                    entry = preqs.get(req.request_id)
                    budget.first_token(at - (entry[1].offset_s if entry else req.arrival_s))

    def _pump(self, now: float) -> None:
        core = self.core
        while True:  # a burst larger than one bus read is applied whole, as a busy pump would
            fetched = core.fetch()
            core.apply(fetched, now)
            if (
                fetched is None
                or max(len(fetched[0].items), len(fetched[1].items)) < MAX_READ_ITEMS
            ):
                return


class WhatIfSimulator:
    """The model-predictive policy's simulator of the pool (``router.autoscale.WhatIf``): what
    a pool of ``replicas`` engines would attain if requests arrived at ``rate`` per second for
    ``horizon_s``, replayed on the production router core (scorer ``scorer``, default
    options) and sim engines of the router's profile, unperturbed (the router does not know
    the engines' speeds).

    The traffic: the most recent of ``recent`` (the requests of the last few minutes, their
    tokens and prefixes) re-timed to arrive evenly at the rate, after a backlog of the
    ``waiting`` requests queued now (the latest requests again, all at the start). At most
    ``max_engines`` are simulated: a larger pool is simulated as a slice of that many engines
    given that share of the rate and of the backlog (the router spreads load evenly), so a
    decision at 64 instances costs what one at ``max_engines`` does; the slice is thinner
    still where the forecast would bring more than ``max_requests`` arrivals (short prompts,
    many requests a second per engine). A request used again
    (a short history) gets fresh block ids for each lap. The engines start with empty caches,
    so the requests of the first ``warm_fraction`` of the horizon only warm them (the
    backlog's are always counted). The attainment returned is over the requests some pool
    could serve in time (their ``ideal_ttfts`` within the TTFT SLO): the policy's goal is set
    over those (``PredictivePolicy.sim_goal``). Built fresh by the cluster simulator at each
    decision; in production the same object can be built from the ingress's recent
    requests."""

    def __init__(
        self,
        profile: LatencyProfile,
        scorer: str,
        trace_block_size: int,
        recent: Sequence[Planned],
        *,
        waiting: int = 0,
        ready: int = 1,
        settings: SimSettings | None = None,
        max_engines: int = 8,
        warm_fraction: float = 0.25,
        max_requests: int = 400,
    ) -> None:
        self.profile, self.scorer = profile, scorer
        self.trace_block_size, self.recent = trace_block_size, list(recent)
        self.waiting, self.ready = waiting, max(1, ready)
        base = settings or SimSettings()
        self.settings = SimSettings(
            instances=1,
            block_size=base.block_size,
            engine=dict(base.engine),
            perturbation=EXACT,
            event_lag_s=base.event_lag_s,
            load_lag_s=base.load_lag_s,
            load_interval_s=base.load_interval_s,
            what_if=False,
        )
        self.max_engines, self.warm_fraction = max(1, max_engines), warm_fraction
        self.max_requests = max(1, max_requests)
        self.calls = 0

    def plan(self, replicas: int, rate: float, horizon_s: float) -> tuple[int, list[Planned]]:
        """The slice simulated for ``replicas`` engines: its size, and its requests (the
        backlog's first, at 0)."""
        m = min(replicas, self.max_engines)
        if rate * horizon_s > 0:  # at most ``max_requests`` arrivals: a thinner slice
            m = max(1, min(m, int(self.max_requests * replicas / (rate * horizon_s))))
        share = m / replicas
        lam = rate * share
        backlog = round(self.waiting * m / self.ready)
        n = max(1, math.ceil(lam * horizon_s)) if lam > 0 else 0
        pool = self.recent
        if not pool:
            return m, []
        take = backlog + n
        out = []
        for k in range(take):
            lap, j = divmod(take - 1 - k, len(pool))
            req = pool[-1 - j].req
            if lap:  # a request used again: fresh blocks, so it hits only its own lap's
                req = replace(req, hash_ids=tuple(b + (lap << 48) for b in req.hash_ids))
            out.append(Planned(k, 0.0 if k < backlog else (k - backlog) / lam, req))
        return m, out

    def __call__(self, replicas: int, rate: float, horizon_s: float, slo: Slo) -> float:
        self.calls += 1
        m, plan = self.plan(replicas, rate, horizon_s)
        if not plan:
            return 1.0
        settings = replace(self.settings, instances=m)
        sim = ClusterSimulator(
            self.profile, self.scorer, settings, self.trace_block_size, router_profile=self.profile
        )
        try:
            run = sim.run(plan)
        finally:
            sim.close()
        # requests no pool can serve within the TTFT SLO (alone on an idle engine with every
        # earlier block cached: ``ideal_ttfts``) are left out: the policy's goal is over the
        # attainable ones, and the few in a small sample would swing it
        ideal = ideal_ttfts(plan, self.trace_block_size, self.profile, settings)
        warm = self.warm_fraction * horizon_s
        met = [
            r.meets(slo.ttft_s, slo.tpot_s)
            for r in run.records
            if not 0 < r.intended_s < warm and ideal[r.index] <= slo.ttft_s
        ]
        return sum(met) / len(met) if met else 1.0


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
    autoscaler: Autoscaler | None = None,
) -> SimRun:
    """One router over one schedule on a fresh cluster (see ``ClusterSimulator``;
    ``autoscaler``: see ``ClusterSimulator.run``)."""
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
        return sim.run(plan, progress, budget, autoscaler)
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
