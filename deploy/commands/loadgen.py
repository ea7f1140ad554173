"""``kvroute loadgen``: replay a trace or a synthetic workload against an OpenAI-compatible
endpoint, then print the summary and write ``--json`` / ``--report`` outputs. Before the run the
workload is fitted to what the endpoint says of its model (``fit_to_endpoint``: token ids inside
its vocabulary, prompts inside its context), and says so in one line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from loadgen.args import (
    add_workload_arguments,
    check_choice,
    check_output_dir,
    check_positives,
    plan_workload,
)


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


def run(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from loadgen.client import loop_factory
    from loadgen.endpoint import parse_headers, redacted_argv
    from loadgen.metrics import summarize
    from loadgen.report import print_summary, write_json, write_report
    from loadgen.runner import RunConfig, Runner
    from loadgen.workloads import ideal_hit_rate

    api = check_choice(args.api, "--api", ("completions", "chat"))
    sessions = check_choice(args.sessions, "--sessions", ("recorded", "live"))
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
