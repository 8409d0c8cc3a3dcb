"""One Evergreen session at work: the pure ``EvergreenSession`` on a session ``Driver``
(``protocols/_shared/driver.py``), shared by the gRPC and WebSocket transports (``adapter``).

The driver runs the actions' requests (submission under the principal, the rejection metric,
the outputs fed to the session); what is Evergreen's own is here:

* the session is made at the first message, once the model is ready (it needs the model's
  name and template); what it holds is charged to the session-memory budget under the
  principal, and all of it given back when the session ends;
* each inbound message is decoded and taken by the session (storing fragments, expanding the
  inputs of the actions it starts) in a worker thread, so a 4 MiB message never stalls the
  event loop; the driver holds the same session lock for its own calls, so the session sees
  one caller at a time;
* a started action (``Generate``) is a driver start whose request is prepared first: its file
  refs read (``file_refs.read_refs``) and its prompt built, both in a worker thread;
* the runner is the driver's transport: what the session sends goes into ``outbox``, which
  the wire drains until ``DONE`` (the session closed) or the error that aborts the session.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rill.errors import RillError
from rill.protocols._shared.driver import Driver
from rill.protocols.evergreen import codec
from rill.protocols.evergreen.file_refs import read_refs
from rill.protocols.evergreen.messages import SessionMessage
from rill.protocols.evergreen.session import AbortSession, EvergreenSession, Generate, ModelFacts, SessionLimits
from rill.types import GenerateRequest

if TYPE_CHECKING:
    from rill.deps import Deps

log = logging.getLogger("rill.protocols.evergreen")

DONE = object()
"""Outbox marker: the session ended normally."""


def session_limits(deps: Deps) -> SessionLimits:
    """The per-session limits and file roots (their real paths) from the server config."""
    e = deps.config.evergreen
    roots = tuple(os.path.realpath(r) for r in e.evergreen_file_root)
    return SessionLimits(
        max_depth=e.evergreen_max_depth,
        max_nodes=e.evergreen_max_nodes,
        max_bytes=e.evergreen_max_bytes,
        max_actions=e.evergreen_max_actions,
        max_fragments=e.evergreen_max_fragments,
        max_id_bytes=e.evergreen_max_id_bytes,
        max_prompt_bytes=e.evergreen_max_prompt_bytes,
        request_timeout_s=deps.config.policy.request_timeout_s,
        file_roots=roots,
    )


def model_facts(deps: Deps) -> ModelFacts:
    """What the session knows of the model (the model must be loaded)."""
    info = deps.client.model_info
    if info is None:
        return ModelFacts(name=deps.client.served_model_name)
    return ModelFacts(name=info.name, has_chat_template=info.has_chat_template, modalities=tuple(info.modalities))


class SessionRunner:
    """Runs one session (see the module docstring); the wire feeds it and drains ``outbox``."""

    def __init__(self, deps: Deps, principal: str) -> None:
        self.deps = deps
        self.principal = principal
        self.outbox: asyncio.Queue[Any] = asyncio.Queue()
        self.session: EvergreenSession | None = None
        self.driver: Driver | None = None
        self.is_over = False
        self._lock = asyncio.Lock()  # the session's: held by every call into it, one may run in a thread
        self._lease = deps.memory.lease(principal) if deps.memory is not None else None
        self._own_actions: dict[type, Callable[[Any], None]] = {Generate: self._start, AbortSession: self._abort}

    async def feed(self, message: Any, decode: Callable[[Any], SessionMessage] | None = None) -> None:
        """Hand one inbound message to the session; a broken rule aborts the session.

        With ``decode``, ``message`` is the wire's form (a protobuf, JSON text), decoded in the
        worker thread too; a decoding error aborts the session.
        """
        if self.is_over:
            return
        try:
            session, driver = await self._open()
            async with self._lock:
                actions = await asyncio.to_thread(_decode_and_receive, session, message, decode)
        except Exception as exc:  # noqa: BLE001 - every failure aborts the session (spec "Error handling")
            await self.fail(exc, is_refused=True)
            return
        await driver.perform(actions)

    async def input_ended(self) -> None:
        """The client half-closed: no more input will come."""
        if self.is_over:
            return
        try:
            session, driver = await self._open()
            async with self._lock:
                actions = session.on_input_end()
        except Exception as exc:  # noqa: BLE001 - an action still waiting for input aborts the session
            await self.fail(exc, is_refused=True)
            return
        await driver.perform(actions)

    async def fail(self, exc: BaseException, *, is_refused: bool = False) -> None:
        """Abort the session with ``exc``'s status. ``is_refused``: the client's input was at
        fault (a broken rule, a message that cannot be read): counted as a rejection."""
        if self.is_over:
            return
        if not isinstance(exc, RillError):
            log.error("evergreen session failed", exc_info=exc)
        if self.session is None or self.driver is None:
            # Before the first message is taken there is no session and nothing runs.
            if is_refused:
                self._count_rejection(exc)
            self._end(exc)
            return
        async with self._lock:
            actions = self.session.on_refused(exc) if is_refused else self.session.on_error(exc)
        await self.driver.perform(actions)

    async def aclose(self) -> None:
        """End the session (normally, cancelled, disconnected): abort every request, drop what
        the session and the outbox hold and give its memory back to the budget."""
        self.is_over = True
        if self.driver is not None:
            await self.driver.aclose()
        # The runner may outlive the call (a reference held by a finished task or a traceback):
        # drop the session's store and the unsent messages now, not whenever it is collected.
        self.session = self.driver = None
        while not self.outbox.empty():
            self.outbox.get_nowait()
        if self._lease is not None:
            self._lease.close()

    # -- the driver's transport ------------------------------------------------------------------
    async def send(self, message: Any) -> None:
        """Queue ``message`` for the wire (nothing is queued once the session is over)."""
        if not self.is_over:
            self.outbox.put_nowait(message)

    async def close(self, code: int | None, reason: str) -> None:
        """The session closed: the wire ends normally (gRPC status OK, WebSocket close 1000)."""
        self._end(DONE)

    async def perform(self, action: Any) -> None:
        """Evergreen's own actions: start an action (``Generate``), or abort the session."""
        if not self.is_over:
            self._own_actions[type(action)](action)

    # -- internals --------------------------------------------------------------------------------
    async def _open(self) -> tuple[EvergreenSession, Driver]:
        if self.session is None or self.driver is None:
            await self.deps.client.wait_ready()  # the session needs the model's name and template
            self.session = EvergreenSession(
                session_limits(self.deps),
                model_facts(self.deps),
                charge=self._lease.grow if self._lease is not None else None,
            )
            self.driver = Driver(
                self.session,
                self,
                self.deps.client,
                protocol=codec.PROTOCOL_NAME,
                principal=self.principal,
                metrics=self.deps.metrics,
                session_lock=self._lock,
            )
        return self.session, self.driver

    def _start(self, command: Generate) -> None:
        assert self.session is not None and self.driver is not None  # the session started it
        self.driver.start(functools.partial(self._prepare, self.session, command), command.action_id)

    async def _prepare(self, session: EvergreenSession, command: Generate) -> GenerateRequest:
        # Reading files blocks, and joining and decoding a large prompt takes time: both run
        # in a worker thread; the session's own bookkeeping around them holds its lock.
        refs: dict[str, bytes] = {}
        if command.refs:
            async with self._lock:
                budget = session.ref_budget(command)
            refs, num_read_bytes = await asyncio.to_thread(read_refs, command.refs, session.limits.file_roots, budget)
            async with self._lock:
                session.count_refs(command, refs, num_read_bytes)
        return await asyncio.to_thread(session.request_for, command, refs)

    def _abort(self, action: AbortSession) -> None:
        self._end(action.error)

    def _end(self, item: Any) -> None:
        # The wire stops at the first end it drains; nothing is queued after it.
        if not self.is_over:
            self.is_over = True
            self.outbox.put_nowait(item)

    def _count_rejection(self, exc: BaseException) -> None:
        if self.deps.metrics is not None:
            code = exc.code if isinstance(exc, RillError) else RillError.code
            self.deps.metrics.observe_rejection(protocol=codec.PROTOCOL_NAME, code=code)


def _decode_and_receive(
    session: EvergreenSession, message: Any, decode: Callable[[Any], SessionMessage] | None
) -> list[Any]:
    # Runs in a worker thread, under the session's lock.
    return session.receive(decode(message) if decode is not None else message)
