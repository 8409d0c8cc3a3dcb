"""RillRouter's choices, without Ray running: controls go to their replica, prompts that share
a prefix to the replica that has it while load allows, pinned continuations there always."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from rill.cluster.router import RillRouter, prefix_keys

REPLICAS = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=name)) for name in ("a", "b", "c")]


def router(mode: str = "prefix", imbalance: int = 2) -> RillRouter:
    made = RillRouter.__new__(RillRouter)  # Ray's constructor wires metrics and long polls: not needed here
    made._deployment_id = SimpleNamespace(name="test-router")  # type: ignore[assignment]
    made.initialize_state(mode=mode, imbalance=imbalance)
    return made


def request(number: int, **kwargs: Any) -> Any:
    return SimpleNamespace(
        kwargs=kwargs,
        metadata=SimpleNamespace(internal_request_id=f"r{number}"),
        routing_context=SimpleNamespace(should_backoff=False),
    )


def route(r: RillRouter, number: int, **kwargs: Any) -> str:
    pending = request(number, **kwargs)
    [[chosen]] = asyncio.run(r.choose_replicas(REPLICAS, pending))  # type: ignore[arg-type]
    r.on_request_routed(pending, chosen.replica_id, None)  # type: ignore[arg-type]
    return str(chosen.replica_id.unique_id)


def test_prefix_keys_are_longest_first_and_leave_out_the_last_token() -> None:
    ids = list(range(100))
    keys = prefix_keys(ids)
    assert len(keys) == 3 == len(set(keys))  # blocks ending at 96, 64 and 32
    assert prefix_keys(ids[:97]) == keys  # the 97th token is the last: left out
    assert prefix_keys(ids[:65]) == keys[1:] and prefix_keys(ids[:33]) == keys[2:]
    changed = ids[:40] + [-1] + ids[41:]
    assert prefix_keys(changed)[2] == keys[2] and not set(prefix_keys(changed)[:2]) & set(keys)
    assert prefix_keys(ids[:32]) == []  # 31 usable tokens: no whole block


def test_a_control_goes_to_its_replica_and_nowhere_else() -> None:
    r = router()
    for name in ("a", "b", "c"):
        [[chosen]] = asyncio.run(r.choose_replicas(REPLICAS, request(0, replica=name)))  # type: ignore[arg-type]
        assert chosen.replica_id.unique_id == name
    # A replica that is gone is never replaced by another (the caller's time limit ends the
    # wait), and Ray is told to wait between tries rather than spin.
    gone = request(0, replica="gone")
    assert asyncio.run(r.choose_replicas(REPLICAS, gone)) == []  # type: ignore[arg-type]
    assert gone.routing_context.should_backoff is True


def test_shared_prefixes_stick_while_load_allows() -> None:
    r = router(imbalance=2)
    shared = list(range(64))
    first = route(r, 1, prefix_keys=prefix_keys(shared + [1, 2, 3]))
    # The same prefix again: the same replica, up to `imbalance` more in flight than the least loaded.
    assert route(r, 2, prefix_keys=prefix_keys(shared + [4, 5, 6])) == first
    assert route(r, 3, prefix_keys=prefix_keys(shared + [7, 8, 9])) == first
    # Three in flight there against none elsewhere: past the imbalance, the least loaded takes it.
    other = route(r, 4, prefix_keys=prefix_keys(shared + [10, 11, 12]))
    assert other != first
    # A pinned continuation goes to its replica whatever the load.
    assert route(r, 5, prefix_keys=prefix_keys(shared + [13]), pinned=True) in (first, other)
    # Answered starts free their replica's count.
    for number in (1, 2, 3):
        r.on_request_completed(SimpleNamespace(unique_id=first), f"r{number}")  # type: ignore[arg-type]
    assert first not in r._starts_in_flight()


def choose(r: RillRouter, number: int, candidates: list[Any], **kwargs: Any) -> str:
    """The replica ``r`` picks for a call, which Ray has not routed yet."""
    [[chosen]] = asyncio.run(r.choose_replicas(candidates, request(number, **kwargs)))
    return str(chosen.replica_id.unique_id)


def test_a_start_answered_before_it_is_reported_routed_is_not_counted_for_ever() -> None:
    # Calls by value: Ray Serve reports a start answered, then routed. That order once left each
    # start counted on its replica for good, and four requests at once all went to the other.
    r = router()
    two = REPLICAS[:2]
    first = choose(r, 1, two, prefix_keys=[])
    r.on_request_completed(SimpleNamespace(unique_id=first), "r1")  # type: ignore[arg-type]
    r.on_request_routed(request(1, prefix_keys=[]), SimpleNamespace(unique_id=first), None)  # type: ignore[arg-type]
    # Nothing is in flight now. Two starts chosen at once (neither routed yet) see each other.
    assert sorted([choose(r, 2, two, prefix_keys=[]), choose(r, 3, two, prefix_keys=[])]) == ["a", "b"]


def test_without_a_known_prefix_the_least_loaded_replica_is_chosen() -> None:
    r = router()
    picks = [route(r, n, prefix_keys=[]) for n in range(3)]
    assert sorted(picks) == ["a", "b", "c"]  # each new request to an idle replica


def test_least_loaded_mode_ignores_prefixes_and_round_robin_takes_turns() -> None:
    r = router(mode="least-loaded")
    keys = prefix_keys(list(range(64)))
    assert sorted(route(r, n, prefix_keys=keys) for n in range(3)) == ["a", "b", "c"]
    rr = router(mode="round-robin")
    turns = [route(rr, n, prefix_keys=keys) for n in range(6)]
    assert turns[:3] != turns[1:4] and sorted(turns) == ["a", "a", "b", "b", "c", "c"]


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="round-robin"):
        router(mode="random")


def test_the_rayservice_builder_takes_rill_serve_settings() -> None:
    """``rill.cluster.launch:build_app`` (KubeRay's ``import_path``) builds the replicas of the
    settings it is given, by ``rill serve``'s flag names."""
    from rill.cluster.launch import build_app

    app = build_app({"model": "/models/m", "replicas": 3, "num-threads": 2, "routing": "least-loaded"})
    deployment = app._bound_deployment
    assert deployment._deployment_config.num_replicas == 3
    [engine] = deployment.init_args
    assert (engine.model, engine.num_threads) == ("/models/m", 2)
    router = deployment._deployment_config.request_router_config
    assert router.request_router_kwargs == {"mode": "least-loaded"}
