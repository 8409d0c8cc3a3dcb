"""EngineReplica: one engine of a cluster, the class of the Ray Serve deployment.

Each replica runs an ``InprocClient`` (the engine in a thread of the replica's process, its
own KV cache and prefix cache) under a policy without caps or rate limits: the server process
planned every request already (``rill.cluster.client``); the replica makes only the checks
that need its engine (its queue bound, a duplicate id, beam rows) and compiles a
constrained request's grammar with its own compiler.

Every answer crosses to the server process as a value, never as a raised exception, so a
refusal keeps its type: ``run`` yields ``Refused`` or ``Accepted`` first, then the request's
outputs, coalesced while the server reads slower than the engine makes them. Leaving ``run``
early (the server closed the stream, or cancelled the call) cancels the request here.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from rill.config import EngineConfig
from rill.errors import RillError
from rill.frontend.inproc import InprocClient
from rill.frontend.policy import Choice, SubmissionPolicy
from rill.types import EngineStats, ModelInfo, RequestOutput, SamplingParams

log = logging.getLogger("rill.cluster")

CONTROLS = ("abort", "pause", "resume", "regenerate")
"""The control commands ``EngineReplica.control`` applies."""


class Description(msgspec.Struct, frozen=True, kw_only=True):
    """What the server process needs of a replica's model to plan requests itself."""

    replica: str
    tokenizer: Any
    model_info: ModelInfo
    eos_token_ids: frozenset[int]
    num_rows: int
    generation_defaults: dict[str, Any]


class Accepted(msgspec.Struct, frozen=True):
    """``run``'s first item when the request started: the replica it runs on."""

    replica: str


class Refused(msgspec.Struct, frozen=True):
    """``run``'s only item (or a call's answer) when the replica refused: why."""

    error: Any


def _replica_id() -> str:
    from ray import serve

    return str(serve.get_replica_context().replica_id.unique_id)


class EngineReplica:
    """One engine replica (see the module docstring).

    Args:
        config: the engine's settings (model, threads, KV budget); the same on every replica.
    """

    async def __init__(self, config: EngineConfig) -> None:  # type: ignore[misc]  # Ray Serve awaits it
        self.replica = _replica_id()
        self.client = InprocClient.start(config, policy=SubmissionPolicy(engine=config))
        # Ray counts the replica as started when this returns: only with its model loaded.
        await self.client.wait_ready()
        log.info("engine replica %s ready", self.replica)

    def describe(self) -> Description:
        """The model's facts and tokenizer, for the server process's planning."""
        engine = self.client.engine
        assert engine is not None  # the constructor waited for it
        return Description(
            replica=self.replica,
            tokenizer=engine.tokenizer,
            model_info=engine.model_info,
            eos_token_ids=engine.eos_token_ids,
            num_rows=engine.runner.num_rows,
            generation_defaults=engine.generation_defaults,
        )

    async def run(
        self, choice: Choice, *, prefix_keys: list[int], pinned: bool = False
    ) -> AsyncIterator[Accepted | Refused | RequestOutput]:
        """Start ``choice`` and yield ``Accepted`` then its outputs, or ``Refused`` alone.
        ``prefix_keys`` and ``pinned`` are the router's (``rill.cluster.router``)."""
        try:
            stream = await self.client.start_choice(choice)
        except RillError as exc:
            yield Refused(exc)
            return
        yield Accepted(self.replica)
        async with stream:  # leaving early (the call cancelled) aborts the request here
            async for output in stream:
                yield output

    def control(self, op: str, request_id: str, *, replica: str) -> Refused | None:
        """Apply one of ``CONTROLS`` to a request running here (``replica`` routes the call)."""
        if op not in CONTROLS:
            return Refused(RillError(f"unknown control {op!r}"))
        try:
            getattr(self.client, op)(request_id)
        except RillError as exc:
            return Refused(exc)
        return None

    async def set_sampling(self, request_id: str, params: SamplingParams, *, replica: str) -> Refused | None:
        """Put ``params`` (validated and capped by the server process) in force for a request
        running here, its new grammar compiled first."""
        try:
            stream = self.client.running(request_id)
            await self.client.set_sampling(stream, params)
        except RillError as exc:
            return Refused(exc)
        return None

    def stats(self, *, replica: str) -> EngineStats:
        """This replica's engine gauges and counters."""
        return self.client.stats()

    def check_health(self) -> None:
        """Ray's health check: raise once the engine has stopped (Ray then replaces the replica)."""
        error = self.client.state().error
        if error is not None:
            raise error
