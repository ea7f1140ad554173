"""An engine client over engines in this process (no Ray): single-process deployments, the
router-overhead benchmark, and HTTP-layer tests with real sim engines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from engines.base import Engine, EngineError, EngineOutput, RoutedRequest


class LocalEngineClient:
    def __init__(self, engines: Mapping[str, Engine]) -> None:
        if not engines:
            raise ValueError("engines: at least one engine is required")
        self.engines = dict(engines)

    async def stream(self, routed: RoutedRequest) -> AsyncIterator[EngineOutput]:
        target = routed.target_instance or next(iter(self.engines))
        engine = self.engines.get(target)
        if engine is None:
            raise EngineError(f"no engine instance {target!r}")
        async for out in engine.generate(routed.request):
            yield out
