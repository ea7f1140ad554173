"""Engines: the engine protocol (``engines.base``), the model-free sim engine (``engines.sim``,
real time and virtual time), the vLLM engine (``engines.vllm_engine``), the KV-event forwarder,
the Ray and Redis event-bus backends, liveness, and the Ray Serve deployment hosting either
engine (``engines.deployment``)."""

from engines.base import (
    Engine,
    EngineError,
    EngineOutput,
    EngineRequest,
    LoadSnapshot,
    RoutedRequest,
    SamplingParams,
    Usage,
)

__all__ = [
    "Engine",
    "EngineError",
    "EngineOutput",
    "EngineRequest",
    "LoadSnapshot",
    "RoutedRequest",
    "SamplingParams",
    "Usage",
]
