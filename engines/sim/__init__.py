"""The sim engine: vLLM-like paged KV blocks, prefix caching and continuous batching without a
model, timed by a latency profile (``engines.profile``). Real time (``SimEngine``, asyncio) or
virtual time (``VirtualInstance``, discrete events; ``simulation.cluster`` runs a cluster of
them)."""

from engines.sim.blocks import KVBlockManager
from engines.sim.options import SimEngineOptions
from engines.sim.request import SimRequest, make_request
from engines.sim.scheduler import Scheduler, SchedulerConfig
from engines.sim.virtual import VirtualInstance, expand_trace_hashes, trace_arrival

__all__ = [
    "KVBlockManager",
    "Scheduler",
    "SchedulerConfig",
    "SimEngine",
    "SimEngineOptions",
    "SimRequest",
    "VirtualInstance",
    "expand_trace_hashes",
    "make_request",
    "trace_arrival",
]


def __getattr__(name: str) -> object:
    # NOTE: the real-time engine needs pyzmq; virtual time (capacity planning) does not.
    if name == "SimEngine":
        from engines.sim.engine import SimEngine

        return SimEngine
    raise AttributeError(f"module 'engines.sim' has no attribute {name!r}")
