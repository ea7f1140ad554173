"""Prefill/decode disaggregation in the sim engine, on real sim engines (virtual and real time):
vLLM's ``kv_transfer_params`` handed from a prefill to a decode engine, the decode's KV pull
(timing, blocks, KV events, last-token recompute), usage and load as vLLM reports them, and
malformed params refused by key."""

from __future__ import annotations

import asyncio
import random

import pytest

from cachemap.events import BlockStored
from engines.base import (
    DEFAULT_TRANSFER_GBPS,
    DEFAULT_TRANSFER_LATENCY_MS,
    EngineOutput,
    EngineRequest,
    SamplingParams,
)
from engines.profile import LatencyProfile
from engines.sim.engine import SimEngine
from engines.sim.options import SimEngineOptions
from engines.sim.request import Status, make_request
from engines.sim.scheduler import Scheduler
from engines.sim.virtual import VirtualInstance

BS = 16
HINTS = {"kvroute": {"category": "text_2", "continuation": 0.6}}
NIXL_KEYS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
    "remote_prefill_cached_tokens",
}


@pytest.fixture(scope="module")
def profile() -> LatencyProfile:
    return LatencyProfile.load("h100-llama3.1-8b")  # no request overhead: TTFTs are steps


def tokens(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(1000, 30000), k=n)


def stored_hashes(batches: list[list]) -> list[int]:
    """Every ``BlockStored`` hash in the batches an instance published, in order."""
    out: list[int] = []
    for events in batches:
        for e in events:
            if isinstance(e, BlockStored):
                out.extend(e.block_hashes)
    return out


def virtual(name: str, profile: LatencyProfile, batches: list[list] | None = None, **options):
    on_events = None if batches is None else (lambda _i, _s, events: batches.append(events))
    return VirtualInstance(name, profile, on_events=on_events, options=SimEngineOptions(**options))


def prefill_params(profile: LatencyProfile, prompt: list[int], at: float = 0.0):
    """Run ``prompt`` on a prefill instance; returns (its finished request, its events)."""
    events: list[bytes] = []
    inst = virtual("p0", profile, events)
    req = make_request(
        "r1",
        block_size=BS,
        max_tokens=1,
        prompt_token_ids=prompt,
        kv_transfer_params={"do_remote_decode": True, **HINTS},
    )
    inst.submit(req, at)
    inst.drain()
    (done,) = inst.finished
    return done, events


def expected_transfer_s(profile: LatencyProfile, pulled: int) -> float:
    return (
        pulled * profile.kv_bytes_per_token / (DEFAULT_TRANSFER_GBPS * 1e9)
        + DEFAULT_TRANSFER_LATENCY_MS / 1e3
    )


# -- (a) virtual-time pair -------------------------------------------------------------------


def test_prefill_hands_over_nixl_params(profile):
    prompt = tokens(1, 1000)
    done, events = prefill_params(profile, prompt)
    params = done.kv_transfer_params
    assert done.num_output == 1 and done.finish_reason == "length"
    assert params is not None and set(params) == NIXL_KEYS
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "p0" and params["remote_request_id"] == "r1"
    assert params["tp_size"] == 1 and params["transfer_mode"] == "pull"
    assert params["remote_num_tokens"] == 1000 and params["remote_prefill_cached_tokens"] == 0
    # one KV cache group, every block the request held (1000 tokens: 63 blocks of 16)
    (group,) = params["remote_block_ids"]
    assert len(group) == -(-1000 // BS) and len(set(group)) == len(group) and 0 not in group
    assert stored_hashes(events) == done.block_hashes[: 1000 // BS]


def test_decode_pulls_the_prompt_and_recomputes_only_its_last_token(profile):
    prompt = tokens(2, 2000)
    pre, pre_events = prefill_params(profile, prompt)
    params = {**pre.kv_transfer_params, **HINTS}  # the router merges its hints in
    events: list[bytes] = []
    dec = virtual("d0", profile, events)
    req = make_request(
        "r1", block_size=BS, max_tokens=20, prompt_token_ids=prompt, kv_transfer_params=params
    )
    dec.submit(req, 5.0)
    dec.run_until(5.0 + 1e-6)  # admitted: pulling, holding its blocks, counted as waiting
    assert req.status == Status.WAITING_FOR_REMOTE_KVS and len(req.blocks) == -(-2000 // BS)
    load = dec.load()
    assert (load.waiting, load.running) == (1, 0) and load.gpu_kv_usage > 0
    assert dec.load().queued_prefill_tokens == 1
    transfer = expected_transfer_s(profile, 2000)
    assert req.transfer_s == pytest.approx(transfer) and req.remote_tokens == 2000
    assert dec.wake_s() == pytest.approx(5.0 + transfer)  # wakes when the KV arrives
    assert stored_hashes(events) == []  # nothing cached before the KV is there
    dec.drain()

    # one step after the transfer: a prefill of one token (the last), after 1999 in the cache
    assert req.first_token_s == pytest.approx(5.0 + transfer + profile.prefill_s(1, 1999))
    assert req.cached_tokens == 0 and req.reported_cached_tokens == 0  # the prefill's hit
    # the loaded blocks are announced as any computed block, with the prefill's hashes
    assert stored_hashes(events)[: 2000 // BS] == stored_hashes(pre_events)
    assert dec.scheduler.remote_tokens_admitted == 2000

    # same tokens as the request run whole on one engine (outputs are seeded by the prompt)
    colo = virtual("c0", profile)
    whole = make_request("r1", block_size=BS, max_tokens=20, prompt_token_ids=prompt)
    colo.submit(whole, 0.0)
    colo.drain()
    assert req.token_ids == whole.token_ids and len(req.token_ids) == 2020
    assert pre.token_ids[-1] == whole.token_ids[2000]  # the prefill's one token, resampled
    assert req.finish_s - req.first_token_s == pytest.approx(whole.finish_s - whole.first_token_s)


def test_decode_with_a_partial_local_hit_pulls_only_the_rest(profile):
    prompt = tokens(3, 1500)
    pre, _ = prefill_params(profile, prompt)
    params = dict(pre.kv_transfer_params)
    del params["remote_prefill_cached_tokens"]  # then vLLM reports local + pulled tokens
    events: list[bytes] = []
    dec = virtual("d0", profile, events)
    # an earlier conversation on the decode engine shared the first 600 tokens
    dec.submit(make_request("old", block_size=BS, max_tokens=2, prompt_token_ids=prompt[:600]), 0)
    dec.drain()
    hit = (600 // BS) * BS
    req = make_request(
        "r1", block_size=BS, max_tokens=5, prompt_token_ids=prompt, kv_transfer_params=params
    )
    dec.submit(req, 10.0)
    dec.drain()
    assert req.cached_tokens == hit and req.remote_tokens == 1500 - hit
    assert req.transfer_s == pytest.approx(expected_transfer_s(profile, 1500 - hit))
    assert req.reported_cached_tokens == 1500  # local + external, as vLLM's PrefillStats
    assert req.first_token_s == pytest.approx(10.0 + req.transfer_s + profile.prefill_s(1, 1499))
    # the pulled blocks (those past the hit) are stored once the KV arrives
    new = stored_hashes(events)[600 // BS :]
    assert new[: 1500 // BS - 600 // BS] == req.block_hashes[600 // BS : 1500 // BS]


@pytest.mark.parametrize(
    ("n", "latency_ms"),
    [(3000, DEFAULT_TRANSFER_LATENCY_MS), (100, 0.0)],  # KV after several steps / within one
)
def test_a_pull_arriving_during_a_decode_run_joins_the_next_step(profile, n, latency_ms):
    """Skipping decode steps in closed form stops at a KV's arrival: draining in one call and
    running in 1 ms slices give the same times."""

    def scenario(slices: bool) -> tuple[float, float]:
        pre, _ = prefill_params(profile, tokens(4, n))
        dec = virtual("d0", profile, transfer_latency_ms=latency_ms)
        busy = make_request("busy", block_size=BS, max_tokens=400, prompt_token_ids=tokens(5, 50))
        dec.submit(busy, 0.0)
        pd = make_request(
            "r1",
            block_size=BS,
            max_tokens=10,
            prompt_token_ids=tokens(4, n),
            kv_transfer_params=pre.kv_transfer_params,
        )
        dec.run_until(0.3)
        dec.submit(pd, 0.3)
        if slices:
            t = 0.3
            while not dec.scheduler.idle:
                t += 0.001
                dec.run_until(t)
        else:
            dec.drain()
        return pd.first_token_s, busy.finish_s

    drained, sliced = scenario(False), scenario(True)
    assert drained == pytest.approx(sliced, rel=1e-9)
    transfer = n * profile.kv_bytes_per_token / (DEFAULT_TRANSFER_GBPS * 1e9) + latency_ms / 1e3
    ready = 0.3 + transfer
    # admitted by the first step that starts after the KV arrived (steps here are < 10 ms)
    assert ready < drained[0] < ready + 0.02


def test_decode_blocked_behind_pulls_waits_for_the_kv(profile):
    """A pull holds its blocks: a queue head that does not fit waits (idle) for the KV."""
    prompt = tokens(6, 1200)
    pre, _ = prefill_params(profile, prompt)
    dec = virtual("d0", profile, num_gpu_blocks=1 + 2 * (1200 // BS))  # room for ~2 prompts
    pd = make_request(
        "r1",
        block_size=BS,
        max_tokens=3,
        prompt_token_ids=prompt,
        kv_transfer_params=pre.kv_transfer_params,
    )
    other = make_request("o", block_size=BS, max_tokens=3, prompt_token_ids=tokens(7, 1300))
    dec.submit(pd, 1.0)
    dec.submit(other, 1.0)
    dec.drain()
    assert pd.num_output == 3 and other.num_output == 3
    assert other.first_token_s > pd.kv_ready_s  # it waited for the pull's blocks to be used


def test_scheduler_admits_a_pull_with_a_one_token_prefill(profile):
    sched = Scheduler.for_profile(profile, engine_id="d9")
    pre = make_request(
        "p", block_size=BS, max_tokens=1, prompt_token_ids=tokens(8, 100),
        kv_transfer_params={"do_remote_decode": True},
    )  # fmt: skip
    sched.add(pre)
    step = sched.schedule(0.0)
    assert step.scheduled == [(pre, 100, 0)]
    sched.complete(step, 0.01)
    assert pre.kv_transfer_params is not None
    assert pre.kv_transfer_params["remote_engine_id"] == "d9"
    dec = Scheduler.for_profile(profile)
    r = make_request(
        "d", block_size=BS, max_tokens=4, prompt_token_ids=tokens(8, 100),
        kv_transfer_params=pre.kv_transfer_params,
    )  # fmt: skip
    dec.add(r)
    assert not dec.schedule(0.0).scheduled and dec.pulling == [r]
    assert not dec.schedule(r.kv_ready_s - 1e-9).scheduled  # the KV is not there yet
    step = dec.schedule(r.kv_ready_s)
    assert step.scheduled == [(r, 1, 99)] and step.duration_s == pytest.approx(
        profile.prefill_s(1, 99)
    )
    # aborting a pull in flight frees its blocks
    r2 = make_request(
        "d2", block_size=BS, max_tokens=4, prompt_token_ids=tokens(9, 100),
        kv_transfer_params=pre.kv_transfer_params,
    )  # fmt: skip
    dec.add(r2)
    dec.schedule(1.0)
    assert r2.status == Status.WAITING_FOR_REMOTE_KVS
    free = dec.blocks.num_free
    assert dec.abort(r2) and dec.pulling == [] and dec.blocks.num_free == free + len(r2.blocks) + 7


# -- (b) real-time pair ----------------------------------------------------------------------


def engine(name: str, time_scale: float = 0.01, **options) -> SimEngine:
    return SimEngine(
        name,
        "cpu-tiny-llama",
        time_scale=time_scale,
        kv_events_endpoint=None,
        options=SimEngineOptions(**options),
    )


async def collect(eng: SimEngine, req: EngineRequest) -> list[EngineOutput]:
    return [out async for out in eng.generate(req)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def request(rid: str, prompt: list[int], max_tokens: int, params=None) -> EngineRequest:
    return EngineRequest(
        rid, prompt, SamplingParams(max_tokens=max_tokens), kv_transfer_params=params
    )


def test_sim_engines_hand_a_request_over_through_generate():
    prompt = list(range(1000, 1300))

    async def main():
        pre, dec, colo = engine("pre-0"), engine("dec-0"), engine("colo-0")
        for e in (pre, dec, colo):
            await e.start()
        p_out = await collect(pre, request("x", prompt, 1, {"do_remote_decode": True, **HINTS}))
        params = {**p_out[-1].kv_transfer_params, **HINTS}
        d_out = await collect(dec, request("x", prompt, 8, params))
        bare = {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}
        again = await collect(dec, request("y", prompt, 8, bare))
        c_out = await collect(colo, request("x", prompt, 8))
        load = dec.load()
        hashes = dec.blocks.gpu_hashes()
        for e in (pre, dec, colo):
            await e.stop()
        return p_out, d_out, again, c_out, load, hashes

    p_out, d_out, again, c_out, load, hashes = run(main())
    final = p_out[-1]
    assert final.finished and len(p_out) == 1 and len(final.token_ids) == 1
    params = final.kv_transfer_params
    assert params is not None and set(params) == NIXL_KEYS
    assert params["remote_engine_id"] == "pre-0" and params["remote_request_id"] == "x"
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    toks = lambda outs: [t for o in outs for t in o.token_ids]  # noqa: E731
    assert toks(d_out) == toks(c_out) and toks(p_out) == toks(c_out)[:1]
    assert d_out[-1].kv_transfer_params is None  # a decode hands nothing over
    usage = d_out[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (300, 8)
    assert usage.cached_tokens == 0  # the prefill engine's hit (remote_prefill_cached_tokens)
    # without that key: the local hit (the first pull left 9 blocks) plus the pulled tokens
    assert again[-1].usage.cached_tokens == 300 and toks(again) == toks(c_out)
    assert load.waiting == 0 and load.running == 0
    tiny = LatencyProfile.load("cpu-tiny-llama")
    expected = make_request("x", block_size=tiny.block_size, max_tokens=8, prompt_token_ids=prompt)
    assert set(expected.block_hashes[: 300 // tiny.block_size]) <= hashes


def test_sim_engine_counts_a_pull_as_waiting():
    prompt = list(range(2000, 2100))

    async def main():
        pre = engine("pre-1", time_scale=0.0)
        dec = engine("dec-1", time_scale=1.0, transfer_latency_ms=600.0)
        for e in (pre, dec):
            await e.start()
        (out,) = await collect(pre, request("x", prompt, 1, {"do_remote_decode": True}))
        pull = request("x", prompt, 2, out.kv_transfer_params)
        task = asyncio.create_task(collect(dec, pull))
        await asyncio.sleep(0.2)  # past the request overhead, inside the 600 ms transfer
        load = dec.load()
        outs = await task
        for e in (pre, dec):
            await e.stop()
        return load, outs

    load, outs = run(main())
    assert (load.waiting, load.running) == (1, 0) and load.gpu_kv_usage > 0
    assert load.queued_prefill_tokens == 1
    assert outs[-1].finished and len(outs) == 2


# -- (c) malformed params ----------------------------------------------------------------------


GOOD = {
    "do_remote_prefill": True,
    "remote_engine_id": "p0",
    "remote_request_id": "r",
    "remote_block_ids": [[1, 2]],
    "remote_host": "localhost",
    "remote_port": 5600,
}


@pytest.mark.parametrize("key", [k for k in GOOD if k != "do_remote_prefill"])
def test_malformed_remote_params_name_the_key(key):
    missing = {k: v for k, v in GOOD.items() if k != key}
    wrong = {**GOOD, key: True}  # a bool is not an id, a list or a port
    for params in (missing, wrong):
        with pytest.raises(ValueError, match=key):
            make_request(
                "r", block_size=BS, max_tokens=2, prompt_token_ids=[1, 2, 3],
                kv_transfer_params=params,
            )  # fmt: skip

    async def main():
        eng = engine("dec-2")
        await eng.start()
        try:
            # refused as a client error (as vLLM refuses what its validation rejects), not
            # raised: an error would send the request to every other engine in turn
            refused = await collect(eng, request("r", [1, 2, 3], 2, missing))
            # the engine is still healthy and serves the well-formed request
            return refused, await collect(eng, request("ok", list(range(100)), 2, GOOD))
        finally:
            await eng.stop()

    refused, outs = run(main())
    assert [(o.finished, o.finish_reason, o.token_ids) for o in refused] == [(True, "error", [])]
    assert key in refused[0].error
    assert outs[-1].finished and outs[-1].usage.completion_tokens == 2


def test_params_without_pd_flags_change_nothing(profile):
    """Hints alone (or do_remote_prefill False) make an ordinary request."""
    a = make_request("a", block_size=BS, max_tokens=3, prompt_token_ids=tokens(10, 200))
    b = make_request(
        "b", block_size=BS, max_tokens=3, prompt_token_ids=tokens(10, 200),
        kv_transfer_params={**HINTS, "do_remote_prefill": False},
    )  # fmt: skip
    for r in (a, b):
        inst = virtual("v", profile)
        inst.submit(r, 0.0)
        inst.drain()
    assert (a.first_token_s, a.finish_s, a.token_ids) == (b.first_token_s, b.finish_s, b.token_ids)
    assert b.kv_transfer_params is None and b.remote_tokens == 0 and not b.remote_prefill


# -- the same semantics as vLLM's own scheduler with its NixlConnector -----------------------


@pytest.mark.slow
def test_pd_matches_vllm_scheduler_with_nixl_connector():
    """vLLM 0.32's v1 ``Scheduler`` with a ``NixlConnector`` (scheduler role, no transfer:
    its completion is reported as the worker would) against the sim's, step by step: the
    prefill's params, then a decode with a partial local hit: nothing scheduled while the KV
    is pulled (counted as waiting), then one token after the rest of the prompt, and the
    local/external split of the cached tokens."""
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        VllmConfig,
    )
    from vllm.config import SchedulerConfig as VllmSchedulerConfig
    from vllm.sampling_params import SamplingParams as VllmSamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    from engines.tiny_model import build_tiny_model

    bs, n_blocks, mml = 32, 200, 4096
    model = str(build_tiny_model())
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(bs, sha256_cbor)

    def vllm_engine(engine_id: str) -> VllmScheduler:
        vc = VllmConfig(
            model_config=ModelConfig(
                model=model, tokenizer=model, max_model_len=mml, dtype="bfloat16"
            ),
            scheduler_config=VllmSchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=512,
                max_model_len=mml,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=bs, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="NixlConnector", kv_role="kv_both", engine_id=engine_id
            ),
        )
        vc.cache_config.num_gpu_blocks = n_blocks
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
        kvc = KVCacheConfig(
            num_blocks=n_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
        )
        return VllmScheduler(vc, kvc, StructuredOutputManager(vc), block_size=bs)

    def vllm_request(rid: str, toks: list[int], max_tokens: int, params=None) -> Request:
        sp = VllmSamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(rid, toks, sp, None, block_hasher=hasher)
        req.kv_transfer_params = params
        return req

    def sampled(rids: list[str]) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            req_ids=rids,
            req_id_to_index={r: i for i, r in enumerate(rids)},
            sampled_token_ids=[[7] for _ in rids],
        )

    tiny = LatencyProfile.load("cpu-tiny-llama")
    prompt = list(range(1000, 1300))

    def sim_engine(engine_id: str) -> Scheduler:
        return Scheduler.for_profile(
            tiny, engine_id=engine_id, options=SimEngineOptions(num_gpu_blocks=n_blocks)
        )

    def sim_request(rid: str, toks: list[int], max_tokens: int, params=None):
        return make_request(
            rid, block_size=bs, max_tokens=max_tokens, prompt_token_ids=toks,
            kv_transfer_params=params,
        )  # fmt: skip

    # prefill: the params vLLM returns (remote_block_ids a tuple of lists: JSON makes it a list)
    vp = vllm_engine("P")
    vp.add_request(vllm_request("x", prompt, 1, {"do_remote_decode": True}))
    out = vp.schedule()
    finals = vp.update_from_output(out, sampled(["x"]))
    (theirs,) = [o.kv_transfer_params for v in finals.values() for o in v.outputs]
    sp = sim_engine("P")
    pre = sim_request("x", prompt, 1, {"do_remote_decode": True})
    sp.add(pre)
    sp.complete(sp.schedule(0.0), 0.01)
    assert {**theirs, "remote_block_ids": [list(g) for g in theirs["remote_block_ids"]]} == (
        pre.kv_transfer_params
    )

    # decode, after a shorter prompt left 4 blocks of the prefix in its cache
    vd, sd = vllm_engine("D"), sim_engine("D")
    vd.add_request(vllm_request("w", prompt[:150], 1))
    vd.update_from_output(vd.schedule(), sampled(["w"]))
    sd.add(sim_request("w", prompt[:150], 1))
    sd.complete(sd.schedule(0.0), 0.01)
    vreq = vllm_request("y", prompt, 4, dict(theirs))
    vd.add_request(vreq)
    sreq = sim_request("y", prompt, 4, pre.kv_transfer_params)
    sd.add(sreq)
    out, step = vd.schedule(), sd.schedule(1.0)
    assert dict(out.num_scheduled_tokens) == {} and step.scheduled == []
    assert vreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sreq.status == Status.WAITING_FOR_REMOTE_KVS
    assert vreq.num_computed_tokens == sreq.num_computed == 300
    assert vd.get_request_counts() == (len(sd.running), len(sd.waiting) + len(sd.pulling))
    done = KVConnectorOutput(finished_recving={"y"})
    vd.update_from_output(
        out, ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=done)
    )
    out, step = vd.schedule(), sd.schedule(sreq.kv_ready_s)
    assert dict(out.num_scheduled_tokens) == {"y": 1} and step.scheduled == [(sreq, 1, 299)]
    assert [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [("y", 299)]
    finals = vd.update_from_output(out, sampled(["y"]))
    (stats,) = [o.prefill_stats for v in finals.values() for o in v.outputs]
    assert (
        (stats.num_local_cached_tokens, stats.num_external_cached_tokens)
        == (
            sreq.cached_tokens,
            sreq.remote_tokens,
        )
        == (128, 172)
    )
