"""One request lifecycle (router.lifecycle) under the dispatcher and the cluster simulator: the
same requests, on a prefill/decode pair of sim engines, go out as the same legs (ids, one-token
prefill with do_remote_decode, the prefill engine's parameters handed to the decode engine), and
the SLO gate refuses on the same estimate."""

from __future__ import annotations

import asyncio

import pytest

from cachemap import block_hashes, salt_hash
from engines.base import EngineRequest, RoutedRequest, SamplingParams
from engines.profile import LatencyProfile
from engines.sim.engine import SimEngine
from engines.sim.options import SimEngineOptions
from loadgen.traces import TraceRequest
from loadgen.workloads import Planned
from router import lifecycle
from router.admission import Rejected
from router.core import RouterCore
from router.dispatch import Dispatcher
from router.local_client import LocalEngineClient
from router.pd import PdPlanner, TransferModel
from router.placement import PlacementRequest
from router.pools import Pool
from router.settings import RouterSettings
from router.state import RouterState
from simulation.cluster import ClusterSimulator
from simulation.settings import SimSettings

PROFILE = LatencyProfile.load("cpu-tiny-llama")
BS = 16
PROMPTS = (64 * BS, 80 * BS, 96 * BS)  # long enough to be split


def planner() -> PdPlanner:
    return PdPlanner(TransferModel(PROFILE.kv_bytes_per_token), 16, None)


def pools() -> list[Pool]:
    return [
        Pool("prefill", "prefill", BS, PROFILE, 4096),
        Pool("decode", "decode", BS, PROFILE, 4096),
    ]


Leg = tuple[str, int, bool, bool]  # id, max_tokens, do_remote_decode, do_remote_prefill


def dispatcher_legs() -> list[Leg]:
    """The legs the dispatcher sends engines for each of PROMPTS, in order."""
    engines = {
        iid: SimEngine(
            iid,
            PROFILE,
            time_scale=0.001,
            kv_events_endpoint=None,
            options=SimEngineOptions(block_size=BS),
        )
        for iid in ("sim-0", "sim-1")
    }
    seen: list[Leg] = []

    class Spy(LocalEngineClient):
        def stream(self, routed: RoutedRequest):  # type: ignore[no-untyped-def]
            r = routed.request
            params = r.kv_transfer_params or {}
            seen.append(
                (
                    r.request_id,
                    r.sampling.max_tokens,
                    bool(params.get("do_remote_decode")),
                    bool(params.get("do_remote_prefill")),
                )
            )
            return super().stream(routed)

    state = RouterState(RouterSettings(block_size=BS), PROFILE, pools=pools(), planner=planner())
    state.sync_instances(["sim-0"], "prefill")
    state.sync_instances(["sim-1"], "decode")
    dispatcher = Dispatcher(state, Spy(engines))

    async def main() -> None:
        for e in engines.values():
            await e.start()
        for k, n in enumerate(PROMPTS):
            prompt = [100 + (7 * k + j) % 300 for j in range(n)]
            request = EngineRequest(str(k), prompt, SamplingParams(max_tokens=4))
            routed = RoutedRequest(request, "", block_hashes(prompt, BS, salt_hash("m")))
            async for _ in dispatcher.stream(routed):
                pass
        for e in engines.values():
            await e.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
    return seen


def simulator_legs() -> list[Leg]:
    """The legs the cluster simulator's engines ran for the same requests."""
    sim = ClusterSimulator(
        PROFILE,
        "kv_ttft",
        SimSettings(
            instances=2, prefill_instances=1, block_size=BS, pd_max_local_prefill_tokens=16
        ),
        BS,
    )
    plan = [
        Planned(
            k, 100.0 * k, TraceRequest(100.0 * k, n, 4, tuple(range(1000 * k, 1000 * k + n // BS)))
        )
        for k, n in enumerate(PROMPTS)
    ]
    run = sim.run(plan)
    assert all(r.status == 200 for r in run.records)
    # what the engines ran, in the order it reached them (the requests are 100 s apart)
    ran = sorted((r for inst in sim.instances for r in inst.finished), key=lambda r: r.arrival_s)
    return [(r.request_id, r.target_output, r.remote_decode, r.remote_prefill) for r in ran]


def test_dispatcher_and_simulator_send_the_same_legs() -> None:
    got, want = simulator_legs(), dispatcher_legs()
    assert got == want
    # each request split: its one-token prefill leg, then its decode leg pulling the KV
    assert got[:2] == [(lifecycle.prefill_leg_id("0"), 1, True, False), ("0", 4, False, True)]
    assert len(got) == 2 * len(PROMPTS)


def test_admit_gates_the_estimate_plus_the_wait() -> None:
    core = RouterCore(RouterSettings(block_size=BS, slo_ttft_s=0.5), PROFILE)
    core.add_instance("a")
    req = PlacementRequest("r", 8 * BS, list(range(8)))
    placed = lifecycle.admit(core, req, 0.0)
    assert placed.estimated_ttft_s is not None and placed.estimated_ttft_s < 0.5
    with pytest.raises(Rejected):
        lifecycle.admit(core, req, 0.0, waited_s=0.5)
    assert lifecycle.admit(core, req, 0.0, waited_s=0.5, gate=False).instance_id == "a"


def test_handed_over_keeps_the_routers_hints() -> None:
    request = {"kvroute": {"category": "text"}, "do_remote_decode": True}
    engine = {"do_remote_prefill": True, "remote_block_ids": [1], "kvroute": {"transfer": {}}}
    params = lifecycle.handed_over(request, engine)
    assert params["kvroute"] == {"category": "text"}
    assert params["remote_block_ids"] == [1] and params["do_remote_prefill"] is True
    assert lifecycle.request_of_prefill_leg(lifecycle.prefill_leg_id("x-1")) == "x-1"


def test_the_pool_hint_joins_the_routers_hints() -> None:
    request = {"kvroute": {"category": "text_2", "turn": 2}, "do_remote_decode": True}
    params = lifecycle.with_pool_load(request, False)
    assert params["kvroute"] == {"category": "text_2", "turn": 2, "pool_load": False}
    assert params["do_remote_decode"] is True and "pool_load" not in request["kvroute"]
    assert lifecycle.with_pool_load(None, True) == {"kvroute": {"pool_load": True}}
