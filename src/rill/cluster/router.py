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
process counts them (``rill.cluster.registry``), plus those this router chose whose start has
not been answered yet: every generation passes through the server process, so it sees them all.
A start counts from the moment it is chosen, so starts chosen at once see each other; Ray Serve
may report a start answered before it reports it routed (calls by value do), and an answered
start is never counted again. The prefix
map is bounded (``max_keys``, oldest forgotten first); it remembers where prompts went, not
what each replica's cache still holds, so an evicted prefix costs one recompute and no error.

The set of live replicas this router sees is published for the engine client in the same
process (``rill.cluster.registry``): ``/health`` is ready while one is. Ray Serve ships this
module's class by value, globals included: keep its globals plain data.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from rill.cluster import registry
from rill.config.areas import ROUTING_IMBALANCE, ROUTING_MODES

PICK_TTL_S = 300.0
"""Longest a chosen start counts before its answer (the engine client gives up on one at
120 s): a start Serve never reports answered stops weighing on its replica's load."""

MAX_ANSWERED = 4096
"""Answered starts remembered, in case Serve reports their routing after their answer."""


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
        # internal request id -> (replica unique id, when chosen): starts not answered yet
        self._picked: dict[str, tuple[str, float]] = {}
        self._answered: OrderedDict[str, None] = OrderedDict()  # starts answered lately
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
        self._picked = {request: pick for request, pick in self._picked.items() if pick[0] in live}

    def _starts_in_flight(self) -> dict[str, int]:
        """Starts chosen per replica and not answered yet (stale ones dropped)."""
        now = time.monotonic()
        self._picked = {request: pick for request, pick in self._picked.items() if now - pick[1] < PICK_TTL_S}
        counts: dict[str, int] = {}
        for replica, _ in self._picked.values():
            counts[replica] = counts.get(replica, 0) + 1
        return counts

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
            named = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            return [named] if named else []
        chosen = self._choose(candidate_replicas, kwargs)
        if kwargs.get("prefix_keys") is not None and pending_request is not None:
            # Counted from now on, so that starts chosen before this one is routed see it.
            self._count_start(pending_request.metadata.internal_request_id, chosen.replica_id.unique_id)
        return [[chosen]]

    def _choose(self, candidate_replicas: list[RunningReplica], kwargs: dict[str, Any]) -> RunningReplica:
        """The replica for a call naming none (see the module docstring)."""
        keys = kwargs.get("prefix_keys")
        if keys is not None and self._mode == "round-robin":
            self._turn += 1
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            return ordered[self._turn % len(ordered)]
        running = registry.in_flight(self._deployment_id.name)
        starting = self._starts_in_flight()
        load = {
            r.replica_id.unique_id: running.get(r.replica_id.unique_id, 0) + starting.get(r.replica_id.unique_id, 0)
            for r in candidate_replicas
        }
        least = min(load.values())
        if keys and (self._mode == "prefix" or kwargs.get("pinned")):
            for key in keys:
                owner = self._owner.get(key)
                if owner is not None and owner in load:
                    if kwargs.get("pinned") or load[owner] <= least + self._imbalance:
                        return next(r for r in candidate_replicas if r.replica_id.unique_id == owner)
                    break  # the longest cached prefix is on a busy replica: balance instead
        lightest = sorted(
            (r for r in candidate_replicas if load[r.replica_id.unique_id] == least),
            key=lambda r: r.replica_id.unique_id,
        )
        # Ties in turn, not at random: an even spread whatever the order of the calls.
        self._turn += 1
        return lightest[self._turn % len(lightest)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Count a generation's start on the replica it went to, unless it was answered already,
        and remember where its prefixes went."""
        keys = pending_request.kwargs.get("prefix_keys")
        if keys is None:
            return
        replica = replica_id.unique_id
        self._count_start(pending_request.metadata.internal_request_id, replica)  # (Serve may give it another)
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self._max_keys:
            self._owner.popitem(last=False)

    def _count_start(self, request_id: str, replica: str) -> None:
        """Count a start on ``replica`` from now until it is answered; one answered already
        (by value Serve may report the answer before the routing) is not counted again."""
        if request_id not in self._answered:
            self._picked[request_id] = (replica, time.monotonic())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """A generation's start was answered: from now on the engine client counts it."""
        if self._picked.pop(internal_request_id, None) is None:
            return  # another call (a control, a stats read, an outputs stream)
        self._answered[internal_request_id] = None
        while len(self._answered) > MAX_ANSWERED:
            self._answered.popitem(last=False)
