"""``kvroute cachesim``: replay a trace through eviction policies and report hit rates."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, metavar="FILE", help="JSONL trace file")
    parser.add_argument(
        "--format", default="auto", help="mooncake, bailian or auto (default: auto)"
    )
    parser.add_argument(
        "--policy", default="lru", metavar="NAME[,NAME...]", help="policies (default: lru)"
    )
    parser.add_argument(
        "--capacity-blocks",
        required=True,
        metavar="N[,N...]",
        help="cache sizes in trace blocks (512 tokens for Mooncake, 16 for Bailian)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--skip-invalid", action="store_true", help="skip malformed trace lines instead of failing"
    )


def parse_capacities(text: str) -> list[int]:
    caps: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = int(part)
        except ValueError:
            value = 0
        if value <= 0:
            raise ValueError(f"--capacity-blocks: expected positive integers, got {part!r}")
        caps.append(value)
    return caps


def parse_policies(text: str) -> list[str]:
    from policies.registry import get_policy_class

    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    if not names:
        raise ValueError("--policy: expected at least one policy name")
    for name in names:
        try:
            get_policy_class(name)
        except ValueError as e:
            raise ValueError(f"--{e}") from None
    return names


def run(args: argparse.Namespace) -> int:
    from loadgen.traces import load_trace
    from simulation.cachesim import infinite_hit_rate, simulate

    names = parse_policies(args.policy)
    caps = parse_capacities(args.capacity_blocks)
    if args.format not in ("auto", "mooncake", "bailian"):
        raise ValueError(f"--format: expected auto, mooncake or bailian, got {args.format!r}")
    path = Path(args.trace)
    if not path.exists():
        raise ValueError(f"--trace: no such file: {path}")
    if not path.is_file():
        raise ValueError(f"--trace: not a regular file: {path}")
    try:
        trace = load_trace(path, args.format, skip_invalid=args.skip_invalid)
    except OSError as e:
        raise ValueError(f"--trace: cannot read {path}: {e.strerror or e}") from None
    if not trace.requests:
        raise ValueError(f"--trace: {path} holds no requests")
    results = simulate(trace.requests, names, caps)
    infinite = infinite_hit_rate(trace.requests)
    if args.json:
        rows = [
            {
                "policy": r.policy,
                "capacity_blocks": r.capacity_blocks,
                "hit_rate": round(r.hit_rate, 6),
                "evictions": r.evictions,
                "seconds": round(r.seconds, 4),
            }
            for r in results
        ]
        print(json.dumps({"results": rows, "infinite_hit_rate": round(infinite, 6)}))
        return 0
    print(
        f"{trace.path}: {len(trace.requests)} requests, {trace.format}, {results[0].total_blocks}"
        f" blocks of {trace.block_size} tokens, skipped {trace.skipped} lines"
    )
    print(f"{'policy':<14}{'capacity':>10}{'hit rate':>10}{'evictions':>11}{'seconds':>9}")
    for r in results:
        print(
            f"{r.policy:<14}{r.capacity_blocks:>10}{r.hit_rate:>10.3f}{r.evictions:>11}"
            f"{r.seconds:>9.2f}"
        )
    print(f"{'infinite':<14}{'':>10}{infinite:>10.3f}")
    return 0
