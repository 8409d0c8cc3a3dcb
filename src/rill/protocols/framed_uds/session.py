"""Per-connection state machines of the Unix-socket protocol (sans-I/O).

Framed mode, one connection (``FramedSession``)::

    client                                server
    {"id","prompt",…}          ──▶        Start(GenerateRequest)           IDLE → ACTIVE
                               ◀──        token* (stream) … eos            ACTIVE → IDLE
    {"event":"cancel","id"}    ──▶        Abort; later eos "cancelled"     ACTIVE
    {"id","prompt"} (2nd)      ──▶        error E_PROTO_BUSY, close        ACTIVE → CLOSED
    {"type":"metrics"}         ──▶        metrics frame, close             * → CLOSED
    bad frame / JSON / field   ──▶        error E_PROTO_*, close           * → CLOSED

The spec's ``RECV_REQ → PREFILL → DECODE → STREAM → DONE|ERRORED`` collapses to IDLE (=
RECV_REQ), ACTIVE (prefill, decode and streaming happen in the engine) and CLOSED. After
``eos`` the connection takes the next request, as uma-serve's code does; with
``one_request`` (``--uds-one-request``) it closes instead, as Phase-1 of the spec says.

Newline mode (``NewlineSession``): each input line is a prompt; raw token text goes out and a
blank line ends each answer. Lines that arrive while one runs wait their turn.

Sessions return ``Action`` lists; the session driver (``protocols/_shared/driver``) performs
them in order, handing the adapter ``SendMetrics``. No ``await``, no clock, no engine import.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rill.errors import GenerationError, InvalidRequest, RillError
from rill.protocols._shared.actions import Abort, Close, Rejected, Send, Start
from rill.protocols._shared.session import Key, Session, Started
from rill.protocols.framed_uds import codec
from rill.protocols.framed_uds.messages import (
    Cancel,
    ClientMessage,
    Eos,
    Error,
    MetricsQuery,
    Request,
    ServerMessage,
    Token,
)
from rill.types import FinishReason, RequestOutput

# -- actions -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendMetrics:
    """Send the metrics frame built by ``codec.metrics_snapshot`` from the engine's stats."""


Action = Send[ServerMessage | bytes] | Start | Abort | SendMetrics | Rejected | Close
"""``Send``: a server message (framed mode) or raw bytes (newline mode). ``Start``: outputs go
to ``on_output``; a refusal by the engine to ``on_start_failed`` (the driver counts it under
``refusal_code``). ``Rejected``: a refusal of the session's own, counted under its wire code.
``Close``: flush, stop any running request, close."""


@dataclass(frozen=True, slots=True)
class SessionLimits:
    """Per-connection settings (from ``UdsConfig`` and ``HttpConfig``)."""

    one_request: bool = False
    request_timeout_s: float | None = None


class State(enum.Enum):
    """Connection states (see the module docstring)."""

    IDLE = "RECV_REQ"
    ACTIVE = "ACTIVE"
    CLOSED = "CLOSED"


@dataclass(slots=True)
class _Running:
    """The request in flight on a framed connection."""

    wire_id: str
    is_streaming: bool
    metadata: dict[str, Any] | None
    text_parts: list[str] | None = None  # stream: false collects the completion here
    is_started: bool = False  # the engine took it (on_started); before that a cancel is answered at once


# -- framed mode ---------------------------------------------------------------------------


class FramedSession(Session):
    """Sans-I/O state of one framed-JSON connection.

    Calling order: ``receive`` for each decoded client message (``on_protocol_error`` for a
    frame that failed to decode); after a ``Start``, ``on_started`` then ``on_output`` for
    each output of that request, or ``on_start_failed`` if the engine refused it;
    ``on_disconnect`` when the peer is gone. Every method returns the actions to perform, in
    order.
    """

    def __init__(self, limits: SessionLimits = SessionLimits()) -> None:
        self.limits = limits
        self.state = State.IDLE
        self.running: _Running | None = None
        self.num_requests = 0

    def receive(self, message: ClientMessage) -> list[Action]:
        """Handle one client message."""
        if self.state is State.CLOSED:
            return []
        handler = _HANDLERS[(self.state, type(message))]
        return handler(self, message)

    def on_protocol_error(self, exc: BaseException, wire_id: str | None = None) -> list[Action]:
        """A frame broke a framing, JSON or schema rule: send the error, then close."""
        if self.state is State.CLOSED:
            return []
        return self._fail(
            exc, wire_id, self.running.metadata if self.running and self.running.wire_id == wire_id else None
        )

    def on_start_failed(self, key: Key, exc: BaseException, now: float) -> list[Action]:
        """The engine refused the request just started (bad input, queue full, …); the driver
        counted the refusal."""
        running = self.running
        if running is None:
            return []  # a refusal racing a close
        self.state, self.running = State.IDLE, None  # nothing runs: no Abort
        return self._fail(exc, running.wire_id, running.metadata, is_rejection=False)

    def on_started(self, started: Started) -> list[Action]:
        """The engine took the request: from now on a cancel is answered by its final output."""
        if self.running is not None:
            self.running.is_started = True
        return []

    def on_error(self, exc: BaseException) -> list[Action]:
        """The connection failed (a bug): the generic error frame, then close."""
        if self.state is State.CLOSED:
            return []
        running = self.running
        return self._fail(
            exc, running.wire_id if running else None, running.metadata if running else None, is_rejection=False
        )

    def refusal_code(self, exc: BaseException) -> str:
        """Refusals count under this wire's error codes (``E_LIMIT_QUEUE_FULL``...)."""
        return codec.error_code(exc)

    def on_output(self, key: Key, output: RequestOutput, now: float) -> list[Action]:
        """Turn one output delta of the running request into events."""
        running = self.running
        if self.state is not State.ACTIVE or running is None:
            return []  # outputs racing a close
        actions: list[Action] = []
        if running.text_parts is not None:
            running.text_parts.append(output.text)
        else:
            actions.extend(
                Send(Token(id=running.wire_id, text=text, token_id=token_id, metadata=running.metadata))
                for text, token_id in zip(output.token_texts, output.token_ids)
            )
        if output.finished:
            actions.extend(self._finish(running, output.finish_reason or "stop", output.error))
        return actions

    def on_disconnect(self) -> list[Action]:
        """The peer closed the connection: stop the running request at once."""
        was_active = self.state is State.ACTIVE
        self.state, self.running = State.CLOSED, None
        return [Abort()] if was_active else []

    # -- handlers --------------------------------------------------------------------------
    def _start(self, request: Request) -> list[Action]:
        try:
            generate = codec.build_request(request, self.limits.request_timeout_s)
        except InvalidRequest as exc:
            return self._fail(exc, request.id, request.metadata)
        self.num_requests += 1
        self.running = _Running(request.id, request.stream, request.metadata, text_parts=None if request.stream else [])
        self.state = State.ACTIVE
        return [Start(generate)]

    def _busy(self, request: Request) -> list[Action]:
        running = self.running
        assert running is not None
        busy = codec.Busy(
            f"request '{running.wire_id}' is still running on this connection; "
            "send the next request after its eos (or open another connection)"
        )
        return self._fail(busy, request.id, request.metadata)

    def _cancel(self, cancel: Cancel) -> list[Action]:
        # Best effort, as the spec says: a cancel for a request that already ended (it may
        # cross its eos on the wire) or for another id changes nothing.
        running = self.running
        if running is None or cancel.id != running.wire_id:
            return []
        if running.is_started:
            return [Abort()]  # the engine's final output (cancelled) makes the eos
        # Still being submitted: the Abort cancels the submission, so nothing will come back.
        return [Abort(), *self._finish(running, "cancelled")]

    def _ignore(self, _message: Any) -> list[Action]:
        return []

    def _metrics(self, _query: MetricsQuery) -> list[Action]:
        was_active = self.state is State.ACTIVE
        self.state, self.running = State.CLOSED, None
        aborts: list[Action] = [Abort()] if was_active else []
        return aborts + [SendMetrics(), Close()]

    # -- helpers ---------------------------------------------------------------------------
    def _finish(self, running: _Running, reason: FinishReason, error: object = None) -> list[Action]:
        self.running = None
        text = "".join(running.text_parts) if running.text_parts is not None else None
        if reason == "error":
            exc = error if isinstance(error, RillError) else GenerationError("generation failed")
            self.state = State.CLOSED
            return [
                Send(_error(exc, running.wire_id, running.metadata)),
                Send(Eos(id=running.wire_id, reason="error", text=text, metadata=running.metadata)),
                Close(),
            ]
        actions: list[Action] = [Send(Eos(id=running.wire_id, reason=reason, text=text, metadata=running.metadata))]
        if self.limits.one_request:
            self.state = State.CLOSED
            actions.append(Close())
        else:
            self.state = State.IDLE
        return actions

    def _fail(
        self, exc: BaseException, wire_id: str | None, metadata: dict[str, Any] | None, is_rejection: bool = True
    ) -> list[Action]:
        # A frame or a request refused before it ran, or a bug (generation errors end in _finish).
        was_active = self.state is State.ACTIVE
        self.state, self.running = State.CLOSED, None
        error = _error(exc, wire_id, metadata)
        aborts: list[Action] = [Abort()] if was_active else []
        return aborts + ([Rejected(error.code)] if is_rejection else []) + [Send(error), Close()]


def _error(exc: BaseException, wire_id: str | None, metadata: dict[str, Any] | None) -> Error:
    return Error(code=codec.error_code(exc), message=codec.error_message(exc), id=wire_id, metadata=metadata)


_Handler = Callable[[FramedSession, Any], list[Action]]

_HANDLERS: dict[tuple[State, type], _Handler] = {
    (State.IDLE, Request): FramedSession._start,
    (State.IDLE, Cancel): FramedSession._ignore,
    (State.IDLE, MetricsQuery): FramedSession._metrics,
    (State.ACTIVE, Request): FramedSession._busy,
    (State.ACTIVE, Cancel): FramedSession._cancel,
    (State.ACTIVE, MetricsQuery): FramedSession._metrics,
}
"""(state, message type) → handler: the legal moves of a framed connection."""


# -- newline mode --------------------------------------------------------------------------


class NewlineSession(Session):
    """Sans-I/O state of one newline-mode connection (a debugging aid).

    Calling order: ``receive_line`` per input line, ``on_end_of_input`` at EOF (answers to
    lines already received are still written), ``on_output`` / ``on_start_failed`` as in
    framed mode, ``on_disconnect`` if writing fails.
    """

    def __init__(self, limits: SessionLimits = SessionLimits()) -> None:
        self.limits = limits
        self.state = State.IDLE
        self.is_input_done = False
        self._queue: deque[str] = deque()
        self.num_requests = 0

    def receive_line(self, line: bytes) -> list[Action]:
        """One input line: start it now or queue it behind the running one."""
        if self.state is State.CLOSED:
            return []
        try:
            prompt = line.decode("utf-8")
        except UnicodeDecodeError:
            return self._fail(codec.InvalidJson("input line is not valid UTF-8"))
        if not prompt.strip():
            return []
        self._queue.append(prompt)
        return self._next() if self.state is State.IDLE else []

    def on_end_of_input(self) -> list[Action]:
        """The client sent EOF: finish what was asked, then close."""
        self.is_input_done = True
        return [Close()] if self.state is State.IDLE else []

    def on_output(self, key: Key, output: RequestOutput, now: float) -> list[Action]:
        """Raw text of the running answer; a blank line and the next prompt when it ends."""
        if self.state is not State.ACTIVE:
            return []
        actions: list[Action] = [Send(output.text.encode("utf-8"))] if output.text else []
        if not output.finished:
            return actions
        self.state = State.IDLE
        if output.finish_reason == "error":
            exc = output.error if isinstance(output.error, RillError) else GenerationError("generation failed")
            return actions + self._fail(exc, is_rejection=False)
        return actions + [Send(b"\n\n")] + self._next()

    def on_start_failed(self, key: Key, exc: BaseException, now: float) -> list[Action]:
        """The engine refused the current line; the driver counted the refusal."""
        if self.state is State.CLOSED:
            return []
        self.state = State.IDLE  # nothing runs: no Abort
        return self._fail(exc, is_rejection=False)

    def on_error(self, exc: BaseException) -> list[Action]:
        """The connection failed (a bug): an error line, then close."""
        return [] if self.state is State.CLOSED else self._fail(exc, is_rejection=False)

    def refusal_code(self, exc: BaseException) -> str:
        """Refusals count under this wire's error codes (``E_LIMIT_QUEUE_FULL``...)."""
        return codec.error_code(exc)

    def on_protocol_error(self, exc: BaseException) -> list[Action]:
        """The input broke a limit (a line over ``max_frame_bytes``): error line, then close."""
        return [] if self.state is State.CLOSED else self._fail(exc)

    def on_disconnect(self) -> list[Action]:
        """The peer is gone: stop the running request."""
        was_active = self.state is State.ACTIVE
        self.state = State.CLOSED
        self._queue.clear()
        return [Abort()] if was_active else []

    def _next(self) -> list[Action]:
        if not self._queue:
            if self.is_input_done or (self.limits.one_request and self.num_requests):
                self.state = State.CLOSED
                return [Close()]
            return []
        if self.limits.one_request and self.num_requests:
            self.state = State.CLOSED
            return [Close()]
        prompt = self._queue.popleft()
        try:
            generate = codec.build_request(
                Request(id=f"line-{self.num_requests}", prompt=prompt), self.limits.request_timeout_s
            )
        except InvalidRequest as exc:
            return self._fail(exc)
        self.num_requests += 1
        self.state = State.ACTIVE
        return [Start(generate)]

    def _fail(self, exc: BaseException, is_rejection: bool = True) -> list[Action]:
        was_active = self.state is State.ACTIVE
        self.state = State.CLOSED
        self._queue.clear()
        code = codec.error_code(exc)
        line = f"error: {code}: {codec.error_message(exc)}\n".encode()
        aborts: list[Action] = [Abort()] if was_active else []
        return aborts + ([Rejected(code)] if is_rejection else []) + [Send(line), Close()]
