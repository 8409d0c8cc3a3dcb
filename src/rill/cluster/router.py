"""RillRouter: how Ray Serve picks the engine replica of each call (its request-router API).

Three kinds of call reach the replicas, and the router tells them apart by their keywords:

* a call naming ``replica=`` (a control command, a parameter change, a stats read) goes to that
  replica and no other: the request it is about runs there. If the replica is gone, no replica
  is offered and the caller's own time limit ends the wait;
* a new generation (``start`` with ``prefix_keys=``) goes, in ``prefix`` mode, to the replica
  that last took a prompt with the longest of its prefixes, unless that replica has
  ``imbalance`` more generations in flight than the least loaded one (a ``pinned`` one, the
  continuation of a kept generation, goes there whatever the load); otherwise, and in
  ``least-loaded`` mode, to the least loaded replica (ties broken at random); in
  ``round-robin`` mode to each replica in turn (the baseline the benchmark compares with);
* anything else goes to the least loaded replica.

"In flight" counts the generations running on each replica, as the engine client of this
process counts them (``rill.cluster.registry``), plus those this router sent whose start has
not been answered yet: every generation passes through the server process, so it sees them all. The prefix
map is bounded (``max_keys``, oldest forgotten first); it remembers where prompts went, not
what each replica's cache still holds, so an evicted prefix costs one recompute and no error.

The set of live replicas this router sees is published for the engine client in the same
process (``rill.cluster.registry``): ``/health`` is ready while one is. Ray Serve ships this
module's class by value, globals included: keep its globals plain data.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from rill.cluster import registry
from rill.config.areas import ROUTING_IMBALANCE, ROUTING_MODES


def prefix_keys(prompt_ids: list[int], block: int = 32, max_tokens: int = 2048) -> list[int]:
    """Keys of the prompt's prefixes at whole blocks of ``block`` tokens up to ``max_tokens``,
    longest first (the last token is left out, as the prefix cache leaves it). A prompt shorter
    than a block has none: a shorter shared prefix saves less than balancing gains."""
    usable = min(len(prompt_ids) - 1, max_tokens) // block * block
    keys, key = [], 0
    for end in range(block, usable + 1, block):  # each key chains the one before: one pass over the prompt
        key = hash((key, tuple(prompt_ids[end - block : end])))
        keys.append(key)
    keys.reverse()
    return keys


class RillRouter(RequestRouter):
    """Ray Serve request router of rill's engine replicas (see the module docstring)."""

    def initialize_state(
        self, mode: str = "prefix", imbalance: int = ROUTING_IMBALANCE, max_keys: int = 65536, **_: Any
    ) -> None:
        """Set the routing of new generations: ``mode`` (one of ``ROUTING_MODES``), the load gap past
        which affinity yields (``imbalance`` generations), and the prefix map's bound."""
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing mode must be one of {', '.join(ROUTING_MODES)}, not {mode!r}")
        self._mode = mode
        self._imbalance = imbalance
        self._max_keys = max_keys
        self._owner: OrderedDict[int, str] = OrderedDict()  # prefix key -> replica unique id
        self._in_flight: dict[str, int] = {}  # replica unique id -> starts sent there, not yet answered
        self._routed: dict[str, str] = {}  # internal request id -> replica unique id
        self._turn = 0

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Take Ray's new replica set and publish it (``live_replicas``)."""
        super().update_replicas(replicas)
        self._publish()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Forget a dead replica at once, before the controller's next update."""
        super().on_replica_actor_died(replica_id)
        self._publish()

    def _publish(self) -> None:
        live = frozenset(r.unique_id for r in self._replicas)
        registry.publish(self._deployment_id.name, live)
        # A replica that left keeps no count (a restarted one comes back under a new id).
        self._in_flight = {replica: n for replica, n in self._in_flight.items() if replica in live}
        self._routed = {request: replica for request, replica in self._routed.items() if replica in live}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """The replica (a rank of one) a call should go to; see the module docstring."""
        if pending_request is not None:
            # Every choice here already considers every replica: when none is chosen (a call's
            # replica is gone), Ray must wait between tries rather than ask again at once.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("replica")
        if target is not None:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            return [chosen] if chosen else []
        keys = kwargs.get("prefix_keys")
        if keys is not None and self._mode == "round-robin":
            self._turn += 1
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            return [[ordered[self._turn % len(ordered)]]]
        running = registry.in_flight(self._deployment_id.name)
        load = {
            r.replica_id.unique_id: running.get(r.replica_id.unique_id, 0)
            + self._in_flight.get(r.replica_id.unique_id, 0)
            for r in candidate_replicas
        }
        least = min(load.values())
        if keys and (self._mode == "prefix" or kwargs.get("pinned")):
            for key in keys:
                owner = self._owner.get(key)
                if owner is not None and owner in load:
                    if kwargs.get("pinned") or load[owner] <= least + self._imbalance:
                        return [[r for r in candidate_replicas if r.replica_id.unique_id == owner]]
                    break  # the longest cached prefix is on a busy replica: balance instead
        lightest = sorted(
            (r for r in candidate_replicas if load[r.replica_id.unique_id] == least),
            key=lambda r: r.replica_id.unique_id,
        )
        # Ties in turn, not at random: requests routed at the same moment (before any of them
        # is counted) still spread evenly.
        self._turn += 1
        return [[lightest[self._turn % len(lightest)]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Count a generation whose start is in flight to its replica and remember where its
        prefixes went."""
        keys = pending_request.kwargs.get("prefix_keys")
        if keys is None:
            return
        replica = replica_id.unique_id
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1
        self._routed[pending_request.metadata.internal_request_id] = replica
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self._max_keys:
            self._owner.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """A generation's start was answered: from now on the engine client counts it."""
        replica = self._routed.pop(internal_request_id, None)
        if replica is not None:
            self._in_flight[replica] = max(0, self._in_flight.get(replica, 0) - 1)
