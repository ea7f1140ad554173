"""An engine client over engines in this process (no Ray): single-process deployments, the
router-overhead benchmark, and HTTP-layer tests with real sim engines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from engines.base import (
    Engine,
    EngineError,
    EngineOutput,
    KvCommand,
    RoutedRequest,
    run_kv_command,
)


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

    async def command(self, command: KvCommand) -> dict[str, Any]:
        engine = self.engines.get(command.target_instance)
        if engine is None:
            raise EngineError(f"no engine instance {command.target_instance!r}")
        return await run_kv_command(engine, command.target_instance, command)

    def isolate(self) -> None:
        pass  # in-process calls share nothing
