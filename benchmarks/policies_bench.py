"""Eviction-policy benchmark: prints one JSON object.

- ``hit_rates``: every registered policy x capacity on the shared Mooncake trace;
- ``eviction_overhead_us``: per ``evict(1)`` decision, amortised, at 100k resident blocks;
- ``simulator_lru_block_accesses_per_s``: replay throughput of LRU on the trace;
- ``wa_vs_lru``: hit rates on synthetic multi-turn Bailian-shaped workloads.

Run: ``.venv/bin/python benchmarks/policies_bench.py [--trace FILE] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import MOONCAKE_TRACE  # noqa: E402
from loadgen.synthetic import synthetic_bailian  # noqa: E402
from loadgen.traces import TraceRequest, load_trace  # noqa: E402
from policies import (  # noqa: E402
    EvictionPolicy,
    OfflinePolicy,
    RequestInfo,
    create_policy,
    get_policy_class,
    policy_names,
)
from simulation.cachesim import infinite_hit_rate, replay, simulate  # noqa: E402

CAPACITIES = [1000, 3000, 6000, 10000]


def hit_rate_table(trace: Path, reqs: list[TraceRequest]) -> dict[str, object]:
    rows = simulate(reqs, policy_names(), CAPACITIES)
    table = {
        name: {str(r.capacity_blocks): round(r.hit_rate, 4) for r in rows if r.policy == name}
        for name in policy_names()
    }
    return {"trace": str(trace), "infinite": round(infinite_hit_rate(reqs), 4), "table": table}


class _Workload:
    """Prompts of 32 blocks over 8 categories; every other prompt reuses an earlier head."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy, self.now, self.key = policy, 0.0, 0

    def store(self, blocks: int) -> None:
        policy = self.policy
        for _ in range(0, blocks, 32):
            self.now += 0.05
            turn = self.key // 32 % 8 + 1
            info = RequestInfo(category=f"text_{turn}", turn=turn)
            policy.begin_request(info, self.now)
            keys = list(range(self.key, self.key + 32))
            for off, k in enumerate(keys):
                policy.insert(k, self.now, k - 1 if off else None, off)
            head = range(self.key - 64, self.key - 48) if self.key % 64 == 0 else range(0)
            reused = [k for k in head if k in policy]
            policy.end_request(info, reused + keys, reused, self.now)
            self.key += 32


def eviction_overhead_us(resident: int = 100_000, decisions: int = 20_000) -> dict[str, float]:
    """Fill to ``resident`` blocks, then alternate batches of 1024 stores and 1024 single-block
    evictions (the cache stays at ``resident``); only the ``evict`` calls are timed."""
    out: dict[str, float] = {}
    for name in policy_names():
        if issubclass(get_policy_class(name), OfflinePolicy):
            continue  # oracles need a replayed future
        work = _Workload(create_policy(name, resident))
        work.store(resident)
        assert len(work.policy) == resident
        elapsed, done = 0.0, 0
        while done < decisions:
            work.store(1024)
            evict = work.policy.evict
            t0 = time.perf_counter()
            for _ in range(1024):
                evict(1)
            elapsed += time.perf_counter() - t0
            done += 1024
        out[name] = round(elapsed / done * 1e6, 2)
    return out


def simulator_throughput(reqs: list[TraceRequest], repeats: int = 3) -> float:
    best = 0.0
    for _ in range(repeats):
        r = replay(reqs, create_policy("lru", 6000))
        best = max(best, r.total_blocks / r.seconds)
    return round(best)


def wa_vs_lru(sessions: int, seeds: list[int], capacities: list[int]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for seed in seeds:
        reqs = synthetic_bailian(sessions=sessions, seed=seed)
        for cap in capacities:
            row: dict[str, object] = {"sessions": sessions, "seed": seed, "capacity_blocks": cap}
            for name in ("lru", "s3-fifo", "wa", "lpc", "prefix-reuse", "prefix-odds", "belady"):
                row[name] = round(replay(reqs, create_policy(name, cap)).hit_rate, 4)
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=MOONCAKE_TRACE)
    parser.add_argument("--quick", action="store_true", help="fewer workloads and decisions")
    args = parser.parse_args()
    reqs = load_trace(args.trace).requests
    result = {
        "hit_rates": hit_rate_table(args.trace, reqs),
        "eviction_overhead_us": eviction_overhead_us(decisions=4096 if args.quick else 20_000),
        "simulator_lru_block_accesses_per_s": simulator_throughput(reqs),
        "wa_vs_lru": wa_vs_lru(600, [0] if args.quick else [0, 1, 2], [1000, 2000, 4000]),
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
