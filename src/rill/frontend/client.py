"""EngineClient: the async face of the engine that every protocol adapter talks to.

Adapters call ``await client.generate(GenerateRequest)`` and iterate the returned
``RequestStream``; controls go through the stream or the client by request id. The
in-process implementation (``InprocClient``) runs the synchronous ``EngineCore`` in one
dedicated thread; commands cross into it through a thread-safe queue and each engine step's
outputs come back to the event loop in one ``call_soon_threadsafe`` hop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from rill.frontend.admission import Prompt
from rill.frontend.stream import RequestStream
from rill.types import EngineStats, GenerateRequest, ModelInfo, RequestId, SamplingParams

T = TypeVar("T")


class MetricsSink(Protocol):
    """Receives per-request figures when a request ends (implemented by frontend.metrics)."""

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


class EngineClient(Protocol):
    """What a protocol adapter may ask of the engine.

    ``generate`` raises ``InvalidRequest`` / ``ContextLengthExceeded`` (bad input),
    ``QueueFull`` (retryable), ``ModelNotReady`` (still loading) or ``EngineDead``. Control
    calls by id raise ``RequestNotFound`` for unknown or finished requests; ``modify``
    raises ``InvalidRequest`` and changes nothing when a value is invalid.
    """

    model_info: ModelInfo | None
    load_error: BaseException | None
    """Why the model failed to load (the engine is then dead); None while loading or loaded."""

    def is_ready(self) -> bool:
        """True once the model is loaded and the engine thread runs."""
        ...

    def require_model(self) -> ModelInfo:
        """The served model's facts; raises ``ModelNotReady`` while loading and ``EngineDead``
        after a failed load or once the engine has stopped (the one readiness check of requests)."""
        ...

    def load_progress(self) -> tuple[float, float | None]:
        """Loading progress in percent (0–100) and the estimated seconds left (None if unknown)."""
        ...

    async def wait_ready(self) -> None:
        """Return once the model is loaded (raise ``EngineDead`` if loading failed)."""
        ...

    async def generate(self, request: GenerateRequest) -> RequestStream:
        """Tokenize (applying the chat template for ``messages``), validate, and submit.

        The chat template and the tokenizer run off the event loop; a prompt over the
        server's character bound is refused first with ``PromptTooLarge``.
        """
        ...

    async def tokenize(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """Token ids of each prompt (a text, token ids, or a request's prompt or messages),
        exactly as ``generate`` would compute them: same bound, same pool, the chat template
        applied to ``messages``. For protocols that need prompt lengths before they build
        their requests; raises as ``generate``."""
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

        Async because a new ``response_format`` is compiled off the event loop first;
        concurrent modifies of one request apply in call order. Raises ``InvalidRequest`` for
        a bad value and ``RateLimited`` when a raised ``max_tokens`` needs tokens the
        principal's bucket lacks, or a new grammar's compile finds the principal's request
        window full; either way the request's parameters do not change.
        ``RequestNotFound`` when the request ended, also while the patch waited its turn."""
        ...

    async def run_compile(self, principal: str | None, work: Callable[[], T]) -> T:
        """Run ``work()`` off the event loop as grammar compiles run (a bounded pool, one at a
        time per principal): for per-request CPU work a protocol needs before its request
        starts, such as building the JSON Schema validators of offered tools."""
        ...

    def regenerate(self, request_id: RequestId) -> None:
        """Restart the request from its prompt (``REGENERATING`` event follows).

        Raises ``RateLimited`` (and the request goes on unchanged) when the principal's bucket
        cannot cover the tokens the restart discards."""
        ...

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` (special tokens skipped); for a few tokens only: it runs on
        the caller's thread."""
        ...

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          **kwargs: Any) -> str:
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

    async def shutdown(self) -> None:
        """Cancel everything and stop the engine thread."""
        ...
