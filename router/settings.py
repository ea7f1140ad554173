"""The router's configuration: one frozen record that holds the only defaults the router has.

A deployment builds it once from its serve file (``deploy.config.ServeConfig.router_settings``),
the cluster simulator from its settings (``simulation.settings.SimSettings.router_settings``),
and each passes it whole to the core (``RouterCore``), its thread-safe shell (``RouterState``)
and the simulator's wiring. The serve file's and the simulator's fields take their defaults
from ``DEFAULTS``, so a changed default, or a new setting, is written here once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engines.bus.liveness import STALE_AFTER_S
from router.admission import Admission
from router.pd import PdPlanner, TransferModel
from router.placement import Scorer, create_scorer


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """How one router places requests.

    ``scorer`` (with ``scorer_options``): the placement rule by registered name or
    ``module:Class`` (``router.placement.create_scorer``). ``block_size`` and
    ``kv_capacity_blocks``: the default pool's engines' (where the caller names no pools).
    ``slo_ttft_s``, ``max_in_flight``, ``max_queue``, ``max_wait_s``: admission
    (``router.admission``). ``stale_after_s``: an engine silent on the load bus this long is
    dropped. ``event_stride``: the engines' KV events keep every ``event_stride``-th block (the
    map's ``stride``). ``inflight_prompts``: a request's match also counts the prompts this
    router sent that no KV event shows yet, where more prefill waits than one engine step takes
    (``router.inflight``; on the routing suite it lowers the heavier load's TTFT on agentic,
    RAG-like and conversation traffic and leaves the lighter load's as it was).
    ``pd_max_local_prefill_tokens``: a prompt with at most this many uncached tokens is
    prefilled on its decode engine (Dynamo's ``max_local_prefill_length``);
    ``pd_overload_factor``: a split priced at more than this many times the colocated estimate
    runs colocated (None: a long prompt is always split). ``bus_poll_s``: a running
    ``RouterState`` reads the KV-event and load buses this often: what a KV event waits on the
    bus, at most, before it reaches the map (with the engines' ``PUBLISH_INTERVAL_S`` a block
    reaches the map at most ~150 ms after the engine stored it, which the cluster simulator
    prices at nothing measurable)."""

    scorer: str = "kv_ttft"
    scorer_options: Mapping[str, Any] = field(default_factory=dict)
    block_size: int = 16
    kv_capacity_blocks: int = 0
    slo_ttft_s: float | None = None
    max_in_flight: int = 1024
    max_queue: int = 1024
    max_wait_s: float = 30.0
    stale_after_s: float = STALE_AFTER_S
    event_stride: int = 1
    inflight_prompts: bool = True
    pd_max_local_prefill_tokens: int = 1000
    pd_overload_factor: float | None = 3.0
    bus_poll_s: float = 0.05

    def create_scorer(self) -> Scorer:
        return create_scorer(self.scorer, **self.scorer_options)

    def admission(self) -> Admission:
        return Admission(self.slo_ttft_s, self.max_in_flight, self.max_queue, self.max_wait_s)

    def pd_planner(self, transfer: TransferModel) -> PdPlanner:
        """The prefill/decode planner with these limits, handing KV over by ``transfer``."""
        return PdPlanner(transfer, self.pd_max_local_prefill_tokens, self.pd_overload_factor)


DEFAULTS = RouterSettings()
