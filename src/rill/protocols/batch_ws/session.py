"""Sans-I/O state of one batch ``/ws`` connection.

Pure: no I/O, no await, no clock (``now`` is passed in, monotonic seconds), no engine or
frontend import. A ``StepSession`` of the session driver (``protocols/_shared/driver.py``):
the adapter feeds it client frames (``on_frame``), the driver feeds it what the engine
answers; it answers with actions (``Send``, ``SendError``, ``Start``, ``Abort``, ``Close``),
performed in order.

Per prompt (keyed by a session-made engine request id, ``PromptKey``)::

    receive ─▶ ACCEPTED ─▶ Start ─┬─▶ on_starts_failed ─▶ ERROR                      (done)
                                  └─▶ on_outputs: STARTED ─▶ INITIALIZED ─▶ PROGRESS* ─┬▶ COMPLETE (done)
                                                                                      └▶ ERROR    (done)

Event arrays: every ``Send`` holds events of one batch only, in the batch's prompt order, and
one call of ``on_outputs`` (one engine step's outputs, drained together) yields at most one
array per event type and batch, in the order STARTED, INITIALIZED, PROGRESS, COMPLETE, ERROR.
With ``stream_response`` false, INITIALIZED and PROGRESS are not sent.

Continuation: when a prompt ends on ``max_new_tokens`` (not eos), its token ids are kept in
the shared ``ContinuationStore`` (``store.py``) under its ``request_id``; a later prompt with that id continues it
(the new ``prompt`` is ignored, as in the source project). An entry dropped by the store's
bounds or TTL leaves a tombstone, so the next use of that id gets an ERROR saying so instead
of silently starting over; the use after that starts afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from rill.errors import CacheMiss, ContextLengthExceeded, InvalidRequest
from rill.protocols._shared import session as driver_session
from rill.protocols._shared.actions import Abort, Close, Send, Start
from rill.protocols.batch_ws import codec
from rill.protocols.batch_ws.messages import (
    SAMPLING,
    Accepted,
    BatchRequest,
    Complete,
    Error,
    GenerationConfig,
    Initialized,
    Progress,
    ServerEvent,
    Started,
)
from rill.protocols.batch_ws.store import ContinuationStore, Evicted
from rill.types import DRAW_ONLY_FIELDS, GenerateRequest, RequestEvent, RequestOutput, SamplingParams

__all__ = [
    "Abort",
    "Action",
    "BatchSession",
    "Close",
    "ContinuationStore",
    "Limits",
    "PromptKey",
    "Send",
    "SendError",
    "Start",
]

PromptKey = str
"""The engine request id the session gives one prompt of one message (unique per server)."""

PROTOCOL = "batch_ws"

CLOSE_INTERNAL_ERROR = 1011
"""The WebSocket close code after a bug failed the connection."""


# -- actions ---------------------------------------------------------------------------------
class SendError(msgspec.Struct, frozen=True):
    """Send a frame-level error ``[{"error": text}]``; the socket stays open."""

    text: str


Action = Send[list[ServerEvent]] | SendError | Start | Abort | Close
"""``Send``: one frame, the JSON array of the events (all of one batch). ``Start`` / ``Abort``
carry the prompt's key (``PromptKey``); aborting frees its KV memory at once. ``Close`` ends
the socket after a bug."""


@dataclass(frozen=True)
class Limits:
    """Per-connection bounds the session applies (``--max-tokens-cap`` is the frontend's).

    ``max_inflight_prompts``: most prompts generating at once on one socket.
    ``request_timeout_s``: wall-clock limit per prompt (None: none).
    """

    max_inflight_prompts: int = 256
    request_timeout_s: float | None = None


# -- per-connection session --------------------------------------------------------------------
@dataclass
class _Batch:
    only_new_tokens: bool
    stream_response: bool
    config: GenerationConfig | None  # as sent (None when empty): kept for continuations
    received_at: float
    prompts: list[_Prompt] = field(default_factory=list)
    num_open: int = 0


@dataclass
class _Prompt:
    key: PromptKey
    batch: _Batch
    index: int  # position in the message's prompts: event arrays follow it
    request_id: str
    initial_text: str  # prompt text (+ earlier generations, for a continuation)
    config: GenerationConfig | None
    prompt_token_ids: list[int] | None = None
    generated_ids: list[int] = field(default_factory=list)
    generated_text: list[str] = field(default_factory=list)
    is_started: bool = False
    is_initialized: bool = False
    is_done: bool = False
    is_continuation: bool = False  # goes on from a kept generation
    is_beam: bool = False


_ORDER = ("STARTED", "INITIALIZED", "PROGRESS", "COMPLETE", "ERROR")


class BatchSession(driver_session.StepSession):
    """State of one ``/ws`` connection: open batches, their prompts and event grouping.

    Call ``on_frame`` for each client frame (or ``receive`` for a decoded message) and
    perform its actions in order: the ``Start``s of one message submitted together, their
    refusals reported to ``on_starts_failed`` at once, the accepted ones to ``on_started``;
    feed engine outputs to ``on_outputs`` in groups (one drain of all streams per wake-up),
    and call ``on_disconnect`` when the socket goes away.
    """

    def __init__(
        self,
        store: ContinuationStore,
        defaults: GenerationConfig,
        limits: Limits,
        key_prefix: str,
        scope: str = "",
        principal: str = "",
    ) -> None:
        self.store = store
        self.principal = principal
        """Who the kept generations of this socket are charged to (the store's ``owner``)."""
        self.defaults = defaults
        self.limits = limits
        self.scope = scope
        self._key_prefix = key_prefix
        self._num_keys = 0
        self._prompts: dict[driver_session.Key, _Prompt] = {}  # keyed by PromptKey

    @property
    def num_open_prompts(self) -> int:
        """Prompts of this socket not finished yet."""
        return len(self._prompts)

    def default_sampling(self) -> SamplingParams:
        """The sampling of a message without generation_config (``InvalidRequest`` if the
        server's defaults are invalid)."""
        return self._sampling(None)

    # -- client → server ---------------------------------------------------------------------
    def on_frame(self, text: str | None, now: float) -> list[Action]:
        """One client frame (None: a binary frame): the batch's actions, or a socket-level
        error that leaves the socket usable."""
        if text is None:
            return [SendError(codec.BINARY_FRAME)]
        try:
            return self.receive(codec.decode(text), now)
        except InvalidRequest as exc:
            return [SendError(str(exc))]

    def receive(self, msg: BatchRequest, now: float) -> list[Action]:
        """Accept a batch: ACCEPTED for every prompt, then a ``Start`` per runnable prompt.

        Raises:
            InvalidRequest: the batch as a whole is unusable (duplicate ids, bad config, too
                many prompts in flight); nothing of it was accepted — send ``SendError``.
        """
        self._check_batch(msg)
        config = msg.generation_config if _is_given(msg.generation_config) else None
        fresh_sampling = self._sampling(config)
        batch = _Batch(msg.only_new_tokens, msg.stream_response, config, now)
        actions: list[Action] = [Send([Accepted(request_id=p.request_id) for p in msg.prompts])]
        errors: list[ServerEvent] = []
        for index, item in enumerate(msg.prompts):
            scoped = (self.scope, item.request_id)
            if self.store.is_busy(scoped):
                errors.append(
                    Error(
                        request_id=item.request_id,
                        error=codec.error_text(
                            InvalidRequest(
                                f"request_id {item.request_id!r} is still generating; wait for its COMPLETE or use another id"
                            )
                        ),
                    )
                )
                continue
            kept = self.store.claim(scoped, now)
            if isinstance(kept, Evicted) or (kept is None and item.prompt is None):
                self.store.release(scoped)
                exc = (
                    _evicted_error(item.request_id, kept.reason, self.store.ttl_s)
                    if kept
                    else InvalidRequest(
                        f"'prompt' is required: there is no kept generation to continue for request_id {item.request_id!r}"
                    )
                )
                errors.append(Error(request_id=item.request_id, error=codec.error_text(exc)))
                continue
            key = self._new_key()
            if kept is None:
                prompt = _Prompt(key, batch, index, item.request_id, item.prompt or "", config)
                request = GenerateRequest(
                    prompt=item.prompt,
                    sampling=fresh_sampling,
                    request_id=key,
                    protocol=PROTOCOL,
                    deadline_s=self.limits.request_timeout_s,
                )
            else:
                run_config = config if config is not None else kept.config
                prompt = _Prompt(
                    key,
                    batch,
                    index,
                    item.request_id,
                    kept.text,
                    run_config,
                    prompt_token_ids=kept.token_ids,
                    is_continuation=True,
                )
                request = GenerateRequest(
                    prompt_token_ids=kept.token_ids,
                    sampling=self._sampling(run_config),
                    request_id=key,
                    protocol=PROTOCOL,
                    require_cached_prefix_tokens=kept.num_cached_tokens or None,
                    deadline_s=self.limits.request_timeout_s,
                )
            prompt.is_beam = request.sampling.num_beams > 1
            batch.prompts.append(prompt)
            batch.num_open += 1
            self._prompts[key] = prompt
            actions.append(Start(request, key))
        if errors:
            actions.insert(1, Send(errors))
        return actions

    def on_started(self, started: driver_session.Started) -> list[Action]:
        """The engine took the request of ``started.key``; remember its prompt ids for
        continuation (STARTED waits for the engine's first output)."""
        prompt = self._prompts.get(started.key)
        if prompt is not None:
            prompt.prompt_token_ids = list(started.prompt_token_ids)
        return []

    def on_start_failed(self, key: driver_session.Key, exc: BaseException, now: float) -> list[Action]:
        """The engine refused the request of ``key`` at submission: its ERROR."""
        return self.on_starts_failed([(key, exc)], now)

    def on_starts_failed(self, failures: list[tuple[driver_session.Key, BaseException]], now: float) -> list[Action]:
        """The engine refused these requests at submission: one ERROR array per batch."""
        grouped: dict[int, tuple[_Batch, list[ServerEvent]]] = {}
        for key, exc in failures:
            prompt = self._prompts.get(key)
            if prompt is None:
                continue
            self._finish(prompt)
            if isinstance(exc, ContextLengthExceeded) and prompt.is_continuation:
                exc = ContextLengthExceeded(
                    exc.num_prompt_tokens,
                    exc.max_context_tokens,
                    (
                        f"request_id {prompt.request_id!r} cannot continue: its text so far ({exc.num_prompt_tokens} tokens) "
                        f"already fills the model's context of {exc.max_context_tokens} tokens"
                    ),
                )
            grouped.setdefault(id(prompt.batch), (prompt.batch, []))[1].append(
                Error(request_id=prompt.request_id, error=codec.error_text(exc))
            )
        return [Send(events) for _, events in grouped.values()]

    # -- engine → client ---------------------------------------------------------------------
    def on_output(self, key: driver_session.Key, output: RequestOutput, now: float) -> list[Action]:
        """One request's output alone (a group of one)."""
        return self.on_outputs([(key, output)], now)

    def on_outputs(self, outputs: list[tuple[driver_session.Key, RequestOutput]], now: float) -> list[Action]:
        """Turn one drain of engine outputs into event arrays (see the module docstring)."""
        per_batch: dict[int, tuple[_Batch, dict[str, list[tuple[int, ServerEvent]]]]] = {}
        for key, output in outputs:
            prompt = self._prompts.get(key)
            if prompt is None:
                continue
            arrays = per_batch.setdefault(id(prompt.batch), (prompt.batch, {name: [] for name in _ORDER}))[1]
            for name, event in self._events_of(prompt, output, now):
                arrays[name].append((prompt.index, event))
        actions: list[Action] = []
        for _, arrays in per_batch.values():
            for name in _ORDER:
                if arrays[name]:
                    actions.append(Send([event for _, event in sorted(arrays[name], key=lambda pair: pair[0])]))
        return actions

    def on_error(self, exc: BaseException) -> list[Action]:
        """A bug failed the connection: the generic socket error, then close (nothing of the
        exception reaches the client)."""
        return [SendError(codec.GENERIC_ERROR), Close(CLOSE_INTERNAL_ERROR)]

    def on_disconnect(self) -> list[Action]:
        """The socket is gone: abort every open prompt and free its id."""
        actions: list[Action] = [Abort(key) for key in self._prompts]
        for prompt in list(self._prompts.values()):
            self._finish(prompt)
        return actions

    # -- internals -----------------------------------------------------------------------------
    def _check_batch(self, msg: BatchRequest) -> None:
        seen: set[str] = set()
        for item in msg.prompts:
            if item.request_id in seen:
                raise InvalidRequest(
                    f"{codec.INVALID_PAYLOAD}: request_id {item.request_id!r} appears twice in prompts"
                )
            seen.add(item.request_id)
        limit = self.limits.max_inflight_prompts
        if len(self._prompts) + len(msg.prompts) > limit:
            raise InvalidRequest(
                f"too many prompts in flight on this socket: {len(self._prompts)} running + "
                f"{len(msg.prompts)} new > {limit}; wait for some to complete"
            )

    def _sampling(self, config: GenerationConfig | None) -> SamplingParams:
        cfg = (config or GenerationConfig()).filled_from(self.defaults)
        patch = SAMPLING.patch(cfg)
        if not (cfg.num_beams == 1 and cfg.do_sample):
            # NOTE: sampling fields only matter when sampling; HF ignores them otherwise, so do we.
            patch = {name: value for name, value in patch.items() if name not in DRAW_ONLY_FIELDS}
            patch["temperature"] = 0.0
        try:
            return SAMPLING.params(patch)
        except InvalidRequest as exc:
            raise InvalidRequest(f"{codec.INVALID_PAYLOAD}: generation_config {exc}", field=exc.field) from exc

    def _events_of(self, prompt: _Prompt, output: RequestOutput, now: float) -> list[tuple[str, ServerEvent]]:
        batch, rid = prompt.batch, prompt.request_id
        events: list[tuple[str, ServerEvent]] = []
        is_failure = output.finished and output.finish_reason in ("error", "cancelled")
        wants_start = RequestEvent.SCHEDULED in output.events or RequestEvent.PREFILL_DONE in output.events
        # Engines may fold lifecycle events into the first token; never let a token or a
        # COMPLETE come before STARTED/INITIALIZED.
        if not prompt.is_started and (wants_start or output.token_ids or (output.finished and not is_failure)):
            prompt.is_started = True
            events.append(("STARTED", Started(request_id=rid)))
        if (
            not prompt.is_initialized
            and prompt.is_started
            and (RequestEvent.PREFILL_DONE in output.events or output.token_ids or (output.finished and not is_failure))
        ):
            prompt.is_initialized = True
            if batch.stream_response:
                events.append(
                    (
                        "INITIALIZED",
                        Initialized(request_id=rid, text="" if batch.only_new_tokens else prompt.initial_text),
                    )
                )
        if output.token_ids or output.text:
            prompt.generated_ids.extend(output.token_ids)
            prompt.generated_text.append(output.text)
            if batch.stream_response:
                events.append(("PROGRESS", Progress(request_id=rid, text=output.text)))
        if output.finished:
            events.append(self._final_event(prompt, output, now))
        return events

    def _final_event(self, prompt: _Prompt, output: RequestOutput, now: float) -> tuple[str, ServerEvent]:
        self._finish(prompt)
        rid = prompt.request_id
        if output.finish_reason in ("error", "cancelled"):
            if output.finish_reason == "cancelled":
                return "ERROR", Error(request_id=rid, error=codec.CANCELLED)
            exc = output.error
            if isinstance(exc, CacheMiss):
                exc = _evicted_error(rid, "evicted", self.store.ttl_s)
            return "ERROR", Error(
                request_id=rid, error=codec.error_text(exc) if exc is not None else codec.GENERIC_ERROR
            )
        generated = "".join(prompt.generated_text)
        if output.finish_reason == "length" and prompt.prompt_token_ids is not None:
            # NOTE: the engine drops every row of a finished beam request, so nothing of it is
            # cached: a beam continuation recomputes its (kept, exact) ids instead of failing.
            num_cached = 0 if prompt.is_beam else None
            self.store.keep(
                (self.scope, rid),
                prompt.prompt_token_ids + prompt.generated_ids,
                prompt.initial_text + generated,
                prompt.config,
                now,
                num_cached,
                owner=self.principal,
            )
        return "COMPLETE", Complete(
            request_id=rid,
            text=generated if prompt.batch.only_new_tokens else prompt.initial_text + generated,
            is_eos=output.finish_reason == "stop",
            new_tokens_count=len(prompt.generated_ids),
            execution_time=round(now - prompt.batch.received_at, 6),
        )

    def _finish(self, prompt: _Prompt) -> None:
        if prompt.is_done:
            return
        prompt.is_done = True
        prompt.batch.num_open -= 1
        self._prompts.pop(prompt.key, None)
        self.store.release((self.scope, prompt.request_id))

    def _new_key(self) -> PromptKey:
        self._num_keys += 1
        return f"{self._key_prefix}-{self._num_keys}"


def _is_given(config: GenerationConfig | None) -> bool:
    # The source project treats an empty generation_config like a missing one.
    return config is not None and any(getattr(config, name) is not None for name in config.__struct_fields__)


def _evicted_error(request_id: str, reason: str, ttl_s: float) -> CacheMiss:
    why = f"expired after {ttl_s:g} s" if reason == "expired" else "was evicted to make room"
    return CacheMiss(
        f"the kept generation of request_id {request_id!r} {why}; send it again with its prompt to start over"
    )
