"""Per-request engine state and the commands that steer requests.

A request's tokens are ``all_ids = prompt_ids + output_ids``; ``num_computed`` of them have
keys/values in the request's KV row. There are no separate prefill and decode phases (vLLM
v1's rule): each step feeds ``all_ids[num_computed:]`` (or a chunk of it), and when that
reaches the end, the logits sample the next token. Prefix reuse, chunked prefill,
recompute after preemption and regenerate all fall out of moving ``num_computed``.

Imports: stdlib and rill.types only (no torch).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rill.types import RequestEvent, RequestId, SamplingParams, TokenLogprob

if TYPE_CHECKING:  # annotations only: the core makes both
    from rill.engine.beam import BeamGroup
    from rill.engine.output import OutputStage


class RequestStatus(enum.Enum):
    """Where a request is in the engine."""

    WAITING = "waiting"  # in the waiting queue (new, preempted, or resumed without KV)
    RUNNING = "running"  # scheduled every step
    PAUSED = "paused"  # out of the batch; keeps its row unless memory is needed
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Mutable state of one request inside the engine (owned by the engine thread)."""

    request_id: RequestId
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float
    seq_no: int
    priority: int = 0
    protocol: str = "other"
    deadline: float | None = None
    require_cached_prefix_tokens: int | None = None
    matcher: Any = None  # grammar matcher of params.response_format, made at admission
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    row: int | None = None
    num_computed: int = 0
    sampler_key: int | None = None
    num_cached_prompt_tokens: int = 0
    is_scheduled_once: bool = False
    is_prefill_reported: bool = False
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    output: OutputStage | None = None  # detokenizer, stop strings, undelivered tokens (made on add)
    beam: BeamGroup | None = None  # num_beams > 1: its search and rows, while it holds rows
    num_beam_tokens_emitted: int = 0  # agreed beam tokens already streamed (survives a restart)
    speculation: Any = None  # rill.engine.speculative.SpeculationState while the request speculates
    # What the next RequestOutput will carry (besides the output stage's tokens).
    pending_events: list[RequestEvent] = field(default_factory=list)
    pending_modified: list[SamplingParams] = field(default_factory=list)  # one per pending MODIFIED event
    num_output_tokens_counted: int = 0  # includes eos (usage), unlike output token ids sent
    cumulative_logprob: float = 0.0  # of every sampled token, eos included (with params.logprobs)
    # Prompt logprobs (params.prompt_logprobs): entries for prompt tokens [0, len), None for the
    # first; None when not asked. Sent once, when complete.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    is_prompt_logprobs_sent: bool = False
    finish_reason: Any = None
    stop_reason: Any = None
    error: Any = None
    _prompt_key: int | None = field(default=None, repr=False)

    @property
    def all_ids(self) -> list[int]:
        """Prompt followed by the generated tokens (a new list)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Length of ``all_ids``."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, start: int, stop: int) -> list[int]:
        """``all_ids[start:stop]`` without building the whole list."""
        num_prompt = len(self.prompt_ids)
        if stop <= num_prompt:
            return self.prompt_ids[start:stop]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - num_prompt]

    @property
    def needs_prompt_logits(self) -> bool:
        """True while prompt logprobs are asked and not all computed: the prefill then needs
        the logits of every position, so the prefix cache cannot serve any of them."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def max_reuse_tokens(self) -> int | None:
        """Most leading tokens the prefix cache may serve (None: any number).

        While prompt logprobs are missing, the logits after every position from the last
        scored token on are needed, so only the positions before it may come from a cached
        prefix: none at first, the part already scored after a preemption.
        """
        if not self.needs_prompt_logits:
            return None
        return len(self.prompt_logprobs) - 1  # type: ignore[arg-type]

    @property
    def prompt_key(self) -> int:
        """A hash of the prompt, made once: requests with equal keys (the ``n``/``best_of``
        candidates of one prompt) count as one request starting (see ``Scheduler.schedule``)."""
        if self._prompt_key is None:
            self._prompt_key = hash(tuple(self.prompt_ids))
        return self._prompt_key

    @property
    def is_finished(self) -> bool:
        """True once a final output has been produced."""
        return self.status is RequestStatus.FINISHED

    @property
    def is_beam(self) -> bool:
        """True for beam-search requests."""
        return self.params.num_beams > 1


# ---- commands: cross from the event loop into the engine thread -----------------------


@dataclass(frozen=True, slots=True)
class AddCommand:
    """Admit a new request."""

    request: Request


@dataclass(frozen=True, slots=True)
class AbortCommand:
    """Cancel a request (client stop, disconnect, timeout)."""

    request_id: RequestId


@dataclass(frozen=True, slots=True)
class PauseCommand:
    """Take a request out of the batch."""

    request_id: RequestId


@dataclass(frozen=True, slots=True)
class ResumeCommand:
    """Put a paused request back."""

    request_id: RequestId


@dataclass(frozen=True, slots=True)
class ModifyCommand:
    """Replace a request's sampling parameters (already validated)."""

    request_id: RequestId
    params: SamplingParams
    matcher: Any = None  # a fresh grammar matcher when the response format changes, else None


@dataclass(frozen=True, slots=True)
class RegenerateCommand:
    """Drop the generation and restart from the prompt."""

    request_id: RequestId


Command = AddCommand | AbortCommand | PauseCommand | ResumeCommand | ModifyCommand | RegenerateCommand
