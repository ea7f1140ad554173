"""Cluster KV pool throughput: put and get through kvroute's pool client (``engines.pool``) on a
real Mooncake master, against memcpy of the same bytes. Prints JSON.

    .venv/bin/python benchmarks/pool_bench.py [--blocks-kib 16,256,2048] [--batch-mib 16]
        [--total-mib 64] [--repeats 3] [--out FILE]

Everything binds 127.0.0.1. Two clients: this process's, and a holder process's (a second
segment, as another engine node's would be). Each case moves ``--total-mib`` of blocks of one
size in calls of one block (``batch: 1``) or of ``--batch-mib`` worth of blocks (``batch: n``):

- ``placement: local``: the blocks go to (and come from) this client's own segment;
  ``remote``: to the holder's segment, over the transfer engine's TCP on loopback;
- ``path: registered``: the values live in memory registered with the transfer engine (an
  engine's KV buffer: no copy in kvroute); ``staged``: plain arrays, copied through the
  client's staging buffer (one more copy each way).

``memcpy_gbps`` is numpy copying the same blocks, one ``copyto`` per block, between two buffers
of the same size: the ceiling of any CPU-side move here. GB/s are 1e9 bytes per second, medians
over ``--repeats``; each repeat puts fresh keys, reads them back (checked equal), and removes
them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks.common import AtLeastOne, Positive, print_json
from engines.pool import MasterConfig, PoolMaster, PoolStore, StoreConfig

_MiB = 1 << 20


def _store(master_address: str, metadata_url: str, segment_mib: int, staging_mib: int) -> PoolStore:
    cfg = StoreConfig(
        master_address=master_address,
        metadata_url=metadata_url,
        segment_bytes=segment_mib * _MiB,
        local_buffer_bytes=16 * _MiB,
        staging_bytes=staging_mib * _MiB,
    )
    store = PoolStore(cfg)
    if not store.connect():
        raise SystemExit(f"pool_bench: cannot join the pool at {master_address}")
    return store


def _holder(master_address: str, metadata_url: str, segment_mib: int) -> None:
    """The second node: mount a segment, say its name, hold it until stdin closes."""
    store = _store(master_address, metadata_url, segment_mib, 16)
    print(store.segment_name, flush=True)
    sys.stdin.read()
    store.close()


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _memcpy(src: np.ndarray, dst: np.ndarray) -> float:
    t = time.perf_counter()
    for i in range(src.shape[0]):
        np.copyto(dst[i], src[i])
    return time.perf_counter() - t


def _case(
    store: PoolStore,
    src: np.ndarray,
    dst: np.ndarray,
    batch: int,
    segment: str,
    staged: bool,
    tag: str,
) -> tuple[float, float]:
    """One repeat: put every block of ``src`` in calls of ``batch`` (fresh keys), read them into
    ``dst``, check, remove. Seconds for the puts and for the gets."""
    n = src.shape[0]
    keys = [f"bench/{tag}/{i}" for i in range(n)]
    rows_src = [src[i].copy() for i in range(n)] if staged else list(src)
    rows_dst = [np.empty_like(src[0]) for _ in range(n)] if staged else list(dst)
    t = time.perf_counter()
    for s in range(0, n, batch):
        ok = store.put_blocks(keys[s : s + batch], rows_src[s : s + batch], segment=segment)
        if not all(ok):
            raise SystemExit(f"pool_bench: a put failed: {store.stats()}")
    put_s = time.perf_counter() - t
    t = time.perf_counter()
    for s in range(0, n, batch):
        if not all(store.get_blocks(keys[s : s + batch], rows_dst[s : s + batch])):
            raise SystemExit(f"pool_bench: a get missed: {store.stats()}")
    get_s = time.perf_counter() - t
    got = np.stack(rows_dst) if staged else dst
    if not np.array_equal(got[:: max(1, n // 7)], src[:: max(1, n // 7)]):
        raise SystemExit("pool_bench: a block read back differs from the one put")
    store.remove_blocks(keys, force=True)
    return put_s, get_s


def _cases(args: argparse.Namespace) -> list[tuple[int, str, str, str]]:
    """(block bytes, batch, placement, path) of every case measured."""
    out = []
    for kib in (int(k) for k in args.blocks_kib.split(",")):
        for batch in ("1", "n"):
            for placement in ("local", "remote"):
                out.append((kib * 1024, batch, placement, "registered"))
            out.append((kib * 1024, batch, "remote", "staged"))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    total = args.total_mib * _MiB
    segment_mib = max(64, 2 * args.total_mib + 16)
    cfg = MasterConfig(host="127.0.0.1", kv_lease_ttl_ms=100)
    with PoolMaster(cfg) as master:
        holder = subprocess.Popen(
            [sys.executable, __file__, "--holder", master.master_address, master.metadata_url,
             str(segment_mib)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        store = None
        try:
            assert holder.stdout is not None
            remote = holder.stdout.readline().strip()
            if not remote:
                raise SystemExit("pool_bench: the holder process did not join the pool")
            store = _store(master.master_address, master.metadata_url, segment_mib, args.batch_mib)
            local = store.segment_name
            assert local is not None
            rows = []
            for block, batch_kind, placement, path in _cases(args):
                n = max(1, total // block)
                batch = 1 if batch_kind == "1" else max(1, args.batch_mib * _MiB // block)
                src = np.random.default_rng(0).integers(0, 256, (n, block), dtype=np.uint8)
                dst = np.ones_like(src)  # touched: no first-write page faults in a timing
                if path == "registered":
                    store.register(src)
                    store.register(dst)
                seg = local if placement == "local" else remote
                puts, gets, copies = [], [], []
                for r in range(args.repeats):
                    tag = f"{block}-{batch}-{placement}-{path}-{r}"
                    p, g = _case(store, src, dst, batch, seg, path == "staged", tag)
                    puts.append(p)
                    gets.append(g)
                    copies.append(_memcpy(src, dst))
                nbytes = n * block
                rows.append(
                    {
                        "block_kib": block // 1024,
                        "batch": batch,
                        "placement": placement,
                        "path": path,
                        "mib": round(nbytes / _MiB, 1),
                        "put_gbps": _gbps(nbytes, statistics.median(puts)),
                        "get_gbps": _gbps(nbytes, statistics.median(gets)),
                        "memcpy_gbps": _gbps(nbytes, statistics.median(copies)),
                        "put_us_per_call": round(statistics.median(puts) / -(-n // batch) * 1e6),
                        "get_us_per_call": round(statistics.median(gets) / -(-n // batch) * 1e6),
                    }
                )
                print(rows[-1], file=sys.stderr, flush=True)
                if path == "registered":
                    store.unregister(src)
                    store.unregister(dst)
            stats = store.stats()
        finally:
            if store is not None:
                store.close()
            if holder.stdin is not None:
                holder.stdin.close()
            try:
                holder.wait(30)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait()
    return {
        "machine": {"cpus": os.cpu_count()},
        "total_mib": args.total_mib,
        "batch_mib": args.batch_mib,
        "repeats": args.repeats,
        "cases": rows,
        "client_stats": stats,
    }


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--holder":
        _holder(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks-kib", default="16,256,2048", help="block sizes in KiB")
    ap.add_argument("--batch-mib", type=int, default=16, action=Positive)
    ap.add_argument("--total-mib", type=int, default=64, action=Positive)
    ap.add_argument("--repeats", type=int, default=3, action=AtLeastOne)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    print_json(run(args), args.out)


if __name__ == "__main__":
    main()
