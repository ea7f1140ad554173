"""Cache-map benchmark: hashing cost, match latency, ingest rate and memory. Prints JSON.

    .venv/bin/python benchmarks/cachemap_bench.py [--blocks 1000000] [--instances 16,64,1024]
        [--strides 1,2,4] [--repeats 5]

Workload: ``--blocks`` resident (block, instance) entries over each of ``--instances``. Each
instance holds chains made of a shared system prompt (a pool of 64, 4-64 blocks each,
Zipf-popular) followed by a private conversation, so interior blocks are shared across
instances the way production prefixes are. Queries are chains that are fully resident on some
instance (the worst case: every block is looked up) after a popular shared prefix.

``ingest`` is the translation path end to end on one core (vLLM batch -> translate -> apply;
the translation runs in each engine's forwarder, not in the router); ``router_ingest`` is what
a router replica spends: decoding and applying a busy cluster's messages (``router_messages``)
on a map already holding ``--blocks`` engine blocks over the largest ``--instances``, in engine
blocks per second of CPU time, at each ``--strides``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc

import numpy as np

from cachemap import CacheMap, Tier, block_hashes, salt_hash
from cachemap.events import (
    BlockStored,
    InstanceEvents,
    KVEventBatch,
    Removed,
    Stored,
    Update,
    decode_message,
    encode_message,
    encode_vllm_batch,
)
from cachemap.ingest import CacheMapIngestor, EngineEventTranslator

BLOCK = 16


def bench_hashing(repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 150_000, 1000 * 200)
    as_list = toks.tolist()
    salt = salt_hash("bench")
    out = {}
    for name, src in (("numpy", toks), ("list", as_list)):
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i in range(200):
                block_hashes(src[i * 1000 : (i + 1) * 1000], BLOCK, salt)
            runs.append((time.perf_counter() - t0) / 200 * 1e6)
        out[f"hash_us_per_1k_tokens_{name}_input"] = round(statistics.median(runs), 2)
    return out


def build_map(
    n_instances: int, total: int, rng: np.random.Generator
) -> tuple[CacheMap, list[list[int]]]:
    """Chains of shared prefix + private suffix until ``total`` residency entries exist."""
    system = [
        list(rng.integers(1, 2**63, int(rng.integers(4, 65)), dtype=np.uint64).tolist())
        for _ in range(64)
    ]
    weights = 1.0 / np.arange(1, 65)
    weights /= weights.sum()
    cmap = CacheMap(initial_slots=total)
    chains: list[list[int]] = []
    placed = 0
    while placed < total:
        prefix = system[int(rng.choice(64, p=weights))]
        suffix_len = int(rng.integers(8, 600))
        chain = prefix + rng.integers(1, 2**63, suffix_len, dtype=np.uint64).tolist()
        inst = f"engine-{int(rng.integers(n_instances))}"
        tier = Tier.GPU if rng.random() < 0.7 else Tier.CPU
        placed += cmap.store(inst, tier, chain)
        chains.append(chain)
    return cmap, chains


def bench_match(cmap: CacheMap, chains: list[list[int]], length: int, rng) -> dict[str, float]:
    long_enough = [c for c in chains if len(c) >= length]
    queries = [long_enough[int(i)][:length] for i in rng.integers(len(long_enough), size=2000)]
    for q in queries[:100]:
        cmap.match(q)  # warm up
    lat = []
    for q in queries:
        t0 = time.perf_counter_ns()
        cmap.match(q)
        lat.append(time.perf_counter_ns() - t0)
    lat_us = np.asarray(lat) / 1e3
    return {"p50_us": float(np.percentile(lat_us, 50)), "p99_us": float(np.percentile(lat_us, 99))}


def bench_ingest(repeats: int) -> dict[str, float]:
    """Blocks/s from vLLM batch bytes: engine-side translation, router-side apply, and both."""
    rng = np.random.default_rng(1)
    n_req, blocks_per_req = 2000, 32
    payloads = []
    for r in range(n_req):
        toks = rng.integers(0, 150_000, blocks_per_req * BLOCK).tolist()
        ev = BlockStored(
            block_hashes=[(r << 16) | i for i in range(blocks_per_req)],
            parent_block_hash=None,
            token_ids=toks,
            block_size=BLOCK,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        payloads.append(encode_vllm_batch(KVEventBatch(ts=0.0, events=[ev])))
    n_blocks = n_req * blocks_per_req
    translate, apply_ = [], []
    for _ in range(repeats):
        tr = EngineEventTranslator("e0", "bench", BLOCK)
        t0 = time.perf_counter()
        msgs = [tr.feed(p, i, 0.0) for i, p in enumerate(payloads)]
        translate.append(n_blocks / (time.perf_counter() - t0))
        wire = [encode_message(m) for m in msgs if m is not None]
        ing = CacheMapIngestor(CacheMap(initial_slots=n_blocks))
        t0 = time.perf_counter()
        for w in wire:
            ing.apply(decode_message(w))
        apply_.append(n_blocks / (time.perf_counter() - t0))
    t, a = statistics.median(translate), statistics.median(apply_)
    return {
        "translate_blocks_per_s": round(t),
        "apply_blocks_per_s": round(a),
        "end_to_end_blocks_per_s": round(1 / (1 / t + 1 / a)),
    }


def router_messages(
    n_instances: int, resident: int, stride: int, timed: int, rng: np.random.Generator
) -> tuple[list[bytes], list[bytes], int]:
    """KV event messages as a router replica reads them from ``n_instances`` busy engines: each
    stores a prompt (a Zipf-popular shared system prompt, then a private 8-600-block tail) and,
    once the engine holds its share of ``resident`` engine blocks, removes an older prompt's
    tail. Every ``stride``-th block is kept, as the engines' translators keep them. Returns
    (the warm-up that fills the map, the ``timed`` ones after it, the engine blocks those
    stand for)."""
    system = [rng.integers(1, 2**63, int(rng.integers(4, 65)), dtype=np.uint64) for _ in range(64)]
    weights = 1.0 / np.arange(1, 65)
    weights /= weights.sum()
    share = resident // n_instances
    held = [0] * n_instances
    tails: list[list[list[int]]] = [[] for _ in range(n_instances)]
    seq = [0] * n_instances
    warm: list[bytes] = []
    out: list[bytes] = []
    blocks = 0
    k = stride
    while len(out) < timed:
        i = int(rng.integers(n_instances))
        prefix = system[int(rng.choice(64, p=weights))]
        tail = rng.integers(1, 2**63, int(rng.integers(8, 600)), dtype=np.uint64)
        chain = np.concatenate([prefix, tail])
        kept = chain[k - 1 :: k].tolist()
        updates: list[Update] = [Stored("GPU", kept, None, 0)]
        n = len(chain)
        private = tail[(-len(prefix) - 1) % k :: k].tolist()  # its kept blocks past the prefix
        tails[i].append(private)
        held[i] += n
        if held[i] > share and len(tails[i]) > 1:
            old = tails[i].pop(0)
            updates.append(Removed("GPU", old))
            held[i] -= len(old) * k
            n += len(old) * k
        msg = encode_message(InstanceEvents(f"engine-{i}", seq[i], 0.0, updates))
        seq[i] += 1
        if sum(held) < resident:
            warm.append(msg)
        else:
            out.append(msg)
            blocks += n
    return warm, out, blocks


def bench_router_ingest(
    n_instances: int, resident: int, strides: list[int], repeats: int
) -> dict[str, object]:
    """What a router replica spends following the engines' KV events: decode and apply of
    ``router_messages`` on a map already holding ``resident`` engine blocks, in engine blocks
    per second of one core, at each stride."""
    out: dict[str, object] = {"instances": n_instances, "resident_engine_blocks": resident}
    for k in strides:
        runs = []
        for r in range(repeats):
            rng = np.random.default_rng(100 + r)
            warm, timed, blocks = router_messages(n_instances, resident, k, 20_000, rng)
            ing = CacheMapIngestor(CacheMap(initial_slots=resident // k, stride=k))
            for w in warm:
                ing.apply(decode_message(w))
            t0 = time.process_time()
            for w in timed:
                ing.apply(decode_message(w))
            runs.append(blocks / (time.process_time() - t0))
        out[f"stride_{k}_engine_blocks_per_core_s"] = round(statistics.median(runs))
    return out


def bench_memory(n_instances: int, total: int) -> dict[str, float]:
    rng = np.random.default_rng(2)
    build_map(n_instances, 10_000, rng)  # imports and compiles what a map uses, outside the count
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cmap, chains = build_map(n_instances, total, rng)
    del chains
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    st = cmap.stats()
    return {
        "distinct_blocks": st.blocks,
        "residency_entries": st.residency,
        "bytes_total": used,
        "bytes_per_residency_entry": round(used / st.residency, 1),
        "bytes_per_distinct_block": round(used / st.blocks, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument(
        "--instances",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[16, 64, 1024],
        help="comma-separated instance counts to match over; memory is measured at the largest",
    )
    ap.add_argument(
        "--strides",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1, 2, 4],
        help="event strides to measure a router's ingest at (over the largest --instances)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    result: dict[str, object] = {"block_size": BLOCK, "resident_blocks": args.blocks}
    result.update(bench_hashing(args.repeats))
    match: dict[str, object] = {}
    for n_inst in args.instances:
        rng = np.random.default_rng(n_inst)
        cmap, chains = build_map(n_inst, args.blocks, rng)
        for length in (160, 512):
            runs = [bench_match(cmap, chains, length, rng) for _ in range(args.repeats)]
            match[f"{length}_blocks_{n_inst}_instances"] = {
                k: round(statistics.median(r[k] for r in runs), 2) for k in ("p50_us", "p99_us")
            }
        del cmap, chains
    result["match"] = match
    result["ingest"] = bench_ingest(args.repeats)
    most = max(args.instances)
    result["router_ingest"] = bench_router_ingest(most, args.blocks, args.strides, args.repeats)
    result[f"memory_{most}_instances"] = bench_memory(most, args.blocks)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
