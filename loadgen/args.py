"""The workload flags ``kvroute loadgen``, ``simulate`` and ``plan`` share, and what they
describe: ``add_workload_arguments`` adds them, ``plan_workload`` builds the schedule they name
(a trace re-timed, or a synthetic workload); and the checks those commands make of their flags
(``check_positive``, ``check_choice``, ``check_output_dir``), each raising ``ValueError`` naming
the flag."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

_SYNTH_FLAGS: dict[str, tuple[str, type, str]] = {
    # flag: (SynthParams field, type, help)
    "--turns-mean": ("turns_mean", float, "to-c: mean turns per session (geometric)"),
    "--think-time-s": ("think_time_s", float, "to-c: mean think time between turns (exp.)"),
    "--user-tokens": ("user_tokens", int, "to-c: median tokens of a new user message"),
    "--output-tokens": ("output_tokens", int, "to-c/random: median (random: exact) reply tokens"),
    "--length-sigma": ("length_sigma", float, "log-normal sigma of message lengths"),
    "--programs": ("programs", int, "to-b: API programs, each with its own system prompt"),
    "--zipf": ("zipf_s", float, "to-b: Zipf exponent of program popularity"),
    "--system-prompt-tokens": ("system_prompt_tokens", int, "to-b: median system prompt"),
    "--api-user-tokens": ("api_user_tokens", int, "to-b: median user part"),
    "--api-output-tokens": ("api_output_tokens", int, "to-b: median reply tokens"),
    "--to-b-fraction": ("to_b_fraction", float, "mix: fraction of requests from to-b"),
    "--input-tokens": ("input_tokens", int, "random: prompt tokens"),
    "--agent-prefixes": ("agent_prefixes", int, "agentic: distinct tool/system prefixes"),
    "--agent-prefix-tokens": ("agent_prefix_tokens", int, "agentic: median prefix tokens"),
    "--agent-prefix-zipf": ("agent_prefix_zipf", float, "agentic: Zipf exponent of prefixes"),
    "--agent-task-tokens": ("agent_task_tokens", int, "agentic: median task (first message)"),
    "--agent-steps-mean": ("agent_steps_mean", float, "agentic: mean steps per session"),
    "--agent-step-s": ("agent_step_s", float, "agentic: mean seconds between steps (exp.)"),
    "--agent-output-tokens": ("agent_output_tokens", int, "agentic: median reply (tool call)"),
    "--agent-result-tokens": ("agent_result_tokens", int, "agentic: median tool result"),
    "--agent-subtask-tokens": ("agent_subtask_tokens", int, "agentic: median parallel call"),
    "--agent-fanout-prob": ("agent_fanout_prob", float, "agentic: share of steps that fan out"),
    "--agent-fanout-max": ("agent_fanout_max", int, "agentic: most parallel calls in a burst"),
    "--rag-documents": ("rag_documents", int, "rag: corpus size"),
    "--rag-zipf": ("rag_zipf", float, "rag: Zipf exponent of document popularity"),
    "--rag-doc-tokens": ("rag_doc_tokens", int, "rag: median document tokens"),
    "--rag-doc-min-tokens": ("rag_doc_min_tokens", int, "rag: shortest document"),
    "--rag-doc-max-tokens": ("rag_doc_max_tokens", int, "rag: longest document"),
    "--rag-docs-max": ("rag_docs_max", int, "rag: most documents per request"),
    "--rag-system-tokens": ("rag_system_tokens", int, "rag: the system prompt's tokens"),
    "--rag-question-tokens": ("rag_question_tokens", int, "rag: median question tokens"),
    "--rag-output-tokens": ("rag_output_tokens", int, "rag: median answer tokens"),
}


def add_workload_arguments(p: argparse.ArgumentParser, rate_scale_list: bool = False) -> None:
    """The workload flags ``kvroute loadgen``, ``simulate`` and ``plan`` share
    (``plan_workload`` reads them), so a simulated run replays exactly the schedule an HTTP run
    would send. ``rate_scale_list``: ``--rate-scale`` takes a comma-separated list (the
    caller reads it and clears it before ``plan_workload``)."""
    from loadgen.synthetic import SynthParams

    defaults = {f.name: f.default for f in fields(SynthParams)}
    w = p.add_argument_group("workload")
    w.add_argument(
        "--trace",
        help="trace file: JSONL (Mooncake, Bailian) or CSV (Azure LLM 2023, BurstGPT; their "
        "prefixes drawn from a seeded model, loadgen.traces.PrefixModel)",
    )
    w.add_argument("--format", default="auto", help="auto | mooncake | bailian | azure | burstgpt")
    w.add_argument("--skip-invalid", action="store_true", help="count and skip bad trace lines")
    w.add_argument("--workload", help="synthetic: to-c | to-b | mix | random | agentic | rag")
    w.add_argument("--time-scale", type=float, default=None, help="multiply trace gaps (0.5 = 2x)")
    w.add_argument(
        "--rate-scale",
        type=str if rate_scale_list else float,
        default=None,
        metavar="S[,S...]" if rate_scale_list else "S",
        help="multiply the trace's rate (= --time-scale 1/X)"
        + ("; a list plans each scale" if rate_scale_list else ""),
    )
    w.add_argument(
        "--rate", type=float, help="req/s: replaces trace timing; synthetic workload rate [5]"
    )
    w.add_argument("--arrival", default="poisson", help="poisson | constant (with --rate)")
    w.add_argument(
        "--duration", type=float, help="seconds of schedule to send (synthetic default 60)"
    )
    w.add_argument("--max-requests", type=int, help="send at most this many requests")
    w.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals")
    s = p.add_argument_group("synthetic workload parameters")
    for flag, (name, typ, help_text) in _SYNTH_FLAGS.items():
        default = defaults[name]
        shown = f"{default:.4g}" if isinstance(default, float) else default
        s.add_argument(
            flag,
            dest=f"synth_{name}",
            type=typ,
            default=None,
            metavar="N" if typ is int else "X",
            help=f"{help_text} [{shown}]",
        )


def check_output_dir(path: str, flag: str = "--report") -> Path:
    """Create directory ``path`` (and its parents) and check a file can be written in it, so a
    run whose outputs could not be saved fails before it starts. Raises ``ValueError`` naming
    ``flag``."""
    import tempfile

    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag}: {path} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(f"{flag}: cannot write to directory {path}: {e.strerror or e}") from None
    return out


def check_choice(value: str, flag: str, valid: tuple[str, ...]) -> str:
    """``value``, if it is one of ``valid``; raises ``ValueError`` naming ``flag`` otherwise."""
    if value not in valid:
        raise ValueError(f"{flag} must be one of {', '.join(valid)}; got {value!r}")
    return value


def check_positive(value: float | None, flag: str) -> None:
    """Raises ``ValueError`` naming ``flag`` unless ``value`` is None or a finite number > 0."""
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{flag} must be > 0, got {value}")


def check_positives(args: argparse.Namespace, *flags: str) -> None:
    """``check_positive`` for each of ``flags``, read from ``args`` under the name argparse gives
    it (``--timeout-s``: ``args.timeout_s``); raises naming the first that is not."""
    for flag in flags:
        check_positive(getattr(args, flag.removeprefix("--").replace("-", "_")), flag)


def _time_scale(args: argparse.Namespace) -> float:
    if args.time_scale is not None and args.rate_scale is not None:
        raise ValueError("give --time-scale or --rate-scale, not both")
    rate_scale: float | None = args.rate_scale
    time_scale: float | None = args.time_scale
    if rate_scale is not None:
        check_positive(rate_scale, "--rate-scale")
        return 1.0 / rate_scale
    return 1.0 if time_scale is None else time_scale


def plan_workload(args: argparse.Namespace) -> tuple[list[Any], int, str]:
    """The schedule the workload flags describe: ``(plan, block size of its hash ids, source)``.
    Raises ``ValueError`` naming the flag (or the trace file and line) that is wrong."""
    from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate
    from loadgen.traces import FORMATS, PrefixModel, load_trace
    from loadgen.workloads import ARRIVALS, build_schedule

    if (args.trace is None) == (args.workload is None):
        raise ValueError("give exactly one of --trace FILE or --workload NAME")
    check_choice(args.arrival, "--arrival", ARRIVALS)
    check_choice(args.format, "--format", ("auto", *FORMATS))
    time_scale = _time_scale(args)
    if args.trace is not None:
        try:
            # a CSV trace's prefixes are drawn with the workload's seed
            trace = load_trace(
                args.trace, args.format, args.skip_invalid, PrefixModel(seed=args.seed)
            )
        except OSError as e:
            raise ValueError(f"--trace: cannot read {args.trace}: {e.strerror}") from None
        if trace.skipped:
            print(f"loadgen: skipped {trace.skipped} invalid trace lines", file=sys.stderr)
        plan = build_schedule(
            trace.requests,
            time_scale=time_scale,
            rate=args.rate,
            arrival=args.arrival,
            duration_s=args.duration,
            max_requests=args.max_requests,
            seed=args.seed,
        )
        return plan, trace.block_size, f"trace {args.trace} ({trace.format})"
    params = SynthParams(seed=args.seed, max_requests=args.max_requests)
    if args.rate is not None:
        params.rate = args.rate
    if args.duration is not None:
        params.duration_s = args.duration
    for name, _typ, _help in _SYNTH_FLAGS.values():
        value = getattr(args, f"synth_{name}")
        if value is not None:
            setattr(params, name, value)
    reqs = generate(args.workload, params)
    rate = params.rate if args.workload == "random" else None
    plan = build_schedule(
        reqs, time_scale=time_scale, rate=rate, arrival=args.arrival, seed=args.seed
    )
    return plan, SYNTH_BLOCK_SIZE, f"synthetic {args.workload}"
