"""Do the router's session hints matter? CPU-tier hit rates with and without them. Prints JSON.

    .venv/bin/python benchmarks/hints_bench.py [--policies lru,lpc,prefix-odds] [--seeds 3]
                                               [--workload mix] [--router ray_prefix]
                                               [--rate 30] [--duration 25]
                                               [--gpu-blocks 160] [--cpu-blocks 320]

For each seed, policy and arm, a fresh ``LocalStack`` (two sim engines with a CPU tier run by
that policy, their KV events through real forwarders into the router's cache map, the router,
the OpenAI ingress) is served by uvicorn on a local port, and the open-loop HTTP runner replays
the same seeded multi-turn workload against ``/v1/chat/completions``. The two arms differ only
in ``IngressConfig.session_hints``: ``on`` sends the CPU-tier policy the category, turn and the
conversation ids the ingress derives (``session_id`` / ``parent_id``, see ``router/hints.py``);
``off`` sends category and turn only. The arm that runs first alternates with the seed.

Workload: the Bailian-shaped ``mix`` (``loadgen/synthetic.py``): half to-B API calls (type
``api``, single turn, Zipf-shared system prompts: never continued) and half to-C chats (type
``text``, geometric turns, mean 3: continued with p ~ 2/3), so the continuation odds depend on
the type, which is what LPC's history predictor learns per category. The runner sends live
sessions (each turn resends the history with the real previous reply, so the ingress can
derive the ids) and each request's type as ``kvroute_category``. Lengths are in the trace's
words; the tiny model's tokenizer makes ~4 tokens of a word. ~800 requests per run.
``--workload to-c-types``: to-C chats only, in three types with their own odds (``TYPES``:
``text`` 4 turns on average, ``search`` 1.25, ``file`` 1.5 with 4x longer messages), the
case LPC is built for: every reuse is a conversation's next turn, no prefix shared across them.

Placement: ``ray_prefix`` (default) places by the prompt text alone (Ray's prefix tree, not the
cache map, no load unless tied), so both arms get the same placements and any on - off
difference is the policy's. With ``--router kv_ttft`` placement follows load and the cache map
(CPU tier included), so it differs between runs: the hint-blind LRU then moves by ~0.02 between
arms, about the size of the effect measured.

Time: the sim engine in real-time mode gives the CPU-tier policy ``time.monotonic()`` seconds,
so the workload runs compressed ``k`` = 373 s / ``--think-time-s`` times (the to-C think time of
"KVCache Cache in the Wild" against ours), and so does everything else: the engines run the
H100 Llama-3.1-8B profile at ``time_scale`` 1/k (the router prices with the same scaled
profile), and LPC's decay is k/120 per second (its default 1/120 per trace second).
Prefix-odds learns its reuse times in the same clock; LRU has none.

Sizes: each engine has ``--gpu-blocks`` GPU blocks of 32 tokens (room for the running batch and
a second or two of finished prompts) and ``--cpu-blocks`` CPU-tier blocks: GPU + CPU together
hold about one think time of the new blocks an engine sees (~15 req/s x 3 s x ~9 blocks), so
the tier is full and evicting all run long (``cpu_evictions``: ~17-23 per request) and whether a
conversation's history is still there at its next turn depends on what the policy kept.

Per run: requests, errors, wall seconds; ``hit_rate`` (cached / prompt tokens, from the
responses' ``usage``) overall and per request type; from the engines:
``cpu_hit_per_prompt_token`` (tokens loaded from the CPU tier / prompt tokens) and
``cpu_hit_rate`` (tokens loaded from the CPU tier / prompt tokens that missed the GPU, i.e. the
CPU tier's own hit rate), CPU-tier evictions, and for LPC the continuation odds it learned per
category (``[p, requests]``, summed over engines).
Per policy: medians over seeds per arm and the median of the per-seed differences on - off.
LRU reads no hints: its on - off is the harness's own noise. Prefix-odds reads none either
(its classes are access count and prefix depth).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.local import LocalStack
from engines.profile import LatencyProfile
from engines.sim.engine import SimEngine
from engines.sim.options import SimEngineOptions
from engines.tiny_model import build_tiny_model
from loadgen.metrics import server_hit_rate
from loadgen.prompts import PromptSynth
from loadgen.records import RequestRecord
from loadgen.runner import RunConfig, Runner
from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate
from loadgen.traces import TraceRequest
from loadgen.workloads import Planned, build_schedule
from policies import create_policy
from policies.base import EvictionPolicy
from policies.lpc import HistoryPredictor, LPCPolicy
from router.settings import RouterSettings
from router.tokenizer import PromptTokenizer
from tests.support import Server, free_port

MODEL = "tiny-sim"
PROFILE = "h100-llama3.1-8b"
BS = 32
MAX_MODEL_LEN = 8192
INSTANCES = 2
BAILIAN_THINK_S = 600.0 / math.log(5.0)  # to-C think time in the wild (SynthParams default)
LPC_DECAY_PER_TRACE_S = 1.0 / 120.0  # LPCPolicy's default


# to-c-types: per type (share of requests, mean turns, median words of a new user message)
TYPES = {"text": (0.5, 4.0, 60), "search": (0.25, 1.25, 60), "file": (0.25, 1.5, 240)}


def workload(args: argparse.Namespace, seed: int) -> list[Planned]:
    params = SynthParams(
        rate=args.rate,
        duration_s=args.duration,
        seed=seed,
        turns_mean=3.0,
        think_time_s=args.think_time_s,
        user_tokens=60,
        output_tokens=24,
        length_sigma=0.5,
        programs=8,
        system_prompt_tokens=160,
        api_user_tokens=60,
        api_output_tokens=12,
        to_b_fraction=0.5,
        max_prompt_tokens=1500,  # words: ~6,000 tokens, under MAX_MODEL_LEN
    )
    if args.workload == "mix":
        return build_schedule(generate("mix", params))
    reqs: list[TraceRequest] = []
    hash_base = chat_base = 0
    for k, (kind, (share, turns, words)) in enumerate(TYPES.items()):
        sub = replace(params, rate=args.rate * share, seed=seed * 10 + k, turns_mean=turns)
        # NOTE: files make long chats; <= 1,000 words (~4,200 tokens) fit a 160-block GPU
        part = generate("to-c", replace(sub, user_tokens=words, max_prompt_tokens=1000))
        # NOTE: each type's ids moved to a range of their own (generate numbers from 0)
        reqs += [
            replace(
                r,
                type=kind,
                hash_ids=tuple(h + hash_base for h in r.hash_ids),
                chat_id=None if r.chat_id is None else r.chat_id + chat_base,
                parent_chat_id=None if r.parent_chat_id is None else r.parent_chat_id + chat_base,
            )
            for r in part
        ]
        hash_base += 1 + max((h for r in part for h in r.hash_ids), default=0)
        chat_base += 1 + max((r.chat_id or 0 for r in part), default=0)
    reqs.sort(key=lambda r: r.timestamp_s)
    return build_schedule(reqs)


def make_policy(name: str, cpu_blocks: int, compression: float) -> EvictionPolicy:
    if name == "lpc":
        return LPCPolicy(cpu_blocks, decay_per_s=LPC_DECAY_PER_TRACE_S * compression)
    return create_policy(name, cpu_blocks)


def learned_odds(engines: list[SimEngine]) -> dict[str, list[float]] | None:
    """LPC's history predictor, summed over the engines: ``{category: [p, requests seen]}``."""
    seen: Counter[str] = Counter()
    cont: Counter[str] = Counter()
    for e in engines:
        policy = e.blocks.cpu.policy if e.blocks.cpu is not None else None
        pred = getattr(policy, "predictor", None)
        if not isinstance(pred, HistoryPredictor):
            return None
        for cat, (n, k) in pred.counts().items():
            seen[cat] += n
            cont[cat] += k
    return {c: [round(cont.get(c, 0) / n, 3), n] for c, n in sorted(seen.items()) if n >= 10}


def _round(x: float | None) -> float | None:
    return round(x, 4) if x is not None else None


def run_once(
    policy: str,
    hints: bool,
    plan: list[Planned],
    seed: int,
    args: argparse.Namespace,
    tok: PromptTokenizer,
) -> dict[str, Any]:
    compression = BAILIAN_THINK_S / args.think_time_s
    time_scale = 1.0 / compression
    profile = LatencyProfile.load(PROFILE)
    engines = {
        f"sim-{i}": SimEngine(
            f"sim-{i}",
            profile,
            time_scale=time_scale,
            options=SimEngineOptions(
                block_size=BS,
                num_gpu_blocks=args.gpu_blocks,
                cpu_capacity_blocks=args.cpu_blocks,
                cpu_policy=make_policy(policy, args.cpu_blocks, compression),
                vocab_size=tok.vocab_size,
                token_offset=10,
                max_model_len=MAX_MODEL_LEN,
            ),
        )
        for i in range(INSTANCES)
    }
    stack = LocalStack(
        engines,
        model=MODEL,
        block_size=BS,
        max_model_len=MAX_MODEL_LEN,
        latency=profile.slowed(time_scale),
        tokenizer=tok,
        settings=RouterSettings(scorer=args.router),
        session_hints=hints,
    )
    t0 = time.perf_counter()
    with Server(stack, free_port()) as server:
        config = RunConfig(
            f"http://127.0.0.1:{server.port}",
            MODEL,
            PromptSynth(SYNTH_BLOCK_SIZE, seed=seed),
            api="chat",
            stream=False,
            sessions="live",
            send_category=True,
            timeout_s=60.0,
        )
        result = asyncio.run(Runner(config, plan).run())
    wall = time.perf_counter() - t0
    ok = [r for r in result.records if r.ok]
    errors = Counter(r.error or "unfinished" for r in result.records if not r.ok)
    by_type: dict[str, list[RequestRecord]] = {}
    for r in ok:
        by_type.setdefault(r.category.rsplit("_", 1)[0], []).append(r)
    eng = list(engines.values())
    scheds = [e.scheduler for e in eng]
    prompt_e = sum(s.prompt_tokens_admitted for s in scheds)
    cached_e = sum(s.cached_tokens_admitted for s in scheds)
    cpu_cached_e = sum(s.cpu_cached_tokens_admitted for s in scheds)
    gpu_missed = prompt_e - (cached_e - cpu_cached_e)
    return {
        "policy": policy,
        "hints": "on" if hints else "off",
        "seed": seed,
        "requests": len(result.records),
        "completed": len(ok),
        "errors": dict(errors),
        "wall_s": round(wall, 1),
        "hit_rate": _round(server_hit_rate(ok)),
        "hit_rate_by_type": {k: _round(server_hit_rate(rs)) for k, rs in sorted(by_type.items())},
        "cpu_hit_per_prompt_token": round(cpu_cached_e / max(prompt_e, 1), 4),
        "cpu_hit_rate": round(cpu_cached_e / max(gpu_missed, 1), 4),
        "engine_hit_rate": round(cached_e / max(prompt_e, 1), 4),
        "prompt_tokens": prompt_e,
        "cpu_evictions": sum(e.blocks.cpu.evictions for e in eng if e.blocks.cpu is not None),
        "requests_per_engine": sorted(s.requests_admitted for s in scheds),
        "lpc_learned_odds": learned_odds(eng) if policy == "lpc" else None,
    }


KEYS = ("hit_rate", "cpu_hit_per_prompt_token", "cpu_hit_rate")


def summarize(runs: list[dict[str, Any]], policies: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for policy in policies:
        arms = {
            arm: sorted(
                (r for r in runs if r["policy"] == policy and r["hints"] == arm),
                key=lambda r: r["seed"],
            )
            for arm in ("on", "off")
        }
        entry: dict[str, Any] = {}
        for arm, rs in arms.items():
            entry[f"median_{arm}"] = {k: statistics.median(r[k] for r in rs) for k in KEYS}
        entry["median_diff_on_minus_off"] = {
            k: round(
                statistics.median(
                    on[k] - off[k] for on, off in zip(arms["on"], arms["off"], strict=True)
                ),
                4,
            )
            for k in KEYS
        }
        entry["per_seed_diff_on_minus_off"] = {
            k: [round(on[k] - off[k], 4) for on, off in zip(arms["on"], arms["off"], strict=True)]
            for k in KEYS
        }
        out[policy] = entry
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default="lru,lpc,prefix-odds", help="comma-separated")
    ap.add_argument(
        "--workload", default="mix", choices=("mix", "to-c-types"), help="see the docstring"
    )
    ap.add_argument("--seeds", type=int, default=3, help="workload seeds (medians reported)")
    ap.add_argument("--rate", type=float, default=30.0, help="requests/s (wall clock)")
    ap.add_argument("--duration", type=float, default=25.0, help="seconds of schedule per run")
    ap.add_argument(
        "--think-time-s", type=float, default=3.0, help="to-C mean think time (wall clock)"
    )
    ap.add_argument(
        "--router",
        default="ray_prefix",
        help="placement scorer (ray_prefix: by prompt text alone, the same in both arms;"
        " kv_ttft: by load and the cache map)",
    )
    ap.add_argument("--gpu-blocks", type=int, default=160, help="GPU blocks per engine")
    ap.add_argument("--cpu-blocks", type=int, default=320, help="CPU-tier blocks per engine")
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {args.seeds}")
    policies = args.policies.split(",")
    tok = PromptTokenizer(build_tiny_model())
    runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for seed in range(args.seeds):
        plan = workload(args, seed)
        for policy in policies:
            # NOTE: the arm that runs first alternates with the seed (no order bias)
            for hints in (True, False) if seed % 2 == 0 else (False, True):
                res = run_once(policy, hints, plan, seed, args, tok)
                print(json.dumps(res), file=sys.stderr, flush=True)
                runs.append(res)
    print(
        json.dumps(
            {
                "profile": PROFILE,
                "compression": round(BAILIAN_THINK_S / args.think_time_s, 1),
                "args": vars(args),
                "requests_per_run": len(workload(args, 0)),
                "policies": summarize(runs, policies),
                "runs": runs,
                "total_wall_s": round(time.perf_counter() - t0, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
