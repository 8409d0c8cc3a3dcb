"""Sans-I/O state of one ``/generate`` connection (or one ``POST /v1/generate`` request).

Message sequence (``shared/specs/generate-websocket.md``)::

    client: config ─────────────▶ server: [status model_loading]* → init → [status queued]* → token* → completion
    client: control pause ──────▶ server: status paused      (no token until resumed)
    client: control resume ─────▶ server: status resumed
    client: control modify ─────▶ server: status modified {parameters now in force}
    client: control regenerate ─▶ server: status regenerating → init → token* → completion
    client: control stop ───────▶ server: completion {finish_reason: cancelled}
    client: feedback ───────────▶ server: status feedback_received   (stored first)
    after completion or a recoverable error: a new config starts the next generation.

Resume (a rill extension, opt-in): a ``config`` with ``"resumable": true`` first opens the
generation's transcript (``Record``, then ``on_record_opened`` starts it); every message sent
until its end (``StopRecording``) is recorded with its ``index``, and a disconnect after
``init`` leaves it running (``outlives_disconnect``). On a new connection (or an idle one)::

    client: resume {request_id, last_index} ─▶ server: the messages after last_index, then live

The session turns each input into a list of actions (``Send``, ``Start``, ``Abort``,
``Pause``, ``Resume``, ``Modify``, ``Regenerate``, ``StoreFeedback``, ``Close``); the session
driver (``protocols/_shared/driver``) performs the shared ones and hands the adapter the
rest. It never awaits, reads no clock (``now`` is passed in, monotonic seconds) and imports
no engine. Statuses answering pause/resume/modify/regenerate are sent when the engine's event
arrives, so "no token between paused and resumed" holds by construction. What a generation
shows, and the finished generations feedback may still name, are ``generation.py``'s.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable
from typing import Any

from rill.errors import InvalidRequest, RillError
from rill.protocols._shared.session import Key, Session, Started
from rill.protocols.generate_ws import codec
from rill.protocols.generate_ws import messages as m
from rill.protocols.generate_ws.actions import (
    Abort,
    Action,
    Attach,
    Close,
    Modify,
    Pause,
    Record,
    Regenerate,
    Resume,
    Send,
    Start,
    StopRecording,
    StoreFeedback,
)
from rill.protocols.generate_ws.deltas import split_at_restart
from rill.protocols.generate_ws.generation import Generation, History, Limits, loading_status
from rill.types import GenerateRequest, InvalidParameter, RequestEvent, RequestOutput, SamplingParams

PROTOCOL = "generate_ws"
DEFAULT_TOP_LOGPROBS = 5  # alternatives sent with include_logprobs when parameters.logprobs is unset


class State(enum.Enum):
    """Where the connection is; see ``TRANSITIONS``."""

    AWAIT_CONFIG = "await_config"  # nothing received yet
    STARTING = "starting"  # config accepted; waiting for the model / admission
    GENERATING = "generating"
    PAUSED = "paused"  # pause sent to the engine (status follows with the event)
    IDLE = "idle"  # last generation ended; config or feedback may follow


# Which client message is legal in which state; anything else gets an invalid_request error.
TRANSITIONS: dict[State, dict[str, tuple[str, ...]]] = {
    State.AWAIT_CONFIG: {"config": (), "resume": ()},
    State.STARTING: {"control": ("stop",), "feedback": ()},
    State.GENERATING: {"control": ("stop", "pause", "modify", "regenerate"), "feedback": ()},
    State.PAUSED: {"control": ("stop", "resume", "modify", "regenerate"), "feedback": ()},
    State.IDLE: {"config": (), "feedback": (), "resume": ()},
}


def _new_request_id() -> str:
    return f"gen_{uuid.uuid4().hex[:16]}"


class GenerateSession(Session):
    """State machine of one connection; every method returns the actions to perform."""

    def __init__(
        self,
        limits: Limits,
        token_text: Callable[[int], str] = str,
        new_request_id: Callable[[], str] = _new_request_id,
        current_limits: Callable[[], Limits] | None = None,
    ) -> None:
        """``token_text`` names a token id for logprob alternatives (the adapter passes the
        tokenizer's decode); ``new_request_id`` makes generation ids; ``current_limits``, when
        given, is asked again as each generation starts (the model may have loaded meanwhile)."""
        self.limits = limits
        self._current_limits = current_limits
        self.state = State.AWAIT_CONFIG
        self.gen: Generation | None = None
        self._token_text = token_text
        self._new_request_id = new_request_id
        self._history = History()
        self._num_feedback = 0
        self._pending: GenerateRequest | None = None  # a resumable start waiting for its transcript

    # ------------------------------------------------------------------ client messages
    def receive(self, msg: m.ClientMessage, now: float) -> list[Action]:
        """One decoded client message → actions."""
        kind = {m.Config: "config", m.Control: "control", m.Feedback: "feedback", m.Resume: "resume"}[type(msg)]
        allowed = TRANSITIONS[self.state]
        if kind not in allowed or (kind == "control" and msg.action not in allowed[kind]):  # type: ignore[union-attr]
            return self._refuse(kind, msg)
        handlers: dict[str, Callable[[Any, float], list[Action]]] = {
            "config": self._on_config,
            "control": self._on_control,
            "feedback": self._on_feedback,
            "resume": self._on_resume,
        }
        handler = handlers[kind]
        try:
            return handler(msg, now)
        except (InvalidRequest, codec.FeedbackLimit) as exc:
            return [Send(codec.error_message(exc, self._current_id()))]

    def on_invalid(self, exc: RillError) -> list[Action]:
        """A frame that failed to decode: an ``invalid_request`` error; nothing else changes."""
        return [Send(codec.error_message(exc, self._current_id()))]

    def _refuse(self, kind: str, msg: m.ClientMessage) -> list[Action]:
        if self.state is State.AWAIT_CONFIG:
            text = f"the first message must be a config (or resume) message, not {kind}"
            field_name: str | None = "type"
        elif kind in ("config", "resume"):
            text, field_name = (
                f"a generation is running; stop it (or wait for its completion) before sending {kind}",
                "type",
            )
        elif self.state in (State.IDLE,):
            text = f"control '{msg.action}' needs a running generation; none is running"  # type: ignore[union-attr]
            field_name = "action"
        elif self.state is State.STARTING:
            text = f"control '{msg.action}' needs a running generation; it has not started yet"  # type: ignore[union-attr]
            field_name = "action"
        elif msg.action == "pause":  # type: ignore[union-attr]
            text, field_name = "the generation is already paused", "action"
        elif msg.action == "resume":  # type: ignore[union-attr]
            text, field_name = "the generation is not paused; nothing to resume", "action"
        else:
            text, field_name = f"control '{msg.action}' is not valid while {self.state.value}", "action"  # type: ignore[union-attr]
        return [Send(codec.error_message(InvalidRequest(text, field=field_name), self._current_id()))]

    def _on_config(self, msg: m.Config, now: float) -> list[Action]:
        if not msg.prompt:
            raise InvalidRequest("'prompt' must not be empty", field="prompt")
        options = msg.options or m.Options()
        patch = m.SAMPLING.patch(msg.parameters) if msg.parameters is not None else {}
        if options.include_logprobs and "logprobs" not in patch:
            patch["logprobs"] = DEFAULT_TOP_LOGPROBS
        sampling = self._validated(SamplingParams(), patch)
        self.gen = Generation(
            request_id=self._new_request_id(), prompt=msg.prompt, options=options, sampling=sampling, started_at=now
        )
        self.state = State.STARTING
        request = GenerateRequest(
            prompt=msg.prompt, sampling=sampling, request_id=self.gen.request_id, protocol=PROTOCOL
        )
        if msg.resumable is True:
            self._pending = request
            return [Record(self.gen.request_id)]
        return [Start(request)]

    def on_record_opened(self) -> list[Action]:
        """The transcript ``Record`` asked for is open: start the generation."""
        request, self._pending = self._pending, None
        if request is None or self.gen is None:
            return []
        self.gen.is_recording = True
        return [Start(request)]

    def _on_resume(self, msg: m.Resume, now: float) -> list[Action]:
        return [Attach(msg.request_id, msg.last_index)]

    def on_resume_failed(self, request_id: str, exc: RillError) -> list[Action]:
        """A ``resume`` named no generation this client may read, or a position it does not
        have: the error, naming the generation asked for; nothing else changes."""
        return [Send(codec.error_message(exc, request_id))]

    def _stop_recording(self) -> list[Action]:
        # After the generation's last message: its transcript ends there.
        if self.gen is None or not self.gen.is_recording:
            return []
        self.gen.is_recording = False
        return [StopRecording()]

    @property
    def outlives_disconnect(self) -> bool:
        """True while a resumable generation runs whose id the client was sent (``init``): a
        disconnect leaves it running for a ``resume``; otherwise a disconnect aborts."""
        gen = self.gen
        return gen is not None and gen.is_recording and gen.is_started and not gen.is_finished

    def _validated(self, base: SamplingParams, patch: dict[str, Any]) -> SamplingParams:
        info = self.limits.model_info
        try:
            return m.SAMPLING.params(patch, base, vocab_size=info.vocab_size if info is not None else None)
        except InvalidRequest as exc:
            raise InvalidRequest(exc.message, field=f"parameters.{exc.field}") from exc

    def _on_control(self, msg: m.Control, now: float) -> list[Action]:
        assert self.gen is not None  # TRANSITIONS allow control only with a generation
        if msg.action != "modify" and msg.parameters is not None:
            raise InvalidRequest(
                f"'parameters' is only valid with action 'modify', not '{msg.action}'", field="parameters"
            )
        if msg.action == "stop":
            return self._on_stop()
        if msg.action == "pause":
            self.state = State.PAUSED
            return [Pause()]
        if msg.action == "resume":
            self.state = State.GENERATING
            return [Resume()]
        if msg.action == "regenerate":
            return [Regenerate()]
        patch = m.SAMPLING.patch(msg.parameters) if msg.parameters is not None else {}
        if not patch:
            raise InvalidRequest("'modify' needs 'parameters' with at least one field", field="parameters")
        # Validated once, by the server's policy, with the vocabulary: on_modify_refused
        # reports a bad value in this wire's words.
        return [Modify(patch)]

    def _on_stop(self) -> list[Action]:
        assert self.gen is not None
        if self.state is not State.STARTING:
            return [Abort()]  # the engine's final output (cancelled) makes the completion
        # Not submitted yet: nothing reaches the engine, answer at once.
        self.state = State.IDLE
        self.gen.is_finished = True
        self._history.remember(self.gen)
        return [Abort(), Send(self.gen.completion("cancelled", self.gen.started_at)), *self._stop_recording()]

    def _on_feedback(self, msg: m.Feedback, now: float) -> list[Action]:
        gen = self._history.get(msg.request_id) if msg.request_id else self.gen
        if msg.request_id and self.gen is not None and msg.request_id == self.gen.request_id:
            gen = self.gen
        if gen is None:
            raise InvalidRequest(
                f"unknown request_id '{msg.request_id}' for feedback on this connection", field="request_id"
            )
        record = gen.feedback_record(msg, self.limits, self._num_feedback)
        self._num_feedback += 1
        return [StoreFeedback(record)]

    def on_modify_applied(self, params: SamplingParams) -> None:
        """The server took the last ``Modify`` as ``params`` (clamped where it caps a value):
        the next ``modify`` patches these. The ``modified`` status reports what the engine's
        event carries."""
        if self.gen is not None:
            self.gen.sampling = params

    def on_modify_refused(self, exc: RillError) -> list[Action]:
        """The server refused the last ``Modify`` (a bad value, the request just ended, a rate
        limit): nothing changed. A bad value is named as on this wire, ``parameters.<name>``."""
        if isinstance(exc, InvalidParameter):
            wire = m.SAMPLING.renamed(exc)
            exc = InvalidRequest(wire.message, field=f"parameters.{wire.field}" if wire.field else "parameters")
        return self.on_invalid(exc)

    def on_feedback_stored(self, request_id: str, feedback_id: int) -> list[Action]:
        """The store committed the record: acknowledge it."""
        return [
            Send(
                m.Status(
                    operation="feedback_received",
                    request_id=request_id,
                    feedback_id=feedback_id,
                    message="feedback stored",
                )
            )
        ]

    # ------------------------------------------------------------------ engine side
    def on_loading(self, progress: float, eta_s: float | None) -> list[Action]:
        """Model still loading: a ``status`` the driver asks for every ~0.5 s."""
        return [Send(loading_status(progress, eta_s))]

    def on_queued(self, key: Key, position: int, queue_length: int) -> list[Action]:
        """The started generation still waits for the engine: where it stands (the driver
        asks for this when the position changes, until the first output)."""
        gen = self.gen
        if gen is None or gen.is_finished or self.state not in (State.GENERATING, State.PAUSED):
            return []
        return [Send(gen.queued_status(position, queue_length))]

    def on_started(self, started: Started) -> list[Action]:
        """The engine accepted the request: send ``init``. ``started.sampling`` is what the
        server put in force (``max_tokens`` clamped to ``--max-tokens-cap``): ``init`` reports
        it and later ``modify`` patches start from it."""
        assert self.gen is not None
        if self._current_limits is not None:
            self.limits = self._current_limits()
        self.gen.sampling = started.sampling
        self.gen.num_prompt_tokens = len(started.prompt_token_ids)
        self.gen.is_started = True
        self.state = State.GENERATING
        return [Send(self.gen.init_message(self.limits))]

    def on_output(self, key: Key, out: RequestOutput, now: float) -> list[Action]:
        """One engine delta → statuses, tokens and, at the end, the completion or error."""
        gen = self.gen
        if gen is None or gen.is_finished:
            return []
        actions: list[Action] = []
        if RequestEvent.REGENERATING in out.events:
            stale, out = split_at_restart(out)
            actions += [Send(t) for t in gen.tokens(stale, now, self._token_text)]
        before, after = gen.event_statuses(out, self.limits)
        actions += [Send(s) for s in before]
        actions += [Send(t) for t in gen.tokens(out, now, self._token_text)]
        actions += [Send(s) for s in after]
        if out.usage.prompt_tokens:
            gen.num_prompt_tokens = out.usage.prompt_tokens
        gen.num_completion_tokens = out.usage.completion_tokens or gen.num_completion_tokens
        if out.finished:
            actions += self._on_finished(out, now)
        return actions

    def _on_finished(self, out: RequestOutput, now: float) -> list[Action]:
        gen = self.gen
        assert gen is not None
        gen.is_finished = True
        self._history.remember(gen)
        self.state = State.IDLE
        if out.finish_reason == "error":
            exc = out.error if isinstance(out.error, BaseException) else RillError("generation failed")
            return self._error_actions(exc)
        return [Send(gen.completion(out.finish_reason or "stop", now)), *self._stop_recording()]

    def on_start_failed(self, key: Key, exc: BaseException, now: float) -> list[Action]:
        """The generation never started (refused, the model failed to load, the time limit):
        as ``on_error``."""
        return self.on_error(exc)

    def on_error(self, exc: BaseException) -> list[Action]:
        """The generation or the connection failed (a bug, a frame that broke the decoder):
        send the error with the partial text; close the socket when it is not recoverable."""
        self._pending = None
        if self.gen is not None and not self.gen.is_finished:
            self.gen.is_finished = True
            self._history.remember(self.gen)
        if self.state is not State.AWAIT_CONFIG:
            self.state = State.IDLE
        return self._error_actions(exc)

    def _error_actions(self, exc: BaseException) -> list[Action]:
        gen = self.gen
        has_started = gen is not None and (gen.text != "" or gen.num_completion_tokens > 0)
        msg = codec.error_message(
            exc, self._current_id(), gen.visible_text if gen is not None and has_started else None
        )
        # The error is the generation's last message when it ended it (a recorded one's
        # transcript ends with it); a socket closes only after that.
        actions: list[Action] = [Send(msg), *self._stop_recording()]
        if not msg.recoverable:
            actions.append(Close(1011 if msg.error != "unauthorized" else 1008, msg.error))
        return actions

    def on_disconnect(self) -> list[Action]:
        """The client went away: abort whatever is running."""
        if self.state in (State.STARTING, State.GENERATING, State.PAUSED):
            self.state = State.IDLE
            return [Abort()]
        return []

    @property
    def is_running(self) -> bool:
        """True while a generation is starting, generating or paused."""
        return self.state in (State.STARTING, State.GENERATING, State.PAUSED)

    # ------------------------------------------------------------------ helpers
    def _current_id(self) -> str | None:
        return self.gen.request_id if self.gen is not None else None

    @property
    def num_history_bytes(self) -> int:
        """What the remembered generations hold (``generation.remembered_bytes``): the adapter
        charges it to the server's session-memory budget and ``forget_history`` makes room."""
        return self._history.num_bytes

    def forget_history(self, max_bytes: int) -> None:
        """Forget the oldest remembered generations until the rest hold at most ``max_bytes``
        (the server's memory is short): feedback naming them is refused as for an unknown id.
        The running generation is never forgotten."""
        running = self.gen.request_id if self.gen is not None and not self.gen.is_finished else None
        self._history.shrink(max_bytes, keep=running)
