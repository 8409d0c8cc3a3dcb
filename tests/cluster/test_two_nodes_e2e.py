"""``rill serve --ray-address`` on a two-node Ray cluster (simulated on this machine with
``ray.cluster_utils.Cluster``: two raylets, one CPU each): one replica per node, streams
served from both, one principal's rate limit held across the replicas, and a second front door
that joins the same replicas, reads what the first stored, from PostgreSQL, and counts a
principal's requests in the same rate-limit window as the first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from .conftest import REPLICA_TITLE, ClusterServer, _cmdline, _descendants, start_cluster_server, stop, wait_for

REQUESTS_PER_WINDOW = 4
"""The server's --rate-limit-requests (per principal, an hour's window)."""


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
    """A head node and a worker node, one CPU each: each can hold one engine replica."""
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    try:
        yield nodes
    finally:
        nodes.shutdown()


@pytest.fixture(scope="module")
def flags(two_nodes: Any, postgres: Any) -> list[str]:
    """The front doors' settings: the cluster, two keys, a rate limit, one PostgreSQL database."""
    flags = ["--ray-address", two_nodes.address, "--replica-cpus", "1", "--api-key", "key-one", "--api-key", "key-two"]
    flags += ["--api-key", "key-three", "--api-key", "key-four"]
    flags += ["--rate-limit-requests", str(REQUESTS_PER_WINDOW), "--rate-limit-window", "3600"]
    return [*flags, "--database", str(postgres.new_database())]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, flags: list[str]) -> Iterator[ClusterServer]:
    folder = tmp_path_factory.mktemp("two-nodes")
    cluster = start_cluster_server(tiny_model_dir, folder, *flags)
    cluster.api_key = "key-two"
    try:
        yield cluster
    finally:
        stop(cluster.proc)


def replicas_by_node() -> dict[int, list[int]]:
    """Engine replica processes under each raylet (each raylet is one node) of this test's cluster."""
    import os

    found: dict[int, list[int]] = {}
    for pid in _descendants(os.getpid()):
        if "raylet" in _cmdline(pid).split(" ", 1)[0]:
            found[pid] = [p for p in _descendants(pid) if _cmdline(p).startswith(REPLICA_TITLE)]
    return found


async def completion(server: ClusterServer, key: str, prompt: str) -> str:
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0) as client:
        result = await client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=48, temperature=0, extra_body={"ignore_eos": True}
        )
    return result.choices[0].text


async def test_one_replica_on_each_node(server: ClusterServer) -> None:
    placed = replicas_by_node()
    assert len(placed) == 2 and sorted(len(replicas) for replicas in placed.values()) == [1, 1], placed
    assert await completion(server, "key-two", "Once upon a time")


async def test_a_principals_rate_limit_holds_across_replicas(server: ClusterServer) -> None:
    before = server.replica_values("rill_replica_generation_tokens_total")
    results = await asyncio.gather(
        *(completion(server, "key-one", f"request {i}") for i in range(REQUESTS_PER_WINDOW + 2)),
        return_exceptions=True,
    )
    served = [r for r in results if isinstance(r, str)]
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(served) == REQUESTS_PER_WINDOW and len(refused) == 2, results
    assert all(e.code == "rate_limit_exceeded" or "rate" in str(e) for e in refused)
    # The served ones ran on both replicas (the gauges are read every second: a bounded wait).
    after = wait_for(
        lambda: (lambda now: now if sum(now.values()) >= sum(before.values()) + 48 * REQUESTS_PER_WINDOW else None)(
            server.replica_values("rill_replica_generation_tokens_total")
        ),
        30,
        "the replicas' counters",
    )
    assert all(after[r] > before.get(r, 0) for r in after) and len(after) == 2, (before, after)
    # Another principal is not limited by the first one's use.
    assert await completion(server, "key-two", "still served")


async def test_a_second_front_door_joins_the_replicas_and_reads_the_shared_store(
    server: ClusterServer, tiny_model_dir: Path, tmp_path: Path, flags: list[str]
) -> None:
    """A second ``rill serve`` on the same cluster uses the replicas already there (it starts
    none), serves through them, reads a response the first one stored (PostgreSQL), counts
    in the rate limits the first one counts in, and leaves the replicas running when it stops."""
    replicas = sorted(pid for pids in replicas_by_node().values() for pid in pids)
    second = start_cluster_server(tiny_model_dir, tmp_path, *flags)
    try:
        assert sorted(pid for pids in replicas_by_node().values() for pid in pids) == replicas
        async with (
            openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="key-three", max_retries=0) as first_door,
            openai.AsyncOpenAI(base_url=f"{second.url}/v1", api_key="key-three", max_retries=0) as second_door,
        ):
            made = await first_door.responses.create(
                model="tiny-llama", input="Once upon a time", max_output_tokens=8, temperature=0, store=True
            )
            read = await second_door.responses.retrieve(made.id)
            assert (read.id, read.output_text, read.status) == (made.id, made.output_text, made.status)
            assert await completion(second, "key-three", "through the second door")
            # One principal's requests through both doors fill one window, not one per door.
            for door in (server, second) * (REQUESTS_PER_WINDOW // 2):
                assert await completion(door, "key-four", "counted once for the cluster")
            for door in (second, server):
                with pytest.raises(openai.RateLimitError):
                    await completion(door, "key-four", "past the cluster's window")
    finally:
        status = stop(second.proc)
    assert status == 0  # SIGTERM stops it gracefully (Ray's own fatal-signal handler would abort it)
    assert sorted(pid for pids in replicas_by_node().values() for pid in pids) == replicas
    assert await completion(server, "key-three", "the replicas outlive the second door")
