"""The cluster simulator: a schedule replayed in virtual time on sim engines, placed by the
production routing core.

Nothing of the router is written twice. Every request is placed by a ``router.core.RouterCore``
(the object the ingress runs) with a registered scorer, on the clock of the simulation:

- the engines are ``engines.sim.VirtualInstance``s. Their KV events (the objects vLLM's
  publisher encodes) go through the forwarder's ``EngineEventTranslator`` (trusted-hash mode:
  the trace's block ids are the chained hashes), onto an in-process event bus, and reach the core's
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
(``max_in_flight``), engine failures (but ``SimSettings.lose_engine_at_s``), cancellation.

Wiring (buses, lags, hand-overs, the KV pool's announcements): ``simulation.wiring``; settings
and records: ``simulation.settings``; the autoscaler's what-if: ``simulation.whatif``.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from cachemap.events import InstanceGone, encode_message
from cachemap.hashing import Tier
from engines.profile import LatencyProfile
from engines.sim.virtual import trace_arrival
from loadgen.records import RequestRecord
from loadgen.workloads import Planned
from router import lifecycle
from router.admission import Rejected
from router.autoscale import Autoscaler, EngineLoad, Observation
from router.placement import NoInstanceError, create_scorer, placement_request
from router.recorder import PlacementRecorder
from simulation.cachesim import request_info
from simulation.settings import WARM_PREFIX, ProgressFn, SimRun, SimSettings, SloBudget
from simulation.warming import hot_prefixes, longest_prompts, warm_request
from simulation.whatif import WhatIfSimulator
from simulation.wiring import WiredCluster


class ClusterSimulator(WiredCluster):
    """``instances`` virtual engines behind one routing core (``WiredCluster``). ``run`` replays a
    schedule."""

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
        blocks out of the map; their billing ends there. With ``handover_prefixes`` their
        longest recent prompts are first prefilled on the survivors (``_hand_over_cache``).
        After the last arrival the decisions go on until every request has finished."""
        wall0 = time.perf_counter()  # the collector's set-up counts too
        self._budget = budget
        if autoscaler is not None and self.settings.prefill_instances:
            raise ValueError("--autoscale: prefill/decode pools are not autoscaled yet")
        self._scaler = autoscaler
        with _replay_collector():
            return self._replay(plan, progress, wall0)

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
        start = self._start_s = plan[0].offset_s if plan else 0.0
        for b in self._billed:
            b[0] = start
        if scaler is not None:
            self._scale_start(start)
        for n, p in enumerate(plan):
            t = p.offset_s
            if scaler is not None:
                self._control(t)
            self._lose_due(t)  # 0. an engine lost by now (SimSettings.lose_engine_at_s)
            self._sample_loads(t)  # 1. load samples
            self._run_due(t)
            # 2. what the ingress saw of the streams up to t
            self._deliver_progress(t, self._preqs)
            if budget is not None and budget.exhausted:
                aborted = True
                break
            self._publish_events(t)  # 3. KV events older than the lag, into the map
            self._arrive(p, records, roots)  # 4. place, admit, send
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
        core, bs, t, tr = self._replica(p.index), self.block_size, p.offset_s, p.req
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
            self._refused(rid)
            return
        preq = placement_request(
            rid, tr.input_length, req.block_hashes, bs, tr.output_length, session, tr.category
        )
        try:
            placement = lifecycle.admit(core, preq, t)
        except Rejected as e:
            rec.error, rec.status, rec.error_detail, rec.done_s = "http_429", 429, e.reason, t
            self._refused(rid)
            return
        leg, leg_place = req, placement
        req.pool_load = placement.detail.get("pool_load") is not False  # the router's hint
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
            self._refused(rid)
            return
        i = self._index[leg_place.instance_id]
        w = inst.wake_s()
        if w != self._wake[i]:
            self._wake[i] = w
            heapq.heappush(self._due_heap, (w, i))
        rec.instance = placement.instance_id
        if self._scaler is not None:
            cached = core.cached_tokens(preq, placement)
            self._arrivals.append((t, tr.input_length, tr.output_length, cached))
            self._recent.append(p)
            if self.settings.what_if_cached:
                self._placed_cached[p.index] = cached
            if self.settings.handover_prefixes:
                served = self._served.setdefault(i, deque())
                served.append(p)
                _drop_before(served, t - self.settings.handover_history_s)
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
                if r.scheduled_s >= 0:
                    rec.scheduled_s = r.scheduled_s
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
        self._add_instance(self.instances[i].instance_id)
        self._joins.append((at, self.instances[i].instance_id, i in self._warmed))

    def _warm(self, i: int, at: float, k: int) -> float:
        """Prefill on engine ``i`` (not routable: it runs nothing else) the ``k`` hottest
        prefixes of the recent requests, each a one-token request ``warm-<i>-<j>`` submitted at
        ``at``, as the KV control API's warm path would; its KV events reach the map like any
        others'. Returns when the last finished (``at`` when there was nothing to warm)."""
        self._recent_since(at)
        inst = self.instances[i]
        n = 0
        sizes = self.trace_block_size, self.block_size, inst.max_model_len
        for j, (tr, blocks) in enumerate(hot_prefixes(self._recent, k)):
            req = warm_request(f"{WARM_PREFIX}{i}-{j}", at, tr, blocks, *sizes)
            if req is None:
                continue
            try:
                inst.submit(req, at)
            except ValueError:
                continue
            n += 1
        if not n:
            return at
        inst.drain()
        return max(at, inst.clock)

    def _hand_over_cache(self, i: int, now: float) -> None:
        """Engine ``i`` left at ``now``: the longest prompts it served lately
        (``handover_prefixes``) that no survivor holds half of are prefilled, one token each
        (``warm-h<i>-<j>``), where the router places them among the survivors, so that a
        session's next turn finds its prefix there (the KV control API's warm path)."""
        s, bs = self.settings, self.block_size
        served = self._served.pop(i, deque())
        _drop_before(served, now - s.handover_history_s)
        sizes = self.trace_block_size, bs, self.instances[i].max_model_len
        for j, (tr, blocks) in enumerate(longest_prompts(served, s.handover_prefixes)):
            req = warm_request(f"{WARM_PREFIX}h{i}-{j}", now, tr, blocks, *sizes)
            if req is None:
                continue
            n = req.prompt_len // bs
            preq = placement_request(req.request_id, req.prompt_len, req.block_hashes, bs, 1)
            held = self.core.cache_map.match(preq.block_hashes)
            if 2 * max((m.total_blocks for m in held.values()), default=0) >= n:
                continue  # a survivor holds half of it or more
            try:
                k = self._index[self.core.place(preq, now).instance_id]
                self.instances[k].submit(req, now)
            except NoInstanceError:
                return  # no survivor can take it
            except ValueError:
                continue  # not on that engine (its context or KV)
            w = self.instances[k].wake_s()
            if w != self._wake[k]:
                self._wake[k] = w
                heapq.heappush(self._due_heap, (w, k))

    def _recent_since(self, now: float) -> None:
        _drop_before(self._recent, now - self.settings.what_if_history_s, self._placed_cached)

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
                ClusterSimulator,
                self._belief,
                self.core.scorer.name,
                self.trace_block_size,
                list(recent),
                waiting=sum(v.waiting for v in views),
                ready=len(views),
                settings=self.settings,
                cached=dict(self._placed_cached) if self.settings.what_if_cached else None,
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

            leaving = sorted(serving, key=worth)[: n - target]
            for i in leaving:
                self._retire(i, now)
            for i in leaving:
                self._hand_over_cache(i, now)
            n = target
        self._target = n

    def _refused(self, request_id: str) -> None:
        if self._budget is not None:
            self._budget.refuse(request_id)


# the young generation's collection threshold during a replay (CPython's default: 700)
_REPLAY_GC_THRESHOLD = 20_000
# replays running in this process now: a what-if's replay runs inside the decision's own
_replays_running = 0


@contextlib.contextmanager
def _replay_collector() -> Iterator[None]:
    """The garbage collector's settings for one replay. A replay allocates millions of small
    objects, most short-lived: with the default young-generation threshold (700) the collector
    runs every few placements, and its full passes walk the whole heap each time. So the heap
    the replay starts with is frozen out of collection (unless the process froze its own), and
    the young generation is collected less often; both are restored afterwards, and cycles are
    still collected. A replay inside another (a what-if in an autoscaled replay) keeps the
    outer settings: asking whether the heap is frozen walks all of it. NOTE: nothing is
    collected before the freeze (a full pass, ~0.05 s with only the Mooncake plan in the heap):
    ``simulate`` frees a finished replay's cluster by reference counting
    (``ClusterSimulator.close``); cyclic garbage a caller left waits for the unfreeze."""
    global _replays_running
    outer = _replays_running == 0
    thresholds = gc.get_threshold()
    freeze = outer and gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    if outer:
        gc.set_threshold(_REPLAY_GC_THRESHOLD, *thresholds[1:])
    _replays_running += 1
    try:
        yield
    finally:
        _replays_running -= 1
        if outer:
            gc.set_threshold(*thresholds)
        if freeze:
            gc.unfreeze()


def _drop_before(planned: deque[Planned], t: float, by_index: dict[int, int] | None = None) -> None:
    """Drop from the front of ``planned`` (in arrival order) the requests that arrived before
    ``t``, and their entries in ``by_index`` (keyed by schedule index)."""
    while planned and planned[0].offset_s < t:
        p = planned.popleft()
        if by_index:
            by_index.pop(p.index, None)


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
        scorer_factory=lambda: create_scorer(router, **(scorer_options or {})),
    )
    try:
        return sim.run(plan, progress, budget, autoscaler)
    finally:
        sim.close()
