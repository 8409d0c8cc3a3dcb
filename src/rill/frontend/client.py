"""EngineClient: the async face of the engine that every protocol adapter talks to.

Adapters call ``await client.generate(GenerateRequest)`` (or ``submit(Submission)`` for the
several choices of one request) and iterate the returned ``RequestStream``; controls go
through the stream or the client by request id. Whether a request gets in, and with which
parameters, is decided once for every protocol by the client's ``SubmissionPolicy``
(``rill.frontend.policy``); whether the engine can take requests at all by ``state()``. The
in-process implementation (``InprocClient``) runs the synchronous ``EngineCore`` in one
dedicated thread; commands cross into it through a thread-safe queue and each engine step's
outputs come back to the event loop in one ``call_soon_threadsafe`` hop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

from rill.errors import EngineDead, ModelLoadError, RillError
from rill.frontend.admission import Prompt
from rill.frontend.stream import RequestStream
from rill.types import EngineStats, GenerateRequest, ModelInfo, RequestId, SamplingParams

Phase = Literal["loading", "ready", "failed", "stopped"]
"""Where the engine is: ``loading`` the model, ``ready`` for requests, ``failed`` to load (for
good), or ``stopped`` after it had run (crashed or shut down; for good)."""


class ModelLoadFailed(ModelLoadError, EngineDead):
    """The model failed to load: the engine will never run. What a request gets in the
    ``failed`` phase, on every protocol: a wire that names failed loads (``/generate``'s
    ``model_loading_error``) finds it as a ``ModelLoadError``, the others as ``EngineDead``."""

    code = "engine_dead"


class EngineState(msgspec.Struct, frozen=True, kw_only=True):
    """The engine's phase and what a request gets in it (``EngineClient.state``).

    Attributes:
        phase: see ``Phase``.
        progress: loading progress in percent (0–100) while ``loading``, else None.
        eta_s: estimated seconds of loading left (None when unknown or not loading).
        error: the one error every request gets in this phase (``ModelNotReady`` while
            loading, ``ModelLoadFailed`` once loading failed, ``EngineDead`` once stopped);
            None when ready.
    """

    phase: Phase
    progress: float | None = None
    eta_s: float | None = None
    error: RillError | None = None


class MetricsSink(Protocol):
    """Receives per-request figures when a request ends and counts refusals (implemented by
    ``rill.frontend.metrics.Metrics``)."""

    def observe_request(
        self,
        *,
        protocol: str,
        finish_reason: str,
        queue_s: float | None,
        ttft_s: float | None,
        inter_token_s: list[float],
        e2e_s: float,
        num_prompt_tokens: int,
        num_generated_tokens: int,
        prefill_s: float | None = None,
        decode_s: float | None = None,
    ) -> None:
        """Record one finished request; ``prefill_s`` runs from its first step to its first
        token, ``decode_s`` from its first token to its last."""
        ...

    def observe_rejection(self, *, protocol: str, code: str) -> None:
        """Count one request of ``protocol`` refused before it started, by its error ``code``."""
        ...


class Submission(msgspec.Struct, frozen=True, kw_only=True):
    """The choices of one client request, admitted in one trip (``EngineClient.submit``).

    Every prompt is tokenized (``rill.frontend.admission``), then ``num_candidates`` engine
    requests are started per prompt, in order: choice ``k`` is for prompt ``k //
    num_candidates`` and is named ``f"{request_id}-{k}"``. All or none: when a choice is
    refused, the ones already started are cancelled.

    Attributes:
        prompts: texts, token-id lists, or one chat (a ``GenerateRequest`` holding only its
            ``messages``, template settings and ``tools``).
        sampling: the parameters of every choice, validated once for the whole submission.
            ``max_tokens`` is lowered to what remains of the context after each prompt (and
            to the server's cap), and ``min_tokens`` to ``max_tokens``: asking
            ``MAX_TOKENS_LIMIT`` asks for the whole rest of the context.
        num_candidates: engine requests per prompt. With a ``seed``, candidate ``i`` gets
            ``seed + i`` (the candidates differ, yet repeat between runs); only the first
            candidate of a prompt asks for prompt logprobs (the others share its prefill).
        allow_prefill_only: ``max_tokens`` 0 computes the prompt only (else it is refused).
        request_id: prefix of the choices' ids.
        protocol: labels metrics.
        principal: who asks (rate limits, memory shares).
        deadline_s: a time limit of the request's own (the server's applies too).
        prepare: CPU work of the protocol's to run before any choice starts, off the event
            loop where grammar compiles run (the OpenAI API's tool-argument validators).
    """

    prompts: list[Prompt]
    sampling: SamplingParams
    num_candidates: int = 1
    allow_prefill_only: bool = False
    request_id: str
    protocol: str = "other"
    principal: str | None = None
    deadline_s: float | None = None
    prepare: Callable[[], object] | None = None


@runtime_checkable
class EngineClient(Protocol):
    """What a protocol adapter may ask of the engine: every member adapters, ``/health`` and the
    playground use (``tests/frontend/test_client_protocol.py`` checks the two stay equal).

    ``generate`` and ``submit`` raise ``InvalidRequest`` / ``ContextLengthExceeded`` (bad
    input), ``QueueFull`` / ``RateLimited`` (retryable) or the error of ``state()`` (not ready).
    Control calls by id raise ``RequestNotFound`` for unknown or finished requests; ``modify``
    raises ``InvalidRequest`` and changes nothing when a value is invalid.
    """

    model_info: ModelInfo | None
    """The loaded model's facts; None until it has loaded."""

    @property
    def served_model_name(self) -> str:
        """The model's name for clients and metrics (``rill.config.served_model_name``), also
        before it has loaded."""
        ...

    def state(self) -> EngineState:
        """The engine's phase and the error a request gets in it (the one place that decides)."""
        ...

    def require_model(self) -> ModelInfo:
        """The served model's facts, or raise ``state().error`` (the one readiness check of requests)."""
        ...

    async def wait_ready(self) -> None:
        """Return once the model is loaded; raise ``state().error`` if it failed to load or the
        engine has stopped."""
        ...

    async def generate(self, request: GenerateRequest) -> RequestStream:
        """Tokenize (applying the chat template for ``messages``), check, and submit one request.

        The chat template and the tokenizer run off the event loop; a prompt over the
        server's character bound is refused first with ``PromptTooLarge``.
        """
        ...

    async def submit(self, submission: Submission) -> list[RequestStream]:
        """Tokenize every prompt, check, and start every choice of ``submission`` (all or none);
        the streams come in choice order. Raises as ``generate``."""
        ...

    async def tokenize(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """Token ids of each prompt, exactly as ``generate`` would compute them (same bound,
        same pool, the chat template applied to ``messages``); raises as ``generate``."""
        ...

    async def tokenize_prompt(self, prompt: Prompt, add_special_tokens: bool) -> list[int]:
        """Token ids of one prompt, for counting: same size bound and pool as ``tokenize``, but
        a prompt longer than the context is counted rather than refused."""
        ...

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids`` (special tokens kept unless ``skip_special_tokens``),
        checked and decoded off the event loop; ``PromptTooLarge`` past the prompt bound,
        ``InvalidRequest`` for an id outside the vocabulary."""
        ...

    def abort(self, request_id: RequestId) -> None:
        """Cancel a request; a no-op if it already finished."""
        ...

    def pause(self, request_id: RequestId) -> None:
        """Pause a running request (``PAUSED`` event follows)."""
        ...

    def resume(self, request_id: RequestId) -> None:
        """Resume a paused request (``RESUMED`` event follows)."""
        ...

    async def modify(self, request_id: RequestId, patch: dict[str, Any]) -> SamplingParams:
        """Apply a sampling-parameter patch from the next token on; return the new params.

        The patch is validated once, by the policy, with the vocabulary (``InvalidParameter``
        names the engine's field); a new ``response_format`` is compiled off the event loop
        first; concurrent modifies of one request apply in call order. Raises ``RateLimited``
        when a raised ``max_tokens`` needs tokens the principal's bucket lacks, or a new
        grammar's compile finds the principal's request window full; either way the request's
        parameters do not change. ``RequestNotFound`` when the request ended, also while the
        patch waited its turn."""
        ...

    async def regenerate(self, request_id: RequestId) -> None:
        """Restart the request from its prompt (``REGENERATING`` event follows).

        Raises ``RateLimited`` (and the request goes on unchanged) when the principal's bucket
        cannot cover the tokens the restart discards."""
        ...

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` (special tokens skipped); for a few tokens only: it runs on
        the caller's thread."""
        ...

    async def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text the chat template makes of ``messages``, rendered off the event
        loop (``InvalidRequest`` if the model has no template or the template rejects them)."""
        ...

    def queue_position(self, request_id: RequestId) -> tuple[int, int] | None:
        """``(position, num_waiting)`` of a submitted request not scheduled yet (1-based, in
        arrival order), or None once it runs or ends."""
        ...

    def stats(self) -> EngineStats:
        """A snapshot of the engine's gauges and counters."""
        ...

    def replica_stats(self) -> dict[str, EngineStats]:
        """Each engine replica's gauges and counters by replica id (empty for one in-process
        engine; ``/metrics`` shows them with a ``replica`` label)."""
        ...

    async def shutdown(self) -> None:
        """Cancel everything and stop the engine thread."""
        ...
