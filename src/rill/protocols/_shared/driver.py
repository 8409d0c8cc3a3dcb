"""The session driver: the engine plumbing every protocol adapter shares, written once.

A protocol is four parts: its messages, its codec, a pure session and a small adapter. The
session decides (it answers every input with a list of actions); the adapter owns its
transport (the handshake, the read loop, framing, the actions only its wire has); this
driver performs what means the same on every wire:

* ``Send``: hand the message to the transport (which encodes and writes it);
* ``Start``: submit the request under the connection's principal (after waiting for the
  model when the protocol reports loading), count a refusal in the rejection metric, tell the
  session it started (``on_started``) or failed (``on_start_failed``), then pump the
  request's outputs into ``on_output`` until it finishes (or until the server's time limit,
  where the protocol has one: ``time_limit_s``); an adapter whose request must be built with
  I/O first (files read, a large prompt joined off the event loop) starts a ``Prepare``
  instead, built in the request's task and failing like a refusal; with ``submits_together``
  the ``Start``s of one ``perform`` are submitted there, in order, and their refusals reported
  in one ``on_starts_failed`` call (batch ``/ws``: one ERROR array per message);
* ``Abort``: abort the request of a key (its final output still comes back), or cancel the
  start that is still waiting for the model or its submission;
* ``Rejected``: count a refusal the session made itself (a bad frame);
* ``Close``: ask the transport to close;
* anything else: the transport's ``perform`` (``/generate``'s ``Pause``, chat's ``Speak``...).

``aclose()`` ends the connection's requests at once: closing a ``RequestStream`` aborts its
request in the engine, which frees its KV memory at the next step.

The driver does no protocol decision and no I/O of its own; it never imports a protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, cast

import msgspec

from rill.errors import RequestTimeout, RillError
from rill.frontend.client import EngineClient
from rill.frontend.stream import RequestStream
from rill.protocols._shared.actions import Abort, Close, Rejected, Send, Start
from rill.protocols._shared.session import Key, Session, Started, StepSession, split_by_token
from rill.types import GenerateRequest, RequestOutput

log = logging.getLogger("rill.protocols.driver")

LOADING_STATUS_PERIOD_S = 0.5
"""How often a start that waits for the model reports the loading progress."""

QUEUE_STATUS_PERIOD_S = 0.5
"""How often a waiting request's place in the queue is looked at (reported only when it changes)."""


Prepare = Callable[[], Awaitable[GenerateRequest]]
"""Builds a request that needs I/O first; ``Driver.start`` awaits it in the request's own task."""


class Gone(Exception):
    """Raised by a transport's ``send`` once the peer has left: stop sending."""


class Transport(Protocol):
    """The adapter's side: the wire."""

    async def send(self, message: Any) -> None:
        """Encode and write one message; raise ``Gone`` when the peer has left."""
        ...

    async def close(self, code: int | None, reason: str) -> None:
        """Close the connection once what was sent is flushed."""
        ...

    async def perform(self, action: Any) -> None:
        """Carry out an action only this wire has."""
        ...


class RejectionSink(Protocol):
    """Counts refused requests (``rill.frontend.metrics.Metrics``)."""

    def observe_rejection(self, *, protocol: str, code: str) -> None:
        """Count one refusal of ``protocol`` with error ``code``."""
        ...


class Driver:
    """Performs a session's shared actions and runs its requests (see the module docstring).

    Args:
        session: the pure session.
        transport: the adapter's wire.
        client: the engine client.
        protocol: the protocol's name, for the rejection metric.
        principal: who the connection acts for; every request is submitted under it.
        metrics: counts refusals; None counts nothing.
        waits_for_model: a start waits for the model to load (reporting ``on_loading``)
            instead of being refused with ``ModelNotReady``.
        reports_queue: while a request waits in the engine's queue, report its place
            (``on_queued``) whenever it changes; a request alone in the queue is not reported.
        groups_steps: the session is a ``StepSession``: outputs are gathered per key and
            handed over together, one call per wake-up.
        one_event_per_token: a coalesced output is split into one output per token
            (``split_by_token``) before the session sees it.
        submits_together: the ``Start``s of one ``perform`` call are submitted in order before
            it returns (the read loop waits meanwhile), and those refused are handed to
            ``on_starts_failed`` in one call once the whole list was performed; each accepted
            one is then pumped in its own task (a time limit counts from its submission).
        time_limit_s: a request still running this long after the model was ready for it
            (submission and outputs) is ended: its stream is closed (aborting it in the
            engine) and the session hears ``RequestTimeout``, through ``on_start_failed``
            before it started, else as a finished output with ``finish_reason`` "error", as
            when the engine enforces a request's ``deadline_s``. None: no limit.
        clock: the time passed to the session (``time.monotonic``).
        session_lock: held around every call into the session, for an adapter that also calls
            its session from a worker thread (holding the same lock), so the session sees one
            caller at a time; None: the session is only called on the event loop.
    """

    def __init__(
        self,
        session: Session,
        transport: Transport,
        client: EngineClient,
        *,
        protocol: str,
        principal: str,
        metrics: RejectionSink | None = None,
        waits_for_model: bool = False,
        reports_queue: bool = False,
        groups_steps: bool = False,
        one_event_per_token: bool = False,
        submits_together: bool = False,
        time_limit_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        session_lock: asyncio.Lock | None = None,
    ) -> None:
        self.session = session
        self.transport = transport
        self.client = client
        self.protocol = protocol
        self.principal = principal
        self.metrics = metrics
        self.waits_for_model = waits_for_model
        self.reports_queue = reports_queue
        self.groups_steps = groups_steps
        self.one_event_per_token = one_event_per_token
        self.submits_together = submits_together
        self.time_limit_s = time_limit_s
        self.clock = clock
        self.session_lock = session_lock
        self.streams: dict[Key, RequestStream] = {}
        self.tasks: dict[Key, asyncio.Task[None]] = {}
        self.is_closed = False
        self._slots: dict[Key, RequestOutput] = {}
        self._wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._reporters: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references

    # -------------------------------------------------------------- actions
    async def perform(self, actions: Sequence[Any]) -> None:
        """Carry out ``actions`` in order."""
        refused: list[tuple[Key, BaseException]] = []
        for action in actions:
            if isinstance(action, Send):
                await self.transport.send(action.message)
            elif isinstance(action, Start) and self.submits_together:
                outcome = await self._submit(action.request, action.key)
                if isinstance(outcome, Exception):
                    refused.append((action.key, outcome))
                elif outcome is not None:
                    self.tasks[action.key] = asyncio.create_task(self._run(action.key, action.request, outcome))
            elif isinstance(action, Start):
                self.start(action.request, action.key)
            elif isinstance(action, Abort):
                self.abort(action.key)
            elif isinstance(action, Rejected):
                self.count_rejection(action.code)
            elif isinstance(action, Close):
                await self.transport.close(action.code, action.reason)
            else:
                await self.transport.perform(action)
        if refused:
            for _, exc in refused:
                self._note_refusal(exc)
            await self._ask(self.session.on_starts_failed, refused, self.clock())

    def start(self, request: GenerateRequest | Prepare, key: Key = None) -> None:
        """Run ``request`` as ``key`` in its own task: build it (a ``Prepare``), submit it,
        then pump its outputs. ``abort(key)`` cancels a start still being built."""
        self.tasks[key] = asyncio.create_task(self._run(key, request))

    async def submit(self, request: GenerateRequest | Prepare, key: Key = None) -> RequestStream | None:
        """Submit ``request`` (built first if it is a ``Prepare``) under the principal; on
        success the session hears ``on_started`` and the stream is the key's, else (a refusal,
        or a ``Prepare`` that raised) it hears ``on_start_failed`` and this returns None."""
        outcome = await self._submit(request, key)
        if isinstance(outcome, Exception):
            await self._refuse(key, outcome)
            return None
        return outcome

    async def _submit(self, request: GenerateRequest | Prepare, key: Key) -> RequestStream | Exception | None:
        # ``submit`` but a refusal is returned, neither counted nor told to the session.
        try:
            if not isinstance(request, GenerateRequest):
                request = await request()
            if self.waits_for_model:
                await self._wait_for_model()
            stream = await self.client.generate(msgspec.structs.replace(request, principal=self.principal))
        except (Gone, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - refusals are answered in the protocol's own format
            return exc
        if self.is_closed:  # the peer left while the request was being submitted
            await stream.aclose()
            return None
        self.streams[key] = stream
        try:
            await self._ask(self.session.on_started, Started(key, stream.prompt_token_ids, stream.sampling))
        except BaseException:  # the peer left (or a bug) before the pump took the stream over
            if self.streams.get(key) is stream:
                del self.streams[key]
            await stream.aclose()
            raise
        return stream

    async def pump(self, stream: RequestStream, key: Key = None) -> None:
        """Feed ``stream``'s outputs to the session until it finishes; a stream that breaks
        is reported as a finished output with ``finish_reason`` "error"."""
        scheduled = asyncio.Event()  # set at the first output: the engine took the request
        if self.reports_queue:
            reporter = asyncio.create_task(self._report_queue(stream, key, scheduled))
            self._reporters.add(reporter)
            reporter.add_done_callback(self._reporters.discard)
        try:
            async with stream:  # leaving early (close, cancel) aborts the request
                async for output in stream:
                    scheduled.set()
                    await self._deliver(key, output)
                    if output.finished:
                        break
        except (Gone, asyncio.CancelledError):
            raise
        except Exception as exc:  # a broken stream ends this request only
            log.exception("%s: stream of %s failed", self.protocol, stream.request_id)
            await self._deliver(
                key, RequestOutput(request_id=stream.request_id, finished=True, finish_reason="error", error=exc)
            )
        finally:
            scheduled.set()
            if self.streams.get(key) is stream:
                del self.streams[key]

    def abort(self, key: Key = None) -> None:
        """Abort the request of ``key``: its final output still comes back. A start still
        waiting for the model or its submission is cancelled instead."""
        stream = self.streams.get(key)
        if stream is not None:
            if not stream.is_finished:
                stream.abort()
            return
        task = self.tasks.get(key)
        if task is not None and not task.done():
            task.cancel()

    def stream(self, key: Key = None) -> RequestStream | None:
        """The running request of ``key``, if any (for a wire's own controls)."""
        return self.streams.get(key)

    def count_rejection(self, code: str) -> None:
        """Count one refusal in the rejection metric."""
        if self.metrics is not None:
            self.metrics.observe_rejection(protocol=self.protocol, code=code)

    async def aclose(self) -> None:
        """End every request of the connection now (freeing their KV memory) and the tasks."""
        self.is_closed = True
        streams = list(self.streams.values())
        for stream in streams:
            await stream.aclose()
        current = asyncio.current_task()
        tasks = [t for t in [*self.tasks.values(), self._flusher] if t is not None and t is not current]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    async def wait(self) -> None:
        """Wait until every started request has ended (a whole-response wire: REST, SSE)."""
        while True:
            tasks = [t for t in self.tasks.values() if not t.done()]
            if not tasks:
                return
            await asyncio.wait(tasks)

    # -------------------------------------------------------------- internals
    async def _run(self, key: Key, request: GenerateRequest | Prepare, stream: RequestStream | None = None) -> None:
        # Submits ``request`` and pumps it, or pumps ``stream`` where it was submitted already.
        try:
            if self.time_limit_s is not None:
                await self._run_limited(key, request, self.time_limit_s, stream)
            elif stream is not None or (stream := await self.submit(request, key)) is not None:
                await self.pump(stream, key)
        except (Gone, asyncio.CancelledError):
            return  # the peer left, or the start was aborted: aclose()/abort() did the rest
        except Exception as exc:  # a bug in a session or transport: the connection fails
            log.exception("%s: request %s failed", self.protocol, key)
            with contextlib.suppress(Gone):
                await self._ask(self.session.on_error, exc)
        finally:
            if self.tasks.get(key) is asyncio.current_task():
                del self.tasks[key]

    async def _ask(self, hook: Callable[..., list[Any]], *args: Any) -> None:
        # The session answers under its lock; its actions are performed after the lock is
        # released, so a slow send never holds up the adapter's own calls into the session.
        if self.session_lock is None:
            actions = hook(*args)
        else:
            async with self.session_lock:
                actions = hook(*args)
        await self.perform(actions)

    async def _run_limited(
        self, key: Key, request: GenerateRequest | Prepare, limit_s: float, stream: RequestStream | None
    ) -> None:
        # The limit counts from when the model is ready: a request sent while it loads gets
        # its whole time once it can run, as it would from the engine's own deadline.
        if stream is None and self.waits_for_model and not await self._ready(key):
            return
        try:
            async with asyncio.timeout(limit_s):
                if stream is None:
                    stream = await self.submit(request, key)
                if stream is not None:
                    await self.pump(stream, key)  # cancelled by the limit: leaving it closes the stream
        except TimeoutError:
            exc = RequestTimeout(f"the generation ran past the server's time limit of {limit_s:g} s")
            if stream is None:
                await self._ask(self.session.on_start_failed, key, exc, self.clock())
            else:
                await self._deliver(
                    key, RequestOutput(request_id=stream.request_id, finished=True, finish_reason="error", error=exc)
                )

    async def _ready(self, key: Key) -> bool:
        """Wait for the model; False (the session was told why) when it will not come."""
        try:
            await self._wait_for_model()
        except (Gone, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - answered in the protocol's own format
            await self._refuse(key, exc)
            return False
        return True

    async def _refuse(self, key: Key, exc: Exception) -> None:
        self._note_refusal(exc)
        await self._ask(self.session.on_start_failed, key, exc, self.clock())

    async def _deliver(self, key: Key, output: RequestOutput) -> None:
        if self.groups_steps:
            pending = self._slots.get(key)
            self._slots[key] = output if pending is None else pending.merge(output)
            self._wake.set()
            if self._flusher is None:
                self._flusher = asyncio.create_task(self._flush_steps())
            return
        for piece in split_by_token(output) if self.one_event_per_token else (output,):
            await self._ask(self.session.on_output, key, piece, self.clock())

    async def _flush_steps(self) -> None:
        # Runs for the whole connection: a peer that left stops it quietly (the adapter's read
        # loop sees the leaving), a bug in the session fails the connection as ``_run`` does.
        try:
            await self._flush_forever(cast(StepSession, self.session))
        except Gone:
            return
        except Exception as exc:  # a bug in a session or transport: the connection fails
            log.exception("%s: handing over a step's outputs failed", self.protocol)
            with contextlib.suppress(Gone):
                await self._ask(self.session.on_error, exc)

    async def _flush_forever(self, session: StepSession) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            # Every stream of one engine step was filled in one loop callback and their pumps
            # ran before this task woke, so this drain groups that step's outputs.
            drained, self._slots = self._slots, {}
            if self.one_event_per_token:
                # One group per token position: a request whose reader lagged gets one event
                # per token, beside the other requests' tokens of the same position.
                pieces = {key: split_by_token(output) for key, output in drained.items()}
                depth = max((len(p) for p in pieces.values()), default=0)
                groups = [[(key, p[i]) for key, p in pieces.items() if i < len(p)] for i in range(depth)]
            else:
                groups = [list(drained.items())] if drained else []
            for group in groups:
                await self._ask(session.on_outputs, group, self.clock())

    async def _wait_for_model(self) -> None:
        client = self.client
        while (state := client.state()).phase == "loading":
            await self._ask(self.session.on_loading, state.progress or 0.0, state.eta_s)
            with contextlib.suppress(TimeoutError, RillError):  # the next state() says which
                async with asyncio.timeout(LOADING_STATUS_PERIOD_S):
                    await asyncio.shield(client.wait_ready())
        if state.error is not None:  # the load failed, or the engine has stopped: for good
            raise state.error

    async def _report_queue(self, stream: RequestStream, key: Key, scheduled: asyncio.Event) -> None:
        # Never cancelled mid-send (that could cut a frame): it stops at its next wait once
        # ``scheduled`` is set.
        last: tuple[int, int] | None = None
        with contextlib.suppress(Gone):
            while not scheduled.is_set() and (place := self.client.queue_position(stream.request_id)) is not None:
                if place != last and (last is not None or place[1] > 1):
                    last = place
                    await self._ask(self.session.on_queued, key, *place)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(QUEUE_STATUS_PERIOD_S):
                        await scheduled.wait()

    def _note_refusal(self, exc: BaseException) -> None:
        if not isinstance(exc, RillError):
            log.error("%s: a request failed at submission", self.protocol, exc_info=exc)
        self.count_rejection(self.session.refusal_code(exc))
