"""EngineReplica: one engine of a cluster, the class of the Ray Serve deployment.

Each replica runs an ``InprocClient`` (the engine in a thread of the replica's process, its
own KV cache and prefix cache) under a policy without caps or rate limits: the server process
planned every request already (``rill.cluster.client``); the replica makes only the checks
that need its engine (its queue bound, a duplicate id, beam rows) and compiles a
constrained request's grammar with its own compiler.

Every answer crosses to the server process as a value, never as a raised exception, so a
refusal keeps its type: ``start`` answers ``Accepted`` or ``Refused``.

Outputs go back in one stream per server process (``outputs``), one batch per engine step:
the step's outputs of every request that server started here, each request's coalesced while
the server reads slower than the engine makes them (as the in-process engine thread hands a
step over in one hop). A stream item costs the same whatever it holds, so one item per step,
rather than one per request and step, is what keeps the hop cheap under load. A server process
on this machine takes the batches over a Unix socket instead (``rill.cluster.link``), the Ray
stream staying open and empty beside it. When either ends (the server went away), its
requests are cancelled here.

A replica's engine shares its machine's cores with Ray's daemons and often with the server
process, whose work preempts one of the engine's threads now and then; so its products of many
rows hand their weight blocks out to whichever thread is free (``qkernel.share_cores``), and a
preempted thread no longer holds up the other until it runs again.

While a server process on this machine has its outputs stream open, the engine's thread
governor counts that process's CPU as the replica's own (``ThreadGovernor.ally``): it
tokenizes, streams and reads this engine's outputs, work that single-process rill does in the
engine's own process, so it is no contention to give threads up for.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from rill.cluster import link
from rill.config import EngineConfig
from rill.engine.threads import proc_stat_fields
from rill.errors import RillError
from rill.frontend.budget import freeze_startup_objects
from rill.frontend.inproc import InprocClient
from rill.frontend.policy import Choice, SubmissionPolicy
from rill.frontend.stream import RequestStream
from rill.types import EngineStats, ModelInfo, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from rill.engine.threads import ThreadGovernor

log = logging.getLogger("rill.cluster")

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
"""The running kernel's boot id: the same for every process (and container) of one machine."""

UNREAD_OUTBOX_S = 60.0
"""How long requests a server process started here may go unread before they are cancelled."""

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
    """``start``'s answer when the request started: the replica it runs on."""

    replica: str


class Refused(msgspec.Struct, frozen=True):
    """A call's answer when the replica refused: why."""

    error: Any


class Origin(msgspec.Struct, frozen=True):
    """A server process, named so that a replica can tell whether it runs on the same machine.

    Attributes:
        boot_id: the kernel's boot id (``BOOT_ID``).
        pid: its process id.
        started: its start time, in clock ticks after boot (``/proc/<pid>/stat``'s 22nd field).
        outputs_address: where it takes outputs over a local socket (``rill.cluster.link``),
            if it does.
    """

    boot_id: str
    pid: int
    started: int
    outputs_address: str | None = None

    @classmethod
    def here(cls) -> Origin | None:
        """This process's, or None where ``/proc`` does not tell."""
        try:
            return cls(BOOT_ID.read_text().strip(), os.getpid(), _started(os.getpid()))
        except (OSError, ValueError, IndexError):
            return None

    def is_local(self) -> bool:
        """Whether this process runs on the same machine and sees that process under its pid:
        the same kernel, and the pid's process started when it did (in another container's pid
        namespace the same number names another process, or none)."""
        try:
            return self.boot_id == BOOT_ID.read_text().strip() and _started(self.pid) == self.started
        except (OSError, ValueError, IndexError):
            return False


def _started(pid: int) -> int:
    return int(proc_stat_fields(pid)[19])


class _ReplicaClient(InprocClient):
    """``InprocClient`` that tells the replica once each step's outputs are in their streams."""

    after_dispatch: Callable[[list[RequestOutput]], None] | None = None

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        super()._dispatch(outputs)
        if self.after_dispatch is not None:
            self.after_dispatch(outputs)


@dataclass
class _Outbox:
    """The requests one server process started here, those with output to hand over (``ready``),
    and the ``outputs`` call that reads them (``reader``: None while none does)."""

    streams: dict[str, RequestStream] = field(default_factory=dict)
    ready: set[str] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    reader: object | None = None
    reaper: asyncio.TimerHandle | None = None


def _unnice() -> None:
    """Bring the calling thread to niceness 0 if Ray started this worker nicer (a cluster
    started without ``RAY_worker_niceness=0``; Ray's default is 15), so that the server
    process and Ray's daemons do not preempt the engine; where that is not permitted, say so."""
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    if niceness <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)  # on Linux, the calling thread and those it starts
    except OSError as exc:
        log.warning(
            "engine replica runs at niceness %d (%s): start the Ray cluster with RAY_worker_niceness=0",
            niceness,
            exc,
        )


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
        _unnice()  # before the engine's threads start: they inherit this thread's niceness
        from rill.models import qkernel  # here, not at the top: the server process imports this module

        qkernel.share_cores()  # Ray's daemons (and the server process) preempt the engine's threads
        self.client = _ReplicaClient.start(config, policy=SubmissionPolicy(engine=config))
        self.client.after_dispatch = self._wake
        self._outboxes: dict[str, _Outbox] = {}
        self._outbox_of: dict[str, str] = {}  # request id -> the server process it belongs to
        self._linked = 0  # outputs streams whose batches go over a local socket now
        # Ray counts the replica as started when this returns: only with its model loaded.
        await self.client.wait_ready()
        freeze_startup_objects()
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

    async def start(
        self, choice: Choice, *, prefix_keys: list[int], pinned: bool = False, frontend: str
    ) -> Accepted | Refused:
        """Start ``choice`` for server process ``frontend``; its outputs go to that process's
        ``outputs`` stream. ``prefix_keys`` and ``pinned`` are the router's."""
        try:
            stream = await self.client.start_choice(choice)
        except RillError as exc:
            return Refused(exc)
        outbox = self._outboxes.setdefault(frontend, _Outbox())
        outbox.streams[choice.request_id] = stream
        outbox.ready.add(choice.request_id)
        self._outbox_of[choice.request_id] = frontend
        if outbox.reader is None and outbox.reaper is None:
            # Its server process reads from here once this answer lands; one that never does
            # (it died, or its caller left and the abort was lost) must not leave its requests here.
            outbox.reaper = asyncio.get_running_loop().call_later(
                UNREAD_OUTBOX_S, lambda: asyncio.ensure_future(self._reap(frontend, outbox))
            )
        return Accepted(self.replica)

    async def _reap(self, frontend: str, outbox: _Outbox) -> None:
        """Cancel the requests of an outbox no server process has read for ``UNREAD_OUTBOX_S``."""
        outbox.reaper = None
        if outbox.reader is not None or self._outboxes.get(frontend) is not outbox:
            return
        log.warning(
            "engine replica %s: no server process read %d request(s); cancelled", self.replica, len(outbox.streams)
        )
        del self._outboxes[frontend]
        await self._close(outbox)

    async def _close(self, outbox: _Outbox) -> None:
        for request_id, stream in list(outbox.streams.items()):  # (each close awaits)
            self._outbox_of.pop(request_id, None)
            await stream.aclose()  # cancels a request still running
        outbox.streams.clear()

    def _wake(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            frontend = self._outbox_of.get(output.request_id)
            if frontend is not None:
                outbox = self._outboxes[frontend]
                outbox.ready.add(output.request_id)
                outbox.wake.set()

    async def outputs(
        self, frontend: str, *, replica: str, origin: Origin | None = None, secret: str | None = None
    ) -> AsyncIterator[list[RequestOutput] | link.Linked]:
        """The outputs of every request ``frontend`` started here, one batch per engine step of
        the requests that made output (an empty batch first, at once, so the server process
        knows the replica answers). A server process on this machine that names a socket in
        ``origin`` and gives a ``secret`` gets its batches there instead (``rill.cluster.link``):
        the first item is then ``Linked`` and no other follows. Leaving the stream, or closing
        that socket (the server process went away, or closed it), cancels those requests; a
        later call for the same process takes them over. While the stream is open, the CPU of
        ``origin`` (the server process), if it runs on this machine, counts as the engine's own
        (see the module docstring)."""
        outbox = self._outboxes.setdefault(frontend, _Outbox())
        token = outbox.reader = object()  # a later call for the same process takes the outbox over
        if outbox.reaper is not None:
            outbox.reaper.cancel()
            outbox.reaper = None
        unally = self._ally(origin)
        writer = None
        try:
            if secret is not None and origin is not None and origin.outputs_address and origin.is_local():
                writer = await link.connect(origin.outputs_address, secret)
                if writer is not None:
                    self._linked += 1
            # At once: the server process knows this replica answers, and where its batches come.
            yield [] if writer is None else link.Linked()
            while True:
                if not outbox.ready:
                    outbox.wake.clear()
                    await outbox.wake.wait()
                if outbox.reader is not token:
                    return  # a later call took the outbox over: it hands these over
                ready, outbox.ready = outbox.ready, set()
                batch: list[RequestOutput] = []
                for request_id in ready:
                    stream = outbox.streams.get(request_id)
                    output = stream.get_nowait() if stream is not None else None
                    if output is None:
                        continue
                    batch.append(output)
                    if output.finished:
                        del outbox.streams[request_id]
                        self._outbox_of.pop(request_id, None)
                        await stream.aclose()  # type: ignore[union-attr]  # output is not None
                if not batch:
                    continue
                if writer is None:
                    yield batch
                    continue
                try:
                    await link.write_batch(writer, batch)
                except ConnectionError:
                    return  # the server process closed the socket: it is gone
        finally:
            if writer is not None:
                writer.close()
                self._linked -= 1
            unally()
            if outbox.reader is token:  # else a later call reads it now
                outbox.reader = None
                self._outboxes.pop(frontend, None)
                await self._close(outbox)

    def _ally(self, origin: Origin | None) -> Callable[[], None]:
        """Have the engine's thread governor count ``origin``'s CPU as its own if it runs on this
        machine; returns what undoes that."""
        engine = self.client.engine
        governor: ThreadGovernor | None = engine.core.thread_governor if engine is not None else None
        if governor is None or origin is None or not origin.is_local():
            return lambda: None
        governor.ally(origin.pid)
        log.info("engine replica %s counts its server process (pid %d) as its own CPU", self.replica, origin.pid)
        return lambda: governor.forget(origin.pid)

    async def control(self, op: str, request_id: str, *, replica: str) -> Refused | None:
        """Apply one of ``CONTROLS`` to a request running here (``replica`` routes the call)."""
        if op not in CONTROLS:
            return Refused(RillError(f"unknown control {op!r}"))
        try:
            # Each by name, not looked up: mypy then sees every call (an async one must be awaited).
            if op == "abort":
                self.client.abort(request_id)
            elif op == "pause":
                self.client.pause(request_id)
            elif op == "resume":
                self.client.resume(request_id)
            else:
                await self.client.regenerate(request_id)
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
        return msgspec.structs.replace(self.client.stats(), linked_frontends=self._linked)

    def check_health(self) -> None:
        """Ray's health check: raise once the engine has stopped (Ray then replaces the replica)."""
        error = self.client.state().error
        if error is not None:
            raise error
