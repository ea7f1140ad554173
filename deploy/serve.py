"""``kvroute serve``: the main job. Until the router lands (issue: router) it states the plan and
exits 0; it will start an embedded Ray, two sim engines and the ingress on 127.0.0.1:8000."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    print(
        "kvroute serve: the router is not built yet. When it is, this command starts an "
        "embedded Ray, two sim engines and the OpenAI-compatible ingress at "
        f"http://{args.host}:{args.port}/v1 ."
    )
    return 0
