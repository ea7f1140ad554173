"""Load generator benchmark: the highest open-loop rate one loadgen process sustains against the
local null server (a separate process) with send-lag p99 <= 5 ms, achieved send rate within 1% of
the requested rate, and every request completed without error, over ``--duration`` seconds
(default 30). Optionally runs NVIDIA's ``aiperf`` against the same server at the best rate.

    .venv/bin/python benchmarks/loadgen_bench.py --duration 30 \
        --aiperf /tmp/aiperf-venv/bin/aiperf

Prints one JSON object. Constant arrivals, completions API with token-id prompts of
``--input-tokens`` (default 64) and ``--output-tokens`` (default 8) streamed tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.metrics import event_rate, percentiles_ms, summarize
from loadgen.prompts import PromptSynth
from loadgen.runner import RunConfig, Runner
from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate
from loadgen.workloads import build_schedule

LAG_P99_MS = 5.0
RATE_TOLERANCE = 0.01


def start_server(cpu: int | None) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "loadgen.nullserver", "--port", "0", "--no-cache"]
    if cpu is not None and cpu >= 0 and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(cpu), *cmd]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1]
    )
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http://"):
        proc.kill()
        raise RuntimeError(f"null server did not start: {url!r}")
    return proc, url


def _stat_total() -> tuple[int, int]:
    """(all, idle + iowait) CPU ticks of the machine so far, from /proc/stat; (0, 0) without."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    return sum(vals), vals[3] + vals[4]


def cpu_busy(interval_s: float = 1.0) -> float:
    """Fraction of all CPUs busy over ``interval_s`` (from /proc/stat; 0 where unavailable)."""
    t1, i1 = _stat_total()
    time.sleep(interval_s)
    t2, i2 = _stat_total()
    return 1.0 - (i2 - i1) / (t2 - t1) if t2 > t1 else 0.0


def wait_quiet(args: argparse.Namespace) -> float:
    """Wait up to ``--wait-quiet-s`` for the machine to drop below ``--quiet-busy``; returns the
    last busy fraction seen (the machine is shared with other work)."""
    deadline = time.monotonic() + args.wait_quiet_s
    busy = cpu_busy()
    while busy > args.quiet_busy and time.monotonic() < deadline:
        busy = cpu_busy(2.0)
    return busy


def _ticks(pid: int | str) -> int:
    """CPU ticks (user + system) a process has used so far; 0 where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


class OtherLoad:
    """Share of all CPUs used by processes other than this one and the null server over a span:
    how much a run was disturbed by other work on the (shared) machine."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.start = (*_stat_total(), _ticks("self") + _ticks(server_pid))

    def fraction(self) -> float:
        total, idle, ours = (*_stat_total(), _ticks("self") + _ticks(self.server_pid))
        d_total = total - self.start[0]
        busy = d_total - (idle - self.start[1])
        return max(0.0, (busy - (ours - self.start[2])) / d_total) if d_total > 0 else 0.0


def run_rate(url: str, rate: float, duration_s: float, args: argparse.Namespace) -> dict[str, Any]:
    params = SynthParams(
        rate=rate,
        duration_s=duration_s,
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
        seed=int(rate),
    )
    plan = build_schedule(generate("random", params), rate=rate, arrival="constant")
    config = RunConfig(url, "null", PromptSynth(SYNTH_BLOCK_SIZE, seed=1))
    runner = Runner(config, plan)
    busy_before = wait_quiet(args)
    load_before = os.getloadavg()[0]
    other = OtherLoad(args.server_pid)
    result = runner.run_blocking()
    other_share = other.fraction()
    s = summarize(
        result.records, duration_s=result.duration_s, requested_span_s=result.requested_span_s
    )
    achieved = s["achieved_rate"] or 0.0
    ok = (
        s["send_lag_ms"]["p99"] is not None
        and s["send_lag_ms"]["p99"] <= LAG_P99_MS
        and abs(achieved - rate) <= RATE_TOLERANCE * rate
        and s["completed"] == s["requests"]
    )
    return {
        "rate": rate,
        "pass": ok,
        "achieved_rate": round(achieved, 2),
        "completed": s["completed"],
        "requests": s["requests"],
        "errors": s["errors"],
        "send_lag_ms": {k: s["send_lag_ms"][k] for k in ("p50", "p99", "max")},
        "ttft_ms": {k: s["ttft_ms"][k] for k in ("p50", "p99")},
        "duration_s": s["duration_s"],
        # NOTE: other work on the machine shows up as send lag; the 1-minute load average
        # before and after the run tells whether it was there.
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "cpu_busy_before": round(busy_before, 3),
        "other_processes_cpu_share": round(other_share, 3),
    }


def median_run(url: str, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    """``--repeat`` runs at one rate; the rate passes when the median run passes (the machine
    is shared: one noisy neighbour burst should not decide a figure)."""
    runs = []
    for _ in range(args.repeat):
        r = run_rate(url, rate, args.duration, args)
        print(json.dumps(r), file=sys.stderr, flush=True)
        runs.append(r)
    p99 = statistics.median(r["send_lag_ms"]["p99"] for r in runs)
    achieved = statistics.median(r["achieved_rate"] for r in runs)
    passed = sum(r["pass"] for r in runs)
    return {
        "rate": rate,
        "pass": passed * 2 > len(runs),
        "passed_runs": f"{passed}/{len(runs)}",
        "median_send_lag_p99_ms": p99,
        "median_achieved_rate": achieved,
        "runs": runs,
    }


def search(url: str, args: argparse.Namespace) -> tuple[float | None, list[dict[str, Any]]]:
    """Step up from ``--start`` by ``--step`` until a rate fails, then bisect ``--refine`` times."""
    results: list[dict[str, Any]] = []
    best: float | None = None
    rate = args.start
    failed: float | None = None
    while rate <= args.max_rate:
        r = median_run(url, rate, args)
        results.append(r)
        if not r["pass"]:
            failed = rate
            break
        best = rate
        rate = round(rate * args.step, -1) if args.step > 1 else rate + args.start
    lo, hi = best, failed
    for _ in range(args.refine if lo is not None and hi is not None else 0):
        assert lo is not None and hi is not None
        mid = round((lo + hi) / 2, -1)
        if mid in (lo, hi):
            break
        r = median_run(url, mid, args)
        results.append(r)
        lo, hi = (mid, hi) if r["pass"] else (lo, mid)
    return lo, results


def make_tokenizer(out: Path) -> None:
    """A tiny byte-level BPE tokenizer directory: aiperf needs one and cannot download here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from loadgen.prompts import WORDS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
    )
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    model = {"model_type": "gpt2", "vocab_size": 600, "bos_token_id": 0, "eos_token_id": 0}
    (out / "config.json").write_text(json.dumps(model))


def run_aiperf(aiperf: str, url: str, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    """aiperf against the same server, rate and request shape; its figures, or why it failed.

    Its send lag is taken from its per-request export as ``request_start_ns - credit_issued_ns``
    (credit = aiperf's own "send now" decision) and its achieved rate from the request starts,
    both computed as loadgen's own figures are (``percentiles_ms``, ``event_rate``).
    """
    if not Path(aiperf).exists():
        return {"status": "not installed", "path": aiperf}
    count = int(rate * (args.aiperf_duration or args.duration))
    with tempfile.TemporaryDirectory() as tmp:
        make_tokenizer(Path(tmp) / "tokenizer")
        cmd = [
            aiperf, "profile",
            "--model", "null",
            "--tokenizer", str(Path(tmp) / "tokenizer"),
            "--url", url,
            "--endpoint-type", "completions",
            "--streaming",
            "--request-rate", str(rate),
            "--request-count", str(count),
            "--synthetic-input-tokens-mean", str(args.input_tokens),
            "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(args.output_tokens),
            "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true",
            "--use-server-token-count",
            "--artifact-dir", str(Path(tmp) / "out"),
            *args.aiperf_arg,
        ]  # fmt: skip
        start = time.perf_counter()
        try:
            cpus = {int(c) for c in args.aiperf_cpus.split(",")} if args.aiperf_cpus else None
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=args.duration * 8 + 180,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
        except subprocess.TimeoutExpired:
            return {"status": "timed out", "cmd": " ".join(cmd)}
        wall = time.perf_counter() - start
        out: dict[str, Any] = {
            "cmd": " ".join(cmd),
            "rc": proc.returncode,
            "wall_s": round(wall, 2),
        }
        summary = Path(tmp) / "out" / "profile_export_aiperf.json"
        per_request = Path(tmp) / "out" / "profile_export.jsonl"
        if proc.returncode != 0 or not summary.exists():
            tail = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)[-1500:]
            out |= {"status": "failed", "output_tail": tail}
            return out
        data = json.loads(summary.read_text())
        starts: list[int] = []
        lags_s: list[float] = []
        errors = 0
        for line in per_request.read_text().splitlines():
            rec = json.loads(line)
            meta = rec["metadata"]
            starts.append(meta["request_start_ns"])
            lags_s.append((meta["request_start_ns"] - meta["credit_issued_ns"]) / 1e9)
            errors += rec.get("error") is not None
        achieved = event_rate(np.array(starts) / 1e9)
        lag = percentiles_ms(lags_s)
        out |= {
            "status": "ok",
            "requests": len(starts),
            "errors": errors,
            "achieved_send_rate": achieved and round(achieved, 2),
            "send_lag_ms": {"p50": lag["p50"], "p99": lag["p99"]},
            "request_throughput": data.get("request_throughput", {}).get("avg"),
            "ttft_ms": {k: data.get("time_to_first_token", {}).get(k) for k in ("p50", "p99")},
            "pass": bool(
                achieved
                and abs(achieved - rate) <= RATE_TOLERANCE * rate
                and (lag["p99"] or 0) <= LAG_P99_MS
                and errors == 0
            ),
        }
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--start", type=float, default=1000.0)
    p.add_argument("--step", type=float, default=1.0, help="factor; <= 1 adds --start instead")
    p.add_argument("--refine", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3, help="runs per rate (median decides)")
    p.add_argument("--max-rate", type=float, default=20_000.0)
    p.add_argument(
        "--wait-quiet-s", type=float, default=0.0, help="wait up to this long for a quiet machine"
    )
    p.add_argument("--quiet-busy", type=float, default=0.15, help="quiet = CPUs busy below this")
    p.add_argument("--rates", type=float, nargs="*", help="run exactly these rates, no search")
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--server-cpu", type=int, default=1, help="pin the null server (taskset)")
    p.add_argument("--client-cpu", type=int, default=0, help="pin this process (-1: no pin)")
    p.add_argument("--aiperf", default="", help="path to an aiperf executable")
    p.add_argument("--aiperf-duration", type=float, help="seconds of requests (default --duration)")
    p.add_argument("--aiperf-rate", type=float, help="rate for aiperf (default: best found)")
    p.add_argument(
        "--aiperf-cpus",
        default=None,
        help="CPUs for aiperf's processes, e.g. 0 or 0,1 (default: the client's CPU)",
    )
    p.add_argument("--aiperf-arg", action="append", default=[], help="extra aiperf argument")
    args = p.parse_args()
    if args.client_cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.client_cpu})
    proc, url = start_server(args.server_cpu)
    args.server_pid = proc.pid
    try:
        if args.rates:
            runs = [median_run(url, r, args) for r in args.rates]
            passed = [r["rate"] for r in runs if r["pass"]]
            best = max(passed) if passed else None
        else:
            best, runs = search(url, args)
        result: dict[str, Any] = {
            "benchmark": "loadgen_open_loop_max_rate",
            "criteria": {
                "send_lag_p99_ms": LAG_P99_MS,
                "achieved_rate_tolerance": RATE_TOLERANCE,
                "duration_s": args.duration,
                "all_completed": True,
            },
            "workload": {
                "api": "completions",
                "stream": True,
                "arrival": "constant",
                "input_tokens": args.input_tokens,
                "output_tokens": args.output_tokens,
            },
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "max_sustained_rate": best,
            "goal_rate": 2000,
            "runs": runs,
        }
        if args.aiperf:
            rate = args.aiperf_rate or best or args.start
            result["aiperf"] = run_aiperf(args.aiperf, url, rate, args)
            result["loadgen_at_aiperf_rate"] = next((r for r in runs if r["rate"] == rate), None)
        print(json.dumps(result, indent=1))
    finally:
        proc.terminate()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
