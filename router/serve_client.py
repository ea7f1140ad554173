"""The engine client the ingress uses under Ray Serve: the engine deployment's handle."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayError

from engines.base import EngineError, EngineOutput, RoutedRequest


class ServeEngineClient:
    """Streams ``generate`` through a ``DeploymentHandle``; the handle's request router (kvroute's
    ``KvRequestRouter``, or Ray's own router as a peer) delivers it to a replica."""

    def __init__(self, handle: Any) -> None:
        self._generate = handle.options(stream=True).generate

    async def stream(self, routed: RoutedRequest) -> AsyncIterator[EngineOutput]:
        try:
            async for out in self._generate.remote(routed):
                yield out
        except RayError as e:
            # Replica died, became unavailable or raised: the dispatcher decides on failover.
            raise EngineError(f"{type(e).__name__}: {e}") from e
