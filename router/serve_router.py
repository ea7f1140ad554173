"""kvroute's Ray Serve request router: placement inside ``RequestRouter.choose_replicas``.

Configured on the engine deployment with ``request_router_config``
(``request_router_class="router.serve_router:KvRequestRouter"``), so Serve keeps health
checks, replica membership and back-pressure (``max_ongoing_requests``) while kvroute picks the
replica. It runs in the caller's process (the ingress replica) and shares that process's
``RouterState`` (registered under ``state_key``): the map the ingress's pump thread keeps.

The answer is ranked: the chosen instance first, then every other candidate; Serve moves to the
second rank only when the chosen replica is at its ``max_ongoing_requests`` (back-pressure).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from engines.base import RoutedRequest
from router.dispatch import request_for_placement
from router.placement import NoInstanceError
from router.state import RouterState

log = logging.getLogger(__name__)

_STATES: dict[str, RouterState] = {}


def register_state(key: str, state: RouterState) -> None:
    """Make ``state`` the one request routers with ``state_key=key`` use in this process."""
    _STATES[key] = state


def unregister_state(key: str) -> None:
    _STATES.pop(key, None)


def _routed(pending: PendingRequest | None) -> RoutedRequest | None:
    if pending is None:
        return None
    for arg in (*pending.args, *pending.kwargs.values()):
        if isinstance(arg, RoutedRequest):
            return arg
    return None


class KvRequestRouter(RequestRouter):
    def initialize_state(self, state_key: str = "default", **_: Any) -> None:
        self._state_key = state_key

    @property
    def state(self) -> RouterState | None:
        return _STATES.get(self._state_key)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        state = self.state
        if state is not None:
            state.sync_instances(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        state = self.state
        if state is not None:
            state.sync_instances(
                r.replica_id.unique_id
                for r in self._replicas.values()
                if r.replica_id != replica_id
            )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        routed = _routed(pending_request)
        state = self.state
        if routed is None or state is None or not by_id:
            return [candidate_replicas]  # not a routed call (health, resync...): any replica
        target = routed.target_instance
        if target not in by_id:
            try:
                state.sync_instances(r.replica_id.unique_id for r in self._replicas.values())
                target = state.place(
                    request_for_placement(routed), candidates=list(by_id)
                ).instance_id
            except NoInstanceError:
                return [candidate_replicas]
            routed.target_instance = target
        rest = [r for iid, r in by_id.items() if iid != target]
        return [[by_id[target]], rest] if rest else [[by_id[target]]]
