"""``kvroute loadgen``: replay a trace or a synthetic workload against an OpenAI-compatible
endpoint, then print the summary and write ``--json`` / ``--report`` outputs. Before the run the
workload is fitted to what the endpoint says of its model (``fit_to_endpoint``: token ids inside
its vocabulary, prompts inside its context), and says so in one line."""

from __future__ import annotations

import argparse
import json
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    from loadgen.prompts import DEFAULT_TOKEN_OFFSET, DEFAULT_VOCAB_SIZE

    t = p.add_argument_group("target")
    t.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    t.add_argument(
        "--model",
        help="model name (default: first of GET /v1/models, which also gives the context "
        "prompts are fitted to)",
    )
    t.add_argument(
        "--api", default="completions", help="completions (token-id prompts) | chat (text prompts)"
    )
    t.add_argument("--no-stream", action="store_true", help="plain JSON responses (no TTFT)")
    t.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos=true")
    t.add_argument("--extra-body", default="{}", help="JSON object merged into every body")
    t.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    t.add_argument(
        "--api-key",
        help="send 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY where set; '' for none)",
    )
    t.add_argument(
        "--header",
        action="append",
        metavar="'NAME: VALUE'",
        help="one more request header, on every request (repeatable)",
    )
    add_workload_arguments(p)
    w = p.add_argument_group("prompts (HTTP)")
    w.add_argument(
        "--sessions",
        default="recorded",
        help="recorded (prompts from hash ids) | live (each turn carries the real previous reply; "
        "text prompts)",
    )
    w.add_argument(
        "--vocab-size",
        type=int,
        help=f"synthesized token id range [{DEFAULT_VOCAB_SIZE}, fitted into the model's "
        "vocabulary where the endpoint states it]",
    )
    w.add_argument(
        "--token-offset",
        type=int,
        help="lowest synthesized token id (ids are offset..offset+vocab-size-1; keep them clear "
        f"of the model's special tokens and inside its vocabulary) [{DEFAULT_TOKEN_OFFSET}, "
        "likewise fitted]",
    )
    r = p.add_argument_group("runner")
    r.add_argument("--concurrency", type=int, help="closed loop with N workers")
    r.add_argument("--max-inflight", type=int, help="cap concurrent requests (open loop)")
    r.add_argument(
        "--max-connections", type=int, default=4096, help="HTTP connection pool size [4096]"
    )
    o = p.add_argument_group("output")
    o.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT SLO")
    o.add_argument("--slo-itl-ms", type=float, help="goodput: mean ITL SLO")
    o.add_argument("--json", dest="json_path", help="write summary + per-request records")
    o.add_argument("--report", help="directory for CSV files and PNG plots")
    o.add_argument("--no-progress", action="store_true", help="no live progress bar")


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


def _choice(value: str, flag: str, valid: tuple[str, ...]) -> str:
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
    _choice(args.arrival, "--arrival", ARRIVALS)
    _choice(args.format, "--format", ("auto", *FORMATS))
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


def run(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from loadgen.client import loop_factory
    from loadgen.endpoint import parse_headers, redacted_argv
    from loadgen.metrics import summarize
    from loadgen.report import print_summary, write_json, write_report
    from loadgen.runner import RunConfig, Runner
    from loadgen.workloads import ideal_hit_rate

    api = _choice(args.api, "--api", ("completions", "chat"))
    sessions = _choice(args.sessions, "--sessions", ("recorded", "live"))
    check_positives(
        args,
        "--timeout-s",
        "--slo-ttft-ms",
        "--slo-itl-ms",
        "--concurrency",
        "--max-inflight",
        "--vocab-size",
        "--max-connections",
    )
    if args.token_offset is not None and args.token_offset < 0:
        raise ValueError(f"--token-offset must be >= 0, got {args.token_offset}")
    api_key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")
    headers = parse_headers(args.header, api_key)
    try:
        extra = json.loads(args.extra_body)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body is not valid JSON: {e}") from None
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    if args.json_path and not Path(args.json_path).resolve().parent.is_dir():
        raise ValueError(f"--json: directory of {args.json_path} does not exist")
    if args.report:
        check_output_dir(args.report, "--report")
    plan, block_size, source = plan_workload(args)
    if not plan:
        raise ValueError("the workload has no requests (check --duration / --max-requests)")

    async def main() -> Any:
        nonlocal plan
        model, synth, plan = await fit_to_endpoint(args, api, sessions, headers, plan, block_size)
        config = RunConfig(
            args.url,
            model,
            synth,
            api=api,  # type: ignore[arg-type]
            stream=not args.no_stream,
            ignore_eos=not args.no_ignore_eos,
            timeout_s=args.timeout_s,
            max_inflight=args.max_inflight,
            concurrency=args.concurrency,
            max_connections=args.max_connections,
            sessions=sessions,  # type: ignore[arg-type]
            extra_body=extra,
            headers=headers,
        )
        runner = Runner(config, plan)
        if args.no_progress or not sys.stderr.isatty():
            return await runner.run()
        from loadgen.progress import show_progress

        stop = asyncio.Event()
        shown = asyncio.create_task(show_progress(runner.stats, stop))
        try:
            return await runner.run()
        finally:
            stop.set()
            await shown

    with asyncio.Runner(loop_factory=loop_factory()) as loop:
        result = loop.run(main())
    summary = summarize(
        result.records,
        duration_s=result.duration_s,
        requested_span_s=result.requested_span_s,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms,
        ideal_hit_rate=ideal_hit_rate((p.req for p in plan), block_size),
    )
    meta = {
        "source": source,
        "url": result.config.endpoint,
        "model": result.config.model,
        "api": api,
        "mode": result.mode,
        "sessions": sessions,
        "interrupted": result.interrupted,
        "argv": redacted_argv(sys.argv[1:]),
    }
    stopped = " - interrupted, partial results" if result.interrupted else ""
    print(f"loadgen: {source} -> {meta['url']} ({result.mode} loop){stopped}")
    print_summary(summary)
    if args.json_path:
        write_json(args.json_path, summary, result.records, meta)
    if args.report:
        write_report(args.report, summary, result.records, meta)
    return 0 if summary["completed"] else 1


async def fit_to_endpoint(
    args: argparse.Namespace,
    api: str,
    sessions: str,
    headers: dict[str, str],
    plan: list[Any],
    block_size: int,
) -> tuple[str, Any, list[Any]]:
    """The model to ask for, the prompt synthesizer and the plan, fitted to what the endpoint
    says of its model (``loadgen.endpoint``): token ids inside its vocabulary, every prompt and
    its ``max_tokens`` inside its context. Prints one line saying what was fitted, if anything,
    or why nothing could be."""
    import aiohttp

    from loadgen import endpoint as ep
    from loadgen.prompts import DEFAULT_TOKEN_OFFSET, DEFAULT_VOCAB_SIZE, PromptSynth

    timeout = min(args.timeout_s, 60.0)
    info, notice = await ep.discover(args.url, args.model, headers, timeout)
    vocab, offset = args.vocab_size, args.token_offset
    fitted: list[str] = []
    text = api == "chat" or sessions == "live"  # prompts whose lengths count words
    try:
        model_vocab = info.vocab_size
        if model_vocab is None and notice is None and api == "completions":
            top = (DEFAULT_TOKEN_OFFSET if offset is None else offset) - 1
            top += DEFAULT_VOCAB_SIZE if vocab is None else vocab
            await ep.probe_vocab(args.url, info.model, top, headers, timeout)
        if model_vocab is not None:
            vocab, offset, note = ep.fit_ids(
                vocab, offset, model_vocab, DEFAULT_VOCAB_SIZE, DEFAULT_TOKEN_OFFSET
            )
            if note:
                fitted.append(note)
        if info.max_model_len is not None:
            words = None
            if text:
                words = await ep.probe_words(args.url, info.model, api == "chat", headers, timeout)
            if text and words is None:
                notice = "the endpoint reports no usage.prompt_tokens: prompts are not fitted"
            else:
                fit = ep.fit_plan(plan, info.max_model_len, block_size, words)
                plan = fit.plan
                if fit.cut:
                    unit = f" (~{words[0]:.2g} tokens a word)" if words else ""
                    fitted.append(
                        f"{fit.cut} of {len(plan)} prompts cut to fit the context of "
                        f"{info.max_model_len} tokens{unit}"
                    )
                if fit.capped:
                    fitted.append(f"{fit.capped} max_tokens capped at {info.max_model_len // 4}")
    except (aiohttp.ClientError, TimeoutError) as e:
        notice = f"probing the endpoint failed ({e!r}): the workload is not fitted"
    if fitted:
        print(f"loadgen: fitted to {info.model}: {'; '.join(fitted)}", file=sys.stderr)
    if notice:
        print(f"loadgen: {notice}", file=sys.stderr)
    synth = PromptSynth(
        block_size,
        seed=args.seed,
        vocab_size=DEFAULT_VOCAB_SIZE if vocab is None else vocab,
        token_offset=DEFAULT_TOKEN_OFFSET if offset is None else offset,
    )
    return info.model, synth, plan
