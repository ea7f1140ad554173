"""``kvroute profile``: measure a real vLLM engine and write a latency profile for the sim engine
(``engines.profile.LatencyProfile``'s JSON, with the raw points and the fit's errors; how the
points are timed and fitted: ``engines.profiling``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from engines.profile import DEFAULT_PROFILE
from engines.tiny_model import MODEL_PRESETS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="tiny",
        help="HF model dir, or a built-in model: 'tiny' (default), 'small'",
    )
    p.add_argument("--name", default=DEFAULT_PROFILE, help="profile name (default: %(default)s)")
    p.add_argument("--out", default=None, help="output JSON path (default: ./<name>.json)")
    p.add_argument("--block-size", type=int, default=32, help="KV block size (default: 32)")
    p.add_argument("--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3, help="timings per point (median)")
    p.add_argument("--quick", action="store_true", help="a small grid (tests, smoke runs)")
    p.add_argument("--cpu-load-gbps", type=float, default=10.0, help="not measurable on CPU")
    p.add_argument("--hardware", default=None, help="hardware description for the file")


def _hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch
    import vllm

    return f"{cpu}, {os.cpu_count()} cores, vllm {vllm.__version__}, torch {torch.__version__}"


async def _profile(args: argparse.Namespace) -> dict[str, Any]:
    from engines.profile import LatencyProfile
    from engines.profiling import GRIDS, fit, measure
    from engines.tiny_model import resolve_model
    from engines.vllm_engine import VllmEngine

    engine = VllmEngine(
        resolve_model(args.model),
        "profile",
        block_size=args.block_size,
        kv_space_gib=args.kv_space_gib,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    await engine.start()
    try:
        info = engine.engine_info()
        grid = dict(GRIDS["quick" if args.quick else "full"])
        step, mml = info["max_num_batched_tokens"], info["max_model_len"]
        grid["prefill"] = [(n, c) for n, c in grid["prefill"] if n <= step and n + c < mml]
        m = await measure(engine, grid, args.repeats)
    finally:
        await engine.stop()
    f = fit(m)
    profile = LatencyProfile(
        name=args.name,
        model=(
            f"kvroute {args.model} random Llama (tiny_model.py)"
            if args.model in MODEL_PRESETS
            else args.model
        ),
        hardware=args.hardware or _hardware(),
        block_size=args.block_size,
        kv_capacity_tokens=info["num_gpu_blocks"] * args.block_size,
        kv_bytes_per_token=info["kv_bytes_per_token"],
        max_num_batched_tokens=info["max_num_batched_tokens"],
        max_num_seqs=info["max_num_seqs"],
        max_model_len=info["max_model_len"],
        base_ms=f["base_ms"],
        prefill_token_ms=f["token_ms"],
        prefill_attn_ms=f["attn_ms"],
        decode_seq_ms=f["seq_ms"],
        decode_ctx_ms=f["ctx_ms"],
        cpu_load_gbps=args.cpu_load_gbps,
        notes=(
            f"Measured by `kvroute profile` on {time.strftime('%Y-%m-%d')}: TTFT of max_tokens=1 "
            "requests (prefill) and median inter-token gaps with every request decoding "
            f"(decode), {args.repeats} timings per point, non-negative least squares. "
            "cpu_load_gbps is not measured (no CPU offloading on the vLLM CPU build)."
        ),
        sources=("engines/profiling.py",),
    )
    data = profile.to_dict()
    # TTFT = request_overhead_ms + the prefill step(s) (LatencyProfile reads it).
    data["request_overhead_ms"] = f["request_overhead_ms"]
    data["fit"] = {k: f[k] for k in ("prefill_median_rel_err", "decode_median_rel_err")}
    data["measurements"] = {"prefill": m.prefill, "decode": m.decode}
    return data


def run(args: argparse.Namespace) -> int:
    if args.block_size <= 0 or args.block_size % 32:
        raise ValueError(f"--block-size must be a positive multiple of 32, got {args.block_size}")
    if args.kv_space_gib < 1:
        raise ValueError(f"--kv-space-gib must be >= 1, got {args.kv_space_gib}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.cpu_load_gbps <= 0:
        raise ValueError(f"--cpu-load-gbps must be > 0, got {args.cpu_load_gbps}")
    if args.model not in MODEL_PRESETS and not Path(args.model).is_dir():
        raise ValueError(
            f"--model must be {' or '.join(map(repr, MODEL_PRESETS))} or a model directory, "
            f"got {args.model!r}"
        )
    out = Path(args.out or f"{args.name}.json")
    data = asyncio.run(_profile(args))
    out.write_text(json.dumps(data, indent=2) + "\n")
    fit_err = data["fit"]
    print(
        f"wrote {out}: base {data['base_ms']:.2f} ms, request overhead "
        f"{data['request_overhead_ms']:.2f} ms, prefill {data['prefill']['token_ms']:.4f} "
        f"ms/token, decode {data['decode']['seq_ms']:.3f} ms/seq; median fit error prefill "
        f"{fit_err['prefill_median_rel_err']:.0%}, decode {fit_err['decode_median_rel_err']:.0%}"
    )
    return 0
