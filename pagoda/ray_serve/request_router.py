"""pagoda's routing policies as a Ray Serve custom request router, so that session affinity and
cache-aware routing hold inside Ray as they do behind `pagoda router`.

Ray Serve routes each call of a deployment handle (here: the ingress calling the engine
replicas' `forward`) through the deployment's `RequestRouter`, in the caller's process. Its
`choose_replicas` gets the call's arguments; the first is the request's `RouteRequest` (its
session key and prompt text, pagoda/router/affinity.py), which is what pagoda's policies read.
A replica stands in for a router worker (`ReplicaWorker`): its id as the url, the queue length
Serve last heard from it as the load. Serve then sends the request to the first replica that
accepts it, trying the preferred one first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from pagoda.router.affinity import RouteRequest
from pagoda.router.policies import Policy, make_policy


@dataclass
class ReplicaWorker:
    """What a policy reads of a worker (pagoda.router.workers.Worker's `url`, `in_flight` and
    `weight()`), for a Serve replica."""

    url: str
    in_flight: int
    replica: RunningReplica

    def weight(self) -> float:
        # no warm-up ramp: Serve marks a replica running once its constructor (the model load) returned
        return 1.0


class PagodaRequestRouter(RequestRouter):
    """A `RequestRouter` over one of pagoda's policies (`policy` in `request_router_kwargs`:
    cache_aware, the default; consistent_hash; least_load; round_robin). Requests are matched to
    the replica chosen for them, not in FIFO order (no FIFOMixin), so a session's request is
    never handed the replica picked for another's."""

    def initialize_state(self, policy: str = "cache_aware", **cache_aware_options: Any) -> None:
        self.policy: Policy = make_policy(policy, **(cache_aware_options if policy == "cache_aware" else {}))
        self._members: set[str] = set()

    def _sync_members(self) -> None:
        """The policy's workers (hash ring, prefix tree) follow the deployment's running replicas."""
        current = {replica_id.unique_id for replica_id in self.curr_replicas}
        for url in current - self._members:
            self.policy.add_worker(url)
        for url in self._members - current:
            self.policy.remove_worker(url)
        self._members = current

    def _worker(self, replica: RunningReplica) -> ReplicaWorker:
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        return ReplicaWorker(replica.replica_id.unique_id, queued or 0, replica)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """The policy's replica first, then the rest (taken if the first refuses: it is full)."""
        if not candidate_replicas:
            return []
        route = route_of(pending_request)
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all refused: back off before the next round
        if route is None:
            return [candidate_replicas]
        self._sync_members()
        chosen = self.policy.choose(route, [self._worker(r) for r in candidate_replicas]).worker.replica
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        """Where the request went: the cache-aware policy's prefix tree learns it."""
        route = route_of(pending_request)
        replica = self.curr_replicas.get(replica_id)
        if route is not None and replica is not None:
            self.policy.routed(route, self._worker(replica))


def route_of(pending_request: PendingRequest | None) -> RouteRequest | None:
    """The `RouteRequest` a call carries as its first argument, if it does."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, RouteRequest) else None
