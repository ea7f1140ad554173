"""The autoscaling core: what the router sees, every ``interval_s``, turned into a target replica
count per pool, with the reason.

Pure and clock-free like ``router.placement``'s scorers: no thread, no Ray, no wall clock, no
I/O. A caller (the cluster simulator in virtual time; later the Serve deployment's autoscaling
policy) hands ``Autoscaler.decide`` an ``Observation`` stamped with its own ``now`` and gets a
``Decision`` back. Policies keep state between calls (a forecaster's history, a delay's start),
all of it driven by the ``now`` they are handed, so a replay is deterministic.

Policies (``create_policy``; each is ``NAME`` or ``NAME@key=value+key=value``):

- ``static``: a fixed count (``n``; default: the pool's maximum), provisioning at the peak.
- ``ray_default``: Ray Serve's default policy (``ray.serve.autoscaling_policy``,
  ``replica_queue_length_autoscaling_policy`` with ``_apply_default_params``): desired =
  running replicas x (ongoing requests averaged over ``look_back_s``) / (running replicas x
  ``target_ongoing_requests``), then ``upscaling_factor``/``downscaling_factor`` on the delta,
  and a change only once it has been wanted in the same direction for ``upscale_delay_s`` (up)
  or ``downscale_delay_s`` (down). Ray's defaults: target 2, look-back 30 s, delays 30 s and
  600 s, factors 1. Ray runs its loop every 0.1 s; here it runs every ``interval_s``, so a delay
  ends at the first decision at or after it.
- ``throughput``: NVIDIA Dynamo's planner, throughput mode: the next interval's arrival rate
  (predicted from recent windows) over one replica's capacity at the SLO, from the profile
  (``replica_capacity``, prompts priced uncached as a profiled interpolation prices them), with
  ``headroom``.
- ``kvroute_reactive``: a profile-based capacity model with SLO feedback (no candidate sizes
  are simulated; the first pass's ``kvroute``). The capacity model prices the prompts'
  uncached tokens as the router placed them (its cache-map hits: KV-aware), forecasts the
  rate one cold start ahead (a new engine takes ``cold_start_s`` to serve), adds the
  replicas that the queued backlog needs to drain within the TTFT SLO, and multiplies by a
  gain that SLO feedback learns (raised while measured TTFT/TPOT attainment is under
  target, decayed back while it is met). Scale-down waits ``down_delay_s`` of consistently
  lower targets and steps by at most ``down_step`` of the pool at a time.
- ``kvroute``: model-predictive (``PredictivePolicy``): a forecast of the peak rate until a
  replica removed now could be back (trend, and the same time of the last cycles when the
  cycle is known), and the smallest pool whose simulation of that traffic meets the target
  (``Observation.what_if``, which the caller provides; the capacity model without one).
- ``SchedulePolicy`` (not a ``create_policy`` name): a schedule fixed in advance, the
  hindsight oracle's (``benchmarks/autoscale_suite.py`` finds it).
"""

from __future__ import annotations

from router.autoscale.forecast import (
    Forecaster,
    SeasonalForecaster,
)
from router.autoscale.model import (
    DEFAULT_COLD_START_S,
    DEFAULT_INTERVAL_S,
    Decision,
    EngineLoad,
    Observation,
    Policy,
    Slo,
    WhatIf,
    replica_capacity,
)
from router.autoscale.policies import (
    POLICIES,
    KvroutePolicy,
    PredictivePolicy,
    RayDefaultPolicy,
    SchedulePolicy,
    StaticPolicy,
    ThroughputPolicy,
    create_policy,
)
from router.autoscale.scaler import (
    Autoscaler,
)

__all__ = [
    "DEFAULT_COLD_START_S",
    "DEFAULT_INTERVAL_S",
    "POLICIES",
    "Autoscaler",
    "Decision",
    "EngineLoad",
    "Forecaster",
    "KvroutePolicy",
    "Observation",
    "Policy",
    "PredictivePolicy",
    "RayDefaultPolicy",
    "SchedulePolicy",
    "SeasonalForecaster",
    "Slo",
    "StaticPolicy",
    "ThroughputPolicy",
    "WhatIf",
    "create_policy",
    "replica_capacity",
]
