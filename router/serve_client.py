"""The engine client the ingress uses under Ray Serve: the engine deployment's handle."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from ray.exceptions import RayError
from ray.serve._private.utils import generate_request_id
from ray.serve.context import _set_request_context

from engines.base import EngineError, EngineOutput, KvCommand, RoutedRequest


class _PoolHandle:
    def __init__(self, handle: Any) -> None:
        self.generate = handle.options(stream=True).generate
        self.whole = handle.generate_whole
        self.command = handle.kv_command


class ServeEngineClient:
    """Streams ``generate`` through a ``DeploymentHandle``; the handle's request router (kvroute's
    ``KvRequestRouter``, or Ray's own router as a peer) delivers it to a replica.

    Several engine pools: ``handle`` maps each pool's name to its deployment's handle, and
    ``pool_of`` names the pool of a target instance (None or unknown: the first pool)."""

    def __init__(self, handle: Any, pool_of: Callable[[str | None], str] | None = None) -> None:
        handles = dict(handle) if isinstance(handle, Mapping) else {"": handle}
        self._pools = {name: _PoolHandle(h) for name, h in handles.items()}
        self._default = next(iter(self._pools.values()))
        self._pool_of = pool_of

    def _handle(self, instance: str | None) -> _PoolHandle:
        if self._pool_of is None or len(self._pools) == 1:
            return self._default
        return self._pools.get(self._pool_of(instance), self._default)

    async def stream(self, routed: RoutedRequest) -> AsyncIterator[EngineOutput]:
        """Outputs of ``routed``; closed early (a stop string, a client gone), it cancels the
        call, which aborts the request in the replica. A request nobody streams is one unary
        call answered whole (``generate_whole``): Serve's unary path costs less than a stream
        of one output (a relay like ingress_bench's two-hop ceiling: 221 against 210 req/s)."""
        pool = self._handle(routed.target_instance)
        response = (pool.generate if routed.request.stream else pool.whole).remote(routed)
        finished = False
        try:
            if not routed.request.stream:
                out = await response
                finished = True
                yield out
                return
            async for out in response:
                yield out
            finished = True
        except RayError as e:
            # Replica died, became unavailable or raised: the dispatcher decides on failover.
            finished = True
            raise EngineError(f"{type(e).__name__}: {e}") from e
        finally:
            if not finished:
                response.cancel()

    async def command(self, command: KvCommand) -> dict[str, Any]:
        async def call() -> dict[str, Any]:
            self.isolate()
            try:
                call = self._handle(command.target_instance).command
                result: dict[str, Any] = await call.remote(command)
            except RayError as e:
                raise EngineError(f"{type(e).__name__}: {e}") from e
            return result

        return await asyncio.create_task(call())  # its own context: isolate stays inside

    def isolate(self) -> None:
        # NOTE: Serve's request router hands a chosen replica to the pending call with the same
        # internal request id, which every call made while serving one HTTP request shares (the
        # proxy's). Concurrent calls of one HTTP request would take each other's replicas and
        # one would wait forever; a fresh id per task keeps them apart.
        _set_request_context(_internal_request_id=generate_request_id())
