"""kvroute's Ray Serve request router: placement inside ``RequestRouter.choose_replicas``.

Configured on the engine deployment with ``request_router_config``
(``request_router_class="router.serve_router:KvRequestRouter"``), so Serve keeps health
checks, replica membership and back-pressure (``max_ongoing_requests``) while kvroute picks the
replica. It runs in the caller's process (the ingress replica) and shares that process's
``RouterState`` (registered under ``state_key``): the map the ingress's pump thread keeps.
Each engine pool is a deployment of its own with its own request router, which reports its
replica set as that pool's membership (``pool``): pools never drop each other's instances.

NOTE: Serve ships this class to the caller pickled *by value* (``RequestRouterConfig`` registers
this module with cloudpickle), so a module-level global here would be a fresh copy in the
ingress process, never the one the ingress registered into. The registry therefore lives in
``router.state``, which is pickled by reference.

For the first ``sticky_attempts`` tries of a request the answer is the chosen replica alone;
after that it is ranked: the chosen replica first, then every other candidate. Serve moves to a
lower rank whenever the chosen replica does not take the request at once: it is at its
``max_ongoing_requests`` (back-pressure), or it did not answer Serve's queue-length probe within
``RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S`` (0.1 s, doubling on each retry). The sticky
attempts wait through that backoff before giving up the cache; where a request ran anyway is
counted by the ingress (``kvroute_placement_overrides``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from engines.base import KvCommand, RoutedRequest
from router.dispatch import request_for_placement
from router.placement import NoInstanceError
from router.state import RouterState, registered_state

log = logging.getLogger(__name__)


def _routed(pending: PendingRequest | None) -> RoutedRequest | KvCommand | None:
    if pending is None:
        return None
    for arg in (*pending.args, *pending.kwargs.values()):
        if isinstance(arg, RoutedRequest | KvCommand):
            return arg
    return None


class KvRequestRouter(RequestRouter):
    def initialize_state(
        self,
        state_key: str = "default",
        sticky_attempts: int = 3,
        pool: str | None = None,
        **_: Any,
    ) -> None:
        """``pool``: the engine pool this deployment is (None: the router's default pool)."""
        if sticky_attempts < 1:
            raise ValueError(f"sticky_attempts must be >= 1, got {sticky_attempts}")
        self._state_key = state_key
        self._pool = pool
        self._sticky_attempts = sticky_attempts
        # internal request id -> choose_replicas calls so far (bounded: oldest dropped)
        self._attempts: OrderedDict[str, int] = OrderedDict()

    def _attempt(self, pending: PendingRequest) -> int:
        key = pending.metadata.internal_request_id
        n = self._attempts.pop(key, 0) + 1
        self._attempts[key] = n
        if len(self._attempts) > 4096:
            self._attempts.popitem(last=False)
        return n

    @property
    def state(self) -> RouterState | None:
        return registered_state(self._state_key)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        state = self.state
        if state is not None:
            state.sync_instances((r.replica_id.unique_id for r in replicas), self._pool)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        state = self.state
        if state is not None:
            state.sync_instances(
                (
                    r.replica_id.unique_id
                    for r in self._replicas.values()
                    if r.replica_id != replica_id
                ),
                self._pool,
            )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        routed = _routed(pending_request)
        state = self.state
        if isinstance(routed, KvCommand):  # an operator's order: that replica or none
            target_replica = by_id.get(routed.target_instance)
            # NOTE: a replica that is not a candidate refuses the command (EngineDeployment)
            return [[target_replica]] if target_replica is not None else [candidate_replicas]
        if routed is None or state is None or not by_id:
            return [candidate_replicas]  # not a routed call (health, resync...): any replica
        target = routed.target_instance
        if target not in by_id:
            try:
                state.sync_instances(
                    (r.replica_id.unique_id for r in self._replicas.values()), self._pool
                )
                preq = request_for_placement(routed, state.block_size)
                placement = state.place(preq, candidates=list(by_id))
            except NoInstanceError:
                return [candidate_replicas]
            target = routed.target_instance = placement.instance_id
            routed.request.expected_cached_tokens = state.cached_tokens(preq, placement)
        rest = [r for iid, r in by_id.items() if iid != target]
        if not rest or (
            pending_request and self._attempt(pending_request) <= self._sticky_attempts
        ):
            return [[by_id[target]]]
        return [[by_id[target]], rest]
