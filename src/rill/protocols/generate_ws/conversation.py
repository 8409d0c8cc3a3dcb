"""One ``/generate`` conversation, apart from the client end that speaks to it.

A ``Conversation`` is a session on its session driver (``protocols/_shared/driver``), the
actions only this wire has (pause, resume, modify, regenerate, feedback) and where what it
sends goes. A ``ClientEnd`` is the socket (or REST reply, or SSE stream) of one client; the
adapter reads its frames and hands them to ``end.conversation``.

Resume: while a resumable generation runs, what the conversation sends is recorded
(``_shared/resume.StreamWriter``) in a stream of the server's registry
(``rill.frontend.resumable``), which the client end follows. When that end goes away the
conversation runs on; a ``resume`` from a new end of the same owner (``rill.auth.owner``)
moves the new end to it (``take_over``: the messages it missed, then live, and its controls
steer the generation from then on). The registry's grace timer ends a conversation no one
came back to, which aborts its request and frees its KV memory; ``service.live`` finds a
running one by id.

Not pure (``NOT_PURE`` in ``tests/protocols/test_purity.py``): it runs requests on the engine
client and tasks that follow a stream. The sockets and HTTP are ``adapter.py``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rill import auth
from rill.errors import InvalidRequest, PositionOutOfRange, RequestNotFound, ResumeExpired, RillError
from rill.frontend.resumable import ResumableStream
from rill.protocols._shared.driver import Driver, Transport
from rill.protocols._shared.resume import StreamWriter
from rill.protocols.generate_ws import codec, transcript
from rill.protocols.generate_ws import messages as m
from rill.protocols.generate_ws import session as s
from rill.protocols.generate_ws.service import GenerateService

log = logging.getLogger("rill.protocols.generate_ws")

Write = Callable[[m.ServerMessage], Awaitable[None]]
"""Writes one message to a conversation's peer (raises ``Gone`` once the peer has left)."""

TAKEN_OVER_CLOSE_CODE = 4000
"""The close code of a socket whose generation another connection resumed."""


class ClientEnd:
    """One client's end (a socket, one REST reply, one SSE stream). ``write`` raises ``Gone``
    once it has left; ``close`` (a socket's) takes a WebSocket close code. ``conversation`` is
    the one it speaks to: a ``resume`` may move it to another."""

    conversation: Conversation

    def __init__(self, write: Write, close: Callable[[int, str], Awaitable[None]] | None = None) -> None:
        self._write = write
        self._close = close

    async def write(self, message: m.ServerMessage) -> None:
        """Write one message (``Gone`` once the client has left)."""
        await self._write(message)

    async def close(self, code: int, reason: str) -> None:
        """Close the socket (a REST reply ends with its generation instead)."""
        if self._close is not None:
            await self._close(code, reason)


class Conversation(Transport):
    """One conversation: its session, the session's driver, the actions only ``/generate``
    has, and where what it sends goes (``writer``: to its peer, or recorded while a resumable
    generation runs)."""

    def __init__(self, service: GenerateService, peer: ClientEnd, api_key: str | None, principal: str) -> None:
        self.service, self.api_key, self.principal = service, api_key, principal
        self.owner = auth.owner(principal)  # who may resume its generations
        self.session = service.new_session()
        self.history = service.history(principal, self.session)
        self.is_closed = False
        self._transcript = transcript.Transcript()
        self.writer: StreamWriter[m.ServerMessage, transcript.Entry, ClientEnd] = StreamWriter(
            self._to_entry, transcript.message, self._lost
        )
        self.writer.peer = peer
        peer.conversation = self
        # Outputs reach the session whole (no one_event_per_token): it sends one token per
        # token itself, and needs a folded output's events beside its tokens to order them
        # (a resume before the tokens after it, a restart's stale tokens before the new init)
        # and to spread the output's time over its tokens.
        self.driver = Driver(
            self.session,
            self,
            service.client,
            protocol=s.PROTOCOL,
            principal=principal,
            metrics=service.deps.metrics,
            waits_for_model=True,
            reports_queue=True,
            time_limit_s=service.deps.config.policy.request_timeout_s,
        )
        self._handlers: dict[type, Callable[[Any], Awaitable[None]]] = {
            s.Pause: self._control,
            s.Resume: self._control,
            s.Regenerate: self._control,
            s.Modify: self._modify,
            s.StoreFeedback: self._store_feedback,
            s.Record: self._record,
            s.StopRecording: self._stop_recording,
            s.Attach: self._attach,
        }

    async def receive_text(self, text: str | bytes) -> None:
        """One frame from the client (JSON text, or the same as UTF-8 bytes)."""
        try:
            msg = codec.decode(text)
        except InvalidRequest as exc:
            await self.driver.perform(self.session.on_invalid(exc))
            return
        except Exception as exc:  # a decoder bug: the generic error frame, never a dead handler
            log.exception("a /generate frame could not be decoded")
            await self.driver.perform(self.session.on_error(exc))
            return
        await self.receive(msg)

    async def receive(self, msg: m.ClientMessage) -> None:
        """One decoded client message."""
        try:
            actions = self.session.receive(msg, time.monotonic())
        except Exception as exc:  # a session bug: the generic error frame (and close), logged
            log.exception("a /generate message could not be handled")
            actions = self.session.on_error(exc)
        await self.driver.perform(actions)

    async def send(self, message: m.ServerMessage) -> None:
        """Charge what the session remembers (it changes as generations end), then write (or
        record)."""
        self.history.charge()
        await self.writer.send(message)

    async def close(self, code: int | None, reason: str) -> None:
        """Close the socket once what was sent is written (a REST reply ends with its
        generation instead)."""
        await self.writer.drain()
        if (peer := self.writer.peer) is not None:
            await peer.close(1011 if code is None else code, reason)

    async def perform(self, action: Any) -> None:
        """A control of the running generation, a feedback write, or resume's bookkeeping."""
        await self._handlers[type(action)](action)

    async def detach(self, peer: ClientEnd) -> None:
        """``peer`` went away: a resumable generation runs on, waiting for a ``resume``; else
        the conversation ends. Nothing happens if another socket took it over meanwhile."""
        if self.writer.peer is not peer:
            return
        await self.writer.detach()
        if not self.session.outlives_disconnect:
            await self.shutdown()

    async def shutdown(self) -> None:
        """The conversation ends: stop whatever runs and give the memory back. An open
        transcript is dropped with it (its generation is aborted; no one can read on)."""
        if self.is_closed:
            return
        self.is_closed = True  # first: forgetting the stream below calls _expired
        await self.writer.detach()
        self.session.on_disconnect()
        await self.driver.aclose()
        self.history.close()
        if (stream := self.writer.end()) is not None:
            self.service.live.pop(stream.id, None)
            self.service.registry.forget(stream.id)

    # -- resume --------------------------------------------------------------------------
    def _to_entry(self, message: m.ServerMessage, index: int) -> tuple[transcript.Entry, int]:
        return self._transcript.entry(message, index)

    async def _record(self, action: s.Record) -> None:
        try:
            stream = self.service.registry.open(action.request_id, self.owner, charged_to=self.principal)
        except RillError as exc:  # the server keeps as many resumable streams as it may
            self.driver.count_rejection(self.session.refusal_code(exc))
            await self.driver.perform(self.session.on_start_failed(None, exc, time.monotonic()))
            return
        stream.cancel = self._expired
        self.service.live[action.request_id] = self
        self._transcript = transcript.Transcript()
        await self.writer.record(stream)
        await self.driver.perform(self.session.on_record_opened())

    async def _stop_recording(self, action: s.StopRecording) -> None:
        if (stream := self.writer.end()) is not None:
            self.service.live.pop(stream.id, None)
        if self.writer.peer is None:  # it ended with no one connected: nothing more can come
            await self.shutdown()

    def _expired(self) -> None:
        # The registry's grace period ended with no one reading: abort the request now (its
        # KV is freed at the next engine step), then end the conversation.
        if not self.is_closed:
            self.driver.abort()
            self.service.spawn(self.shutdown())

    async def _attach(self, action: s.Attach) -> None:
        request_id, after = action.request_id, action.last_index
        try:
            stream = self.service.registry.get(request_id, self.owner)
            try:
                stream.check_position(after)
            except PositionOutOfRange as exc:
                raise InvalidRequest(
                    f"last_index {after} is past the end of generation {request_id!r} "
                    f"(its last message so far has index {exc.last_position})",
                    field="last_index",
                ) from exc
        except RequestNotFound as exc:
            if not isinstance(exc, ResumeExpired):
                exc = codec.UnknownGeneration(f"no resumable generation {request_id!r}")
            await self.driver.perform(self.session.on_resume_failed(request_id, exc))
            return
        except InvalidRequest as exc:
            await self.driver.perform(self.session.on_resume_failed(request_id, exc))
            return
        peer = self.writer.peer
        owner: Conversation | None = self.service.live.get(request_id)
        if peer is None:
            return
        if owner is not None and owner is not self and not owner.is_closed:
            # It runs in another conversation: this socket moves there; this one (idle) ends.
            await self.writer.drain()
            await self.writer.detach()
            # The owner may have ended while this one awaited: then it refuses, and this
            # socket reads what it sent from here, as below.
            if await owner.take_over(peer, stream, after):
                await self.shutdown()
                return
        await self.writer.follow(peer, stream, after)  # it has ended: read what it sent

    async def take_over(self, peer: ClientEnd, stream: ResumableStream[transcript.Entry], after: int) -> bool:
        """``peer`` resumed this conversation's generation: it reads the transcript after
        ``after`` and steers from now on; a socket still attached is closed. False (and
        nothing changes) when this conversation has ended."""
        if self.is_closed:
            return False
        # No await between the check and the switch: the follower replaces the old peer's at
        # once, so the conversation never looks unattended meanwhile (which would end it).
        old = self.writer.peer
        peer.conversation = self
        await self.writer.follow(peer, stream, after)
        if old is not None and old is not peer:
            await old.close(TAKEN_OVER_CLOSE_CODE, "resumed on another connection")
        return True

    async def _lost(self, peer: ClientEnd, exc: ResumeExpired) -> None:
        # The socket read so slowly that the transcript dropped what it had not read yet.
        await peer.write(codec.error_message(exc, self.session.gen.request_id if self.session.gen else None))
        await peer.close(1008, "resume_expired")

    async def _control(self, action: s.Pause | s.Resume | s.Regenerate) -> None:
        if (stream := self.driver.stream()) is not None:
            try:
                if isinstance(action, s.Regenerate):
                    await stream.regenerate()  # its rate limits first: they may answer from elsewhere
                elif isinstance(action, s.Pause):
                    stream.pause()
                else:
                    stream.resume()
            except RillError as exc:  # e.g. the request finished meanwhile
                await self.driver.perform(self.session.on_invalid(exc))

    async def _modify(self, action: s.Modify) -> None:
        if (stream := self.driver.stream()) is None:
            return
        try:
            # Awaited here: the connection's next messages wait for a compile, so they apply in
            # the order they were sent.
            self.session.on_modify_applied(await stream.modify(action.patch))
        except RillError as exc:  # e.g. the request just ended, or the engine refused a value
            await self.driver.perform(self.session.on_modify_refused(exc))

    async def _store_feedback(self, action: s.StoreFeedback) -> None:
        try:
            feedback_id = await self.service.store_feedback(action.record, self.api_key, self.principal)
        except RillError as exc:
            await self.driver.perform(self.session.on_invalid(exc))
            return
        await self.driver.perform(self.session.on_feedback_stored(action.record["request_id"], feedback_id))
