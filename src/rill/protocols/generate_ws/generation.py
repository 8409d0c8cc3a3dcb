"""One ``/generate`` generation as the client sees it: its text so far, and the messages it makes.

``GenerateSession`` (``session.py``) decides what happens; a ``Generation`` holds what a
generation has shown (its text, token counts, timings) and builds its wire messages from
engine outputs: ``init``, the statuses that answer pause/resume/modify/regenerate, ``token``
and ``completion``. ``History`` keeps the finished generations feedback may still name.

Pure: no I/O, no clock (``now`` is passed in, monotonic seconds), no engine import.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from rill.errors import InvalidRequest
from rill.protocols.generate_ws import codec
from rill.protocols.generate_ws import messages as m
from rill.types import ModelInfo, RequestEvent, RequestOutput, SamplingParams

MAX_REMEMBERED_GENERATIONS = 32  # earlier generations feedback may still name by request_id
REMEMBERED_COST_BYTES = 512
"""Bytes a remembered generation counts besides its prompt and text (its objects)."""


@dataclass(frozen=True)
class Limits:
    """What the session and its generations' messages need to know about the server and the model."""

    model_name: str
    model_info: ModelInfo | None = None
    version: str | None = None
    max_feedback_per_generation: int | None = None
    max_feedback_per_connection: int | None = None


@dataclass
class Generation:
    """Presentation state of one generation (the text so far lives here, not in the engine)."""

    request_id: str
    prompt: str
    options: m.Options
    sampling: SamplingParams
    started_at: float
    text: str = ""
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    is_finished: bool = False
    is_started: bool = False  # the engine accepted it (init sent); a refused one has nothing to rate
    num_feedback: int = 0
    is_recording: bool = False  # its transcript is open (from Record until StopRecording)

    @property
    def visible_text(self) -> str:
        """``generated_text`` as the client sees it (with the prompt when echoing)."""
        return self.prompt + self.text if self.options.echo_prompt else self.text

    def init_message(self, limits: Limits) -> m.Init:
        """``init``: the generation's id, the model and the parameters in force."""
        info = limits.model_info
        msg = m.Init(
            request_id=self.request_id, model=limits.model_name, parameters=msgspec.structs.asdict(self.sampling)
        )
        if info is not None:
            msg.model_info = m.ModelInfoWire(
                max_tokens=info.max_context_tokens,
                dtype=info.dtype,
                quantization=info.quantization,
                architecture=info.architecture,
                vocab_size=info.vocab_size,
            )
            if limits.version:
                msg.model_info.version = limits.version
        return msg

    def event_statuses(self, out: RequestOutput, limits: Limits) -> tuple[list[m.ServerMessage], list[m.ServerMessage]]:
        """Statuses to send before and after this delta's tokens.

        A merged delta loses the order of tokens and events; tokens after a pause are
        impossible, so statuses go after the tokens unless the delta ends resumed (then
        the tokens may be post-resume) or restarted (tokens belong to the new run).
        """
        statuses: list[m.ServerMessage] = []
        is_restart = False
        modified = iter(out.modified)
        events = out.events
        for event in events:
            if event is RequestEvent.PAUSED:
                statuses.append(m.Status(operation="paused", request_id=self.request_id, message="generation paused"))
            elif event is RequestEvent.RESUMED:
                statuses.append(m.Status(operation="resumed", request_id=self.request_id, message="generation resumed"))
            elif event is RequestEvent.MODIFIED:
                params = next(modified, self.sampling)
                statuses.append(
                    m.Status(
                        operation="modified",
                        request_id=self.request_id,
                        message="parameters in force from the next token",
                        parameters=msgspec.structs.asdict(params),
                    )
                )
            elif event is RequestEvent.REGENERATING:
                is_restart = True
                self.text, self.first_token_at, self.last_token_at, self.num_completion_tokens = "", None, None, 0
                statuses.append(
                    m.Status(operation="regenerating", request_id=self.request_id, message="restarting from the prompt")
                )
                statuses.append(self.init_message(limits))
        pause_events = [e for e in events if e in (RequestEvent.PAUSED, RequestEvent.RESUMED)]
        if is_restart or (pause_events and pause_events[-1] is RequestEvent.RESUMED):
            return statuses, []
        return [], statuses

    def tokens(self, out: RequestOutput, now: float, token_text: Callable[[int], str]) -> list[m.Token]:
        """Add the delta's text; a ``token`` message per token when streaming (``token_text``
        names the logprob alternatives)."""
        pieces = out.token_texts
        num_new = len(pieces)
        if num_new == 0:
            return []
        previous_at = self.last_token_at if self.last_token_at is not None else self.started_at
        token_ms = codec.round_ms((now - previous_at) / num_new)
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        messages: list[m.Token] = []
        opts = self.options
        want_logprobs = out.logprobs is not None and (opts.include_logprobs or self.sampling.logprobs is not None)
        for i, piece in enumerate(pieces):
            self.text += piece
            if not opts.stream:
                continue
            is_last = out.finished and i == num_new - 1
            tok = m.Token(
                token=piece,
                generated_text=self.visible_text,
                finished=is_last,
                finish_reason=out.finish_reason if is_last else None,
            )
            if opts.include_token_ids and i < len(out.token_ids):
                tok.token_id = out.token_ids[i]
            if want_logprobs and out.logprobs is not None and i < len(out.logprobs):
                tok.logprobs = _logprobs(out.logprobs[i], piece, token_text)
            if opts.include_timing:
                tok.timing = m.TokenTiming(
                    token_ms=token_ms or 0.0, total_ms=codec.round_ms(now - self.started_at) or 0.0
                )
            messages.append(tok)
        return messages

    def feedback_record(self, msg: m.Feedback, limits: Limits, num_on_connection: int) -> dict[str, Any]:
        """The record ``msg`` rates this generation with, counted; ``num_on_connection`` is
        the feedback its connection sent before.

        Raises:
            InvalidRequest: the generation never started (nothing to rate).
            codec.FeedbackLimit: the generation or the connection had its most feedback.
        """
        if not self.is_started:
            # Nothing was generated: storing a row (with its prompt) for it would let refused
            # requests write to disk.
            raise InvalidRequest(
                f"generation '{self.request_id}' never started (refused, stopped or still "
                "waiting); there is nothing to rate",
                field="request_id",
            )
        most, most_on_connection = limits.max_feedback_per_generation, limits.max_feedback_per_connection
        if most is not None and self.num_feedback >= most:
            raise codec.FeedbackLimit(
                f"generation '{self.request_id}' already received {most} feedback messages, the most allowed"
            )
        if most_on_connection is not None and num_on_connection >= most_on_connection:
            raise codec.FeedbackLimit(
                f"this connection already sent {most_on_connection} feedback messages, the most allowed"
            )
        self.num_feedback += 1
        return {
            "request_id": self.request_id,
            "rating": msg.rating,
            "text": msg.text,
            "position": msg.position,
            "model": limits.model_name,
            "prompt": self.prompt,
            "generated_text": self.text,
            "is_generation_finished": self.is_finished,
        }

    def queued_status(self, position: int, queue_length: int) -> m.Status:
        """``status queued``: where the started generation waits for the engine (1-based)."""
        return m.Status(
            operation="queued",
            request_id=self.request_id,
            position=position,
            queue_length=queue_length,
            message=f"waiting for the engine: {position} of {queue_length}",
        )

    def completion(self, finish_reason: str, now: float) -> m.Completion:
        """``completion``: the whole text, why it ended, the usage and (when asked) the timing."""
        usage = m.UsageWire(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_completion_tokens,
            total_tokens=self.num_prompt_tokens + self.num_completion_tokens,
        )
        msg = m.Completion(
            generated_text=self.visible_text, finish_reason=finish_reason, usage=usage, request_id=self.request_id
        )
        if self.options.include_timing:
            first = None if self.first_token_at is None else self.first_token_at - self.started_at
            msg.timing = m.CompletionTiming(
                first_token_ms=codec.round_ms(first), total_ms=codec.round_ms(now - self.started_at) or 0.0
            )
        return msg


def loading_status(progress: float, eta_s: float | None) -> m.Status:
    """``status model_loading``: ``progress`` in percent (clamped to 0-100), ``eta_s`` seconds."""
    return m.Status(
        operation="model_loading",
        progress=round(max(0.0, min(100.0, progress)), 1),
        eta_seconds=None if eta_s is None else round(eta_s, 1),
        message="loading the model; the generation starts when it is ready",
    )


def _logprobs(lp: Any, chosen_text: str, token_text: Callable[[int], str]) -> list[m.TokenLogprobWire]:
    entries = [m.TokenLogprobWire(token=chosen_text, logprob=lp.logprob, token_id=lp.token_id)]
    for alt in lp.top:
        if alt.token_id != lp.token_id:
            entries.append(
                m.TokenLogprobWire(token=token_text(alt.token_id), logprob=alt.logprob, token_id=alt.token_id)
            )
    return entries


def remembered_bytes(gen: Generation) -> int:
    """What a remembered generation holds: its prompt and text (one byte a character, the
    size of an ASCII string) and ``REMEMBERED_COST_BYTES``."""
    return REMEMBERED_COST_BYTES + len(gen.prompt) + len(gen.text)


class History:
    """The generations of one connection that feedback may still name by ``request_id``:
    the latest ``MAX_REMEMBERED_GENERATIONS``, oldest first, and the bytes they hold."""

    def __init__(self) -> None:
        self._generations: OrderedDict[str, Generation] = OrderedDict()
        self._bytes: dict[str, int] = {}
        self.num_bytes = 0
        """What the remembered generations hold (``remembered_bytes``)."""

    def get(self, request_id: str) -> Generation | None:
        """The remembered generation ``request_id``, or None."""
        return self._generations.get(request_id)

    def remember(self, gen: Generation) -> None:
        """Remember ``gen`` (again: counted once, with its text now), forgetting the oldest past the bound."""
        self._forget(gen.request_id)
        self._generations[gen.request_id] = gen
        self._bytes[gen.request_id] = num_bytes = remembered_bytes(gen)
        self.num_bytes += num_bytes
        while len(self._generations) > MAX_REMEMBERED_GENERATIONS:
            self._forget(next(iter(self._generations)))

    def _forget(self, request_id: str) -> None:
        if self._generations.pop(request_id, None) is not None:
            self.num_bytes -= self._bytes.pop(request_id)

    def shrink(self, max_bytes: int, keep: str | None) -> None:
        """Forget the oldest generations until the rest hold at most ``max_bytes``; never ``keep``."""
        for request_id in list(self._generations):
            if self.num_bytes <= max_bytes:
                return
            if request_id != keep:
                self._forget(request_id)
