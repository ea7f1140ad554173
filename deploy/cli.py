"""The ``kvroute`` command line. Each subcommand lives in its own module in ``deploy.commands``,
registered below by module path; a module provides ``add_arguments(parser)`` and ``run(args) ->
int`` and keeps heavy imports inside ``run`` so ``kvroute --help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

from deploy.native import warn_if_stale

# name: (module path, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("deploy.commands.serve", "run the OpenAI-compatible endpoint with its engines"),
    "loadgen": (
        "deploy.commands.loadgen",
        "replay traces or synthetic workloads against an OpenAI-compatible endpoint",
    ),
    "profile": (
        "deploy.commands.profile",
        "measure a real engine and write a latency profile for the sim engine",
    ),
    "simulate": (
        "deploy.commands.simulate",
        "replay a workload on a virtual cluster placed by the real router core, per router",
    ),
    "plan": (
        "deploy.commands.plan",
        "size a cluster for a workload and SLO (engines, CPU tier, policy) in the simulator",
    ),
    "cachesim": (
        "deploy.commands.cachesim",
        "replay a trace through eviction policies and report hit rates",
    ),
}


def version() -> str:
    """The installed distribution's version (pyproject.toml's), or "unknown" when the tree runs
    uninstalled."""
    try:
        return importlib.metadata.version("kvroute")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute", description="KV-cache-aware router and scheduler for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"kvroute {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    warn_if_stale()
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except ValueError as e:
        # Bad input or config: a message naming the field, never a traceback.
        print(f"kvroute {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
