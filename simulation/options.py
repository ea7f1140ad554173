"""The flags ``kvroute simulate`` and ``kvroute plan`` share, and what they describe: the
engines (``--profile``, ``--engine``, ...), their truth and the router's lag, ``--jobs``, the
``--router`` scorer specs, and the ``simulation.settings.SimSettings`` they build; the
comma-separated lists ``plan`` takes (``parse_floats``, ``parse_tiers``)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from engines.base import REPORT_INTERVAL_S
from loadgen.args import check_positive
from simulation.jobs import DEFAULT_JOBS


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def add_jobs_argument(g: argparse._ArgumentGroup, what: str = "simulations") -> None:
    """``--jobs``: how many simulations run at once, each in a forked process."""
    g.add_argument(
        "--jobs",
        type=int,
        default=DEFAULT_JOBS,
        help=f"{what} simulated at once, one forked process each [min(2, cores)]",
    )


def add_output_arguments(o: argparse._ArgumentGroup, result: str, report: str) -> None:
    """``--json`` (print the ``result`` as JSON), ``--report`` (a directory for ``report``) and
    ``--no-progress``."""
    o.add_argument("--json", action="store_true", help=f"print the {result} as JSON")
    o.add_argument("--report", help=f"directory for {report}")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_engine_arguments(c: argparse._ArgumentGroup) -> None:
    """The engines' flags ``simulate`` and ``plan`` share (``sim_settings`` reads them)."""
    from simulation.settings import ENGINE_OPTIONS, SimSettings

    sim = SimSettings()  # the defaults
    c.add_argument(
        "--profile", default="h100-llama3.1-8b", help="engines' latency profile (name or JSON)"
    )
    c.add_argument(
        "--router-profile", help="the profile the router prices with [same name, loaded apart]"
    )
    c.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"engine option for every instance ({', '.join(ENGINE_OPTIONS)})",
    )
    c.add_argument("--block-size", type=int, help="engine block size [the workload's]")
    c.add_argument(
        "--event-stride",
        type=int,
        default=sim.event_stride,
        help="the engines' KV events (and the router's map) keep every K-th block only "
        f"[{sim.event_stride}]",
    )
    c.add_argument(
        "--inflight-prompts",
        action=argparse.BooleanOptionalAction,
        default=sim.inflight_prompts,
        help="the router counts the prompts it sent that no KV event shows yet as cached where "
        "it sent them, on engines where more prefill waits than one step computes "
        "(router.inflight; on by default)",
    )
    c.add_argument(
        "--router-replicas",
        type=int,
        default=sim.router_replicas,
        help="router replicas, each its own map, ledger and scorer on the same buses, arrivals "
        "spread over them in turn, as Serve's proxy spreads them over ingress replicas "
        f"[{sim.router_replicas}]",
    )
    c.add_argument(
        "--share-assignments",
        action=argparse.BooleanOptionalAction,
        default=sim.share_assignments,
        help="router replicas share their assignments, each reaching the others after the "
        "event lag, so that they do not herd onto what each sees as an idle engine "
        f"[{_on(sim.share_assignments)}]",
    )
    add_pool_arguments(c)


# the ``SimSettings`` fields ``add_pool_arguments``' flags set, by the same names
POOL_FLAGS = ("pool_gib", "pool_gbps", "pool_latency_ms", "pool_policy", "pool_in_map")


def add_pool_arguments(c: argparse._ArgumentGroup) -> None:
    """The cluster KV pool's flags (``engines.sim.pool``; off by default)."""
    from simulation.settings import SimSettings

    sim = SimSettings()  # the defaults
    c.add_argument(
        "--pool-gib",
        type=float,
        default=sim.pool_gib,
        help="a KV pool of this many GiB in all, shared by every engine: each stores the "
        "prompt blocks it computes and loads the further leading blocks of a prompt it finds "
        "there (engines.sim.pool) [0: no pool]",
    )
    c.add_argument(
        "--pool-gbps",
        type=float,
        default=sim.pool_gbps,
        help=f"each engine's link to the pool, GB/s [{sim.pool_gbps:g}]",
    )
    c.add_argument(
        "--pool-latency-ms",
        type=float,
        default=sim.pool_latency_ms,
        help=f"the pool's latency per load, ms [{sim.pool_latency_ms:g}]",
    )
    c.add_argument(
        "--pool-policy",
        default=sim.pool_policy,
        help=f"the pool's eviction policy (policies/) [{sim.pool_policy}]",
    )
    c.add_argument(
        "--pool-in-map",
        action=argparse.BooleanOptionalAction,
        default=sim.pool_in_map,
        help="the pool announces what it holds on the KV bus (the cache map's pool tier) and "
        "the router prices loads from it against recompute; off: the engines still use the "
        f"pool, unseen by the router [{_on(sim.pool_in_map)}]",
    )


def add_truth_arguments(p: argparse.ArgumentParser) -> None:
    """How the simulated engines depart from their profile, and the router's lag."""
    from simulation.settings import Perturbation, SimSettings

    sim, truth = SimSettings(), Perturbation()  # the defaults
    t = p.add_argument_group("truth and lag")
    flags = (
        ("--speed-sigma", truth.speed_sigma, "per-engine speed spread"),
        ("--jitter", truth.jitter, "per-step time jitter sigma"),
        ("--stragglers", truth.stragglers, "fraction of slow engines"),
        ("--straggler-slowdown", truth.straggler_slowdown, "their slowdown"),
        ("--lag-ms", sim.event_lag_s * 1e3, "KV event and load sample lag"),
    )
    for flag, default, what in flags:
        t.add_argument(flag, type=float, default=default, help=f"{what} [{default:g}]")
    t.add_argument(
        "--load-interval-ms",
        type=float,
        default=sim.load_interval_s * 1e3,
        help="each engine's load sample interval; an engine that reports every step, as "
        f"kvroute's vLLM engine does, is sampled at most every {REPORT_INTERVAL_S * 1e3:g} "
        f"[{sim.load_interval_s * 1e3:g}]",
    )


def sim_settings(args: argparse.Namespace, instances: int, slo_ttft_s: float | None = None) -> Any:
    """The ``SimSettings`` the engine and truth flags describe (validated: raises naming the
    flag)."""
    from router.placement import parse_options
    from simulation.settings import Perturbation, SimSettings

    check_positive(args.block_size, "--block-size")
    settings = SimSettings(
        instances=instances,
        block_size=args.block_size,
        engine=parse_options(args.engine, "--engine"),
        perturbation=Perturbation(
            args.speed_sigma, args.jitter, args.stragglers, args.straggler_slowdown, args.seed
        ),
        event_lag_s=args.lag_ms / 1e3,
        load_lag_s=args.lag_ms / 1e3,
        load_interval_s=args.load_interval_ms / 1e3,
        slo_ttft_s=slo_ttft_s,
        prefill_instances=getattr(args, "prefill_instances", 0),
        event_stride=args.event_stride,
        inflight_prompts=args.inflight_prompts,
        router_replicas=getattr(args, "router_replicas", 1),
        share_assignments=getattr(args, "share_assignments", True),
        **{k: getattr(args, k) for k in POOL_FLAGS if hasattr(args, k)},
    )
    if settings.prefill_instances:
        local = args.pd_max_local_prefill_tokens
        if local < 0:
            raise ValueError(f"--pd-max-local-prefill-tokens must be >= 0, got {local}")
        factor = args.pd_overload_factor
        if factor and factor < 1:
            raise ValueError(f"--pd-overload-factor must be 0 or >= 1, got {factor}")
        settings.pd_max_local_prefill_tokens = local
        settings.pd_overload_factor = factor or None
    settings.validate()
    return settings


def perturbation_meta(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "speed_sigma": args.speed_sigma,
        "jitter": args.jitter,
        "stragglers": args.stragglers,
        "straggler_slowdown": args.straggler_slowdown,
        "seed": args.seed,
    }


def parse_router(spec: str) -> tuple[str, dict[str, Any]]:
    """One scorer spec, ``NAME`` or ``NAME@key=value+key=value``: ``(name, options)``."""
    from router.placement import parse_spec

    return parse_spec(spec, "--router")


def parse_routers(spec: str) -> list[tuple[str, str, dict[str, Any]]]:
    """``--router`` as ``(label, scorer name, options)``; raises naming the bad entry."""
    from router.placement import create_scorer

    out = []
    for label in filter(None, (x.strip() for x in spec.split(","))):
        name, options = parse_router(label)
        try:
            create_scorer(name, **options)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--router {label}: {e}") from None
        out.append((label, name, options))
    if not out:
        raise ValueError("--router: give at least one scorer")
    return out


def load_profile(name: str, flag: str) -> Any:
    from engines.profile import LatencyProfile

    try:
        return LatencyProfile.load(name)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{flag}: cannot load profile {name!r}: {e}") from None


def parse_floats(raw: str, flag: str, ok: Callable[[float], bool], rule: str) -> list[float]:
    """The comma-separated numbers of ``flag``'s ``raw`` value, distinct and sorted. Raises
    naming the flag for an item that is not a number, one ``ok`` refuses (``rule`` says what
    they must be), or no item at all."""
    out: list[float] = []
    for item in filter(None, (x.strip() for x in raw.split(","))):
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"{flag}: {item!r} is not a number") from None
        if not ok(value):
            raise ValueError(f"{flag}: values must be {rule}, got {item}")
        out.append(value)
    if not out:
        raise ValueError(f"{flag}: give at least one value")
    return sorted(set(out))


def parse_tiers(gib_list: str, policies: str) -> list[tuple[float, str]]:
    """``--cpu-tier-gib`` x ``--policy`` as ``(GiB, policy)`` pairs; a 0 GiB tier has no
    policy. Raises naming the flag."""
    from policies import policy_names
    from simulation.pricing import NO_TIER

    sizes = parse_floats(
        gib_list, "--cpu-tier-gib", lambda g: g >= 0 and math.isfinite(g), ">= 0 (0: no CPU tier)"
    )
    names = [x.strip() for x in policies.split(",") if x.strip()]
    known = policy_names()
    for name in names:
        if name not in known:
            raise ValueError(f"--policy: unknown policy {name!r}; known: {', '.join(known)}")
    if not names and any(sizes):
        raise ValueError("--policy: give at least one eviction policy for the CPU tier")
    out: list[tuple[float, str]] = []
    for gib in sizes:
        out += [(gib, NO_TIER)] if gib == 0 else [(gib, name) for name in names]
    return out
