"""The cluster simulator's wiring (``WiredCluster``, the base of
``simulation.cluster.ClusterSimulator``): virtual engines behind one production router core on
in-process buses, and what reaches the core of them after its lags (KV events through the
forwarder's translator, load samples, the streams' first tokens and finishes, prefill/decode
hand-overs); the steps that bring the cluster up to a time. The replay that drives these steps,
and the engines joining and leaving, are ``simulation.cluster``'s."""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgspec

from cachemap import POOL_INSTANCE, Tier
from cachemap.events import Cleared, InstanceEvents, encode_message
from cachemap.ingest import EngineEventTranslator
from engines.bus.base import MAX_READ_ITEMS, InProcessBus
from engines.bus.forwarder import encode_load
from engines.profile import LatencyProfile
from engines.sim.options import SimEngineOptions
from engines.sim.request import SimRequest
from engines.sim.virtual import VirtualInstance, trace_arrival
from loadgen.workloads import Planned
from router import lifecycle
from router.autoscale import Autoscaler
from router.core import RouterCore, SharedAssignment
from router.pd import TransferModel
from router.placement import Placement, PlacementRequest, Scorer
from router.pools import Pool
from router.recorder import PlacementRecorder
from simulation.settings import WARM_PREFIX, SimSettings, SloBudget, engine_profile


class WiredCluster:
    """``instances`` virtual engines behind one routing core, wired as in production;
    ``simulation.cluster.ClusterSimulator`` replays a schedule on them."""

    def __init__(
        self,
        truth: LatencyProfile,
        scorer: Scorer | str,
        settings: SimSettings,
        trace_block_size: int,
        *,
        router_profile: LatencyProfile | None = None,
        recorder: PlacementRecorder | None = None,
        scorer_factory: Callable[[], Scorer] | None = None,
    ) -> None:
        """``scorer_factory``: a fresh scorer for each router replica past the first
        (``SimSettings.router_replicas``; a ``scorer`` given by name needs none)."""
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
        gpu = s.gpu_blocks(truth, bs)
        # the router's settings, whole, for every replica's core (``router.settings``)
        self.router_settings = s.router_settings(bs, gpu)
        self.core = self._router_core(scorer, belief, gpu, options, recorder)
        # router replicas (``SimSettings.router_replicas``): each its own core (map, ledger,
        # scorer) on the same buses; arrivals go to them in turn (Serve's proxy spreads them
        # over ingress replicas), and a request's progress to the one that placed it
        self.cores = [self.core]
        self._owner: dict[str, RouterCore] = {}  # request -> the replica that placed it
        # what the replicas shared on its way to the others (``share_assignments``): (when,
        # the replica, an assignment or the id of a request that had its first token), each
        # delivered after the event lag
        self._shared: _SharedQueue = deque()
        if s.router_replicas > 1:
            self._more_replicas(scorer, scorer_factory, belief, gpu, options, recorder)
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
        # the tokens each request of ``_recent`` found cached when placed (by schedule index):
        # what-if warming (``SimSettings.what_if_cached``); dropped with ``_recent``
        self._placed_cached: dict[int, int] = {}
        self._decision_cpu: list[float] = []
        self._joins: list[tuple[float, str, bool]] = []
        self._warmed: set[int] = set()
        self._served: dict[int, deque[Planned]] = {}  # hand-over: each engine's recent requests
        self._belief = belief
        self.translators: dict[str, EngineEventTranslator] = {}
        self.instances: list[VirtualInstance] = []
        self.by_id: dict[str, VirtualInstance] = {}
        self._index: dict[str, int] = {}
        self._truth, self._options = truth, options
        # the cluster's KV pool, shared by every engine (joiners too); None: off
        self.pool = s.pool(truth, bs)
        self._pool_seq = -1  # the pool's last announcement on the KV bus
        # membership: whether each engine publishes load samples (routable: ready and not
        # leaving), and its billing (from, to: NaN while held)
        self._publishing: list[bool] = []
        self._billed: list[list[float]] = []
        self._starting: dict[int, float] = {}  # engine -> its ready time (cold start)
        self._leaving: dict[int, float] = {}  # engine -> when it was told to leave
        self.lost: str | None = None  # the engine lost mid-run (``_lose_due``)
        self._start_s = 0.0  # the replay's first arrival
        for i in range(s.instances):
            self._new_engine(self.slowdowns[i])
        self._sync_members(n_prefill)

    def _sync_members(self, n_prefill: int) -> None:
        """Every replica's core learns the starting engines: the first ``n_prefill`` as the
        prefill pool and the rest as the decode pool, or all in the default pool."""
        for core in self.cores:
            if n_prefill:
                ids = list(self.by_id)
                core.sync_instances(ids[:n_prefill], "prefill")
                core.sync_instances(ids[n_prefill:], "decode")
            else:
                core.sync_instances(self.by_id)

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
        router = self.router_settings
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
            planner = router.pd_planner(transfer)
        core = RouterCore(
            replace(router, scorer=scorer) if isinstance(scorer, str) else router,
            belief,
            scorer=None if isinstance(scorer, str) else scorer,
            kv_bus=self.kv_bus,
            load_bus=self.load_bus,
            recorder=recorder,
            pools=pools,
            planner=planner,
            kv_pool=s.pool_link() if s.pool_in_map else None,
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
            pool=self.pool,
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

    def _on_events(self, instance: str, seq: int, events: list[Any]) -> None:
        """An engine's KV event batch, through the forwarder's translator, queued for the bus
        until its lag has passed."""
        ts = self.by_id[instance].clock
        msg = self.translators[instance].translate(events, seq, ts)
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
            self._owner.get(req.request_id, self.core).assigned(preq, decode, at)
        inst.run_until(t)

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

    def _lose_due(self, t: float) -> None:
        """At the first arrival at or after ``SimSettings.lose_engine_at_s`` (from the plan's
        start), the serving engine holding the most GPU blocks is lost: it stops taking
        requests and its caches go with it, GPU and CPU tier (it finishes what it holds, as a
        drained replica would; no hand-over). What the KV pool holds stays."""
        at = self.settings.lose_engine_at_s
        if at is None or self.lost is not None or t < self._start_s + at:
            return
        cmap = self.core.cache_map
        serving = [i for i, pub in enumerate(self._publishing) if pub]
        i = max(serving, key=lambda i: cmap.count(self.instances[i].instance_id, Tier.GPU))
        self.lost = self.instances[i].instance_id
        self._retire(i, t)
        self._target -= 1

    def _retire(self, i: int, now: float) -> None:
        """Engine ``i`` leaves at ``now``: no longer routable nor sampled; it finishes what it
        holds (an autoscaled run bills it until it has drained: ``ClusterSimulator._tick``)."""
        self._publishing[i] = False
        self._leaving[i] = now
        self._remove_instance(self.instances[i].instance_id)

    # -- router replicas -------------------------------------------------------------------

    def _replica(self, index: int) -> RouterCore:
        """The router replica that arrival ``index`` reaches (in turn), remembered as its
        request's owner when there are several."""
        cores = self.cores
        if len(cores) == 1:
            return self.core
        core = self._owner[str(index)] = cores[index % len(cores)]
        return core

    def _more_replicas(
        self,
        scorer: Scorer | str,
        scorer_factory: Callable[[], Scorer] | None,
        belief: LatencyProfile,
        gpu_blocks: int,
        options: SimEngineOptions,
        recorder: PlacementRecorder | None,
    ) -> None:
        """The router replicas past the first, each with a scorer of its own."""
        s = self.settings
        for _ in range(s.router_replicas - 1):
            if isinstance(scorer, str):
                more: Scorer | str = scorer
            elif scorer_factory is not None:
                more = scorer_factory()
            else:
                raise ValueError("router replicas need a scorer by name or a scorer_factory")
            self.cores.append(self._router_core(more, belief, gpu_blocks, options, recorder))
        for i, core in enumerate(self.cores):
            core.scorer.as_replica(i, len(self.cores))
        if s.share_assignments:
            for core in self.cores:
                core.share = _SharedChannel(self._shared, core)

    def _deliver_shared(self, now: float) -> None:
        """What the replicas shared before ``now`` minus the event lag, to every other one."""
        shared, horizon = self._shared, now - self.settings.event_lag_s
        while shared and shared[0][0] <= horizon:
            _, origin, sent = shared.popleft()
            for core in self.cores:
                if core is origin:
                    continue
                if isinstance(sent, str):
                    core.peer_done(sent)
                else:
                    core.peer_assigned(sent)

    def _add_instance(self, iid: str) -> None:
        for core in self.cores:
            core.add_instance(iid)

    def _remove_instance(self, iid: str) -> None:
        for core in self.cores:
            core.remove_instance(iid)

    def _publish_events(self, t: float) -> None:
        """KV events older than the lag, through the bus into the map."""
        horizon = t - self.settings.event_lag_s
        for dq in self._events.values():
            while dq and dq[0][0] <= horizon:
                self.kv_bus.publish(dq.popleft()[1])
        pool = self.pool
        if pool is not None and pool.announce:
            updates = pool.take_updates(horizon)
            if updates:
                self._pool_seq += 1
                msg = InstanceEvents(POOL_INSTANCE, self._pool_seq, horizon, updates)
                self.kv_bus.publish(encode_message(msg))
                self.kv_messages += 1
                self.kv_blocks += sum(len(u.hashes) for u in updates if not isinstance(u, Cleared))
        self._pump(t)

    def _deliver_progress(
        self, t: float, preqs: dict[str, tuple[PlacementRequest, Planned]]
    ) -> None:
        heap, core, budget, owner = self._progress, self.core, self._budget, self._owner
        while heap and heap[0][0] <= t:
            at, _, iid, req, finished = heapq.heappop(heap)
            if req.request_id.startswith(WARM_PREFIX):  # warming: no client sees it
                continue
            if owner:  # router replicas: the one that placed it hears of it
                rid = lifecycle.request_of_prefill_leg(req.request_id)
                core = owner.pop(rid) if finished and rid == req.request_id else owner[rid]
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
                    budget.first_token(
                        req.request_id, at - (entry[1].offset_s if entry else req.arrival_s)
                    )

    def _pump(self, now: float) -> None:
        if self._shared:
            self._deliver_shared(now)
        for core in self.cores:
            while True:  # a burst larger than one bus read is applied whole, as a busy pump would
                fetched = core.fetch()
                core.apply(fetched, now)
                if (
                    fetched is None
                    or max(len(fetched[0].items), len(fetched[1].items)) < MAX_READ_ITEMS
                ):
                    break


_SharedQueue = deque[tuple[float, RouterCore, SharedAssignment | str]]


class _SharedChannel:
    """A replica's ``AssignmentChannel`` in the simulator: what it shares waits in the
    cluster's queue until the event lag has passed (``WiredCluster._deliver_shared``; one
    stamped before an entry still waiting waits for it)."""

    def __init__(self, queue: _SharedQueue, core: RouterCore) -> None:
        self.queue, self.core = queue, core

    def sent(self, assignment: SharedAssignment) -> None:
        self.queue.append((assignment.at, self.core, assignment))

    def done(self, request_id: str, at: float) -> None:
        self.queue.append((at, self.core, request_id))
