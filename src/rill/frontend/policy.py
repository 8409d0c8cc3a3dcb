"""SubmissionPolicy: the one place that decides whether, and as what, a request reaches the engine.

It plays the part vLLM's input processor plays, for every protocol alike: the engine client
(``rill.frontend.inproc``) hands it each request (``generate``), the choices of one request
(``submit``) and each ``/generate`` ``modify``, and starts in the engine only what it admits,
with the parameters it returns. Protocols map their wire fields to ``SamplingParams`` and
leave the checks here: a request's parameters are validated once, with the vocabulary.

One request, in order:

1. its parameters: the server's token cap (``--max-tokens-cap``) and, for a ``Submission``,
   ``max_tokens`` lowered to what remains of the context after the prompt; validated once
   (before tokenizing when they do not depend on the prompt, after when they do);
2. its prompts, tokenized off the event loop (``rill.frontend.admission``: size bound, chat
   template, context bound) and the protocol's own CPU work (``Submission.prepare``);
3. per engine request: its grammar compiled off the event loop (``rill.frontend.grammars``;
   refused first when the rate limits would refuse it anyway), then the checks that need
   the engine's state (empty prompt, prompt-logprobs bound, beam rows, queue bound, a
   duplicate id) and, last, the principal's rate limits (``rill.frontend.ratelimit``), so
   that a request refused for another reason counts for nothing;
4. its time limit: the shorter of its own and the server's (``--request-timeout-s``).

A ``modify`` is patched and validated once, capped, and its new grammar compiled as a new
request's is. What a client may hold besides the KV cache is charged to ``memory``. An
embeddings request (``rill.frontend.embeddings``) generates nothing: it counts in its
principal's request window (``count_request``) and takes no tokens from the bucket.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from rill.config import EngineConfig, PolicyConfig
from rill.engine.builder import Engine
from rill.errors import InvalidRequest, MemoryPressure, QueueFull
from rill.frontend.admission import Prompt, PromptAdmission
from rill.frontend.budget import MemoryBudget
from rill.frontend.client import Submission
from rill.frontend.grammars import GrammarAdmission
from rill.frontend.ratelimit import Account, AsyncLimiter, LocalLimiter, RateLimiter, RateLimits, open_account
from rill.types import MAX_SEED, GenerateRequest, SamplingParams

ANONYMOUS_PRINCIPAL = "anonymous"
"""The principal of requests that name none (in-process callers such as benchmarks)."""


@dataclass(slots=True)
class Choice:
    """One engine request the policy admitted up to its last checks (``SubmissionPolicy.admit``)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    principal: str
    protocol: str
    deadline_s: float | None
    priority: int = 0
    require_cached_prefix_tokens: int | None = None


class SubmissionPolicy:
    """Admission of every request, choice and ``modify`` (see the module docstring).

    Args:
        config: the caps, rate limits and time limit that bind every protocol.
        engine: the frontend's bounds and pools: ``max_queue``, ``max_prompt_chars``,
            ``max_prompt_logprobs_tokens``, ``tokenizer_threads``, ``grammar_threads``.
        memory: the server's session-memory budget; each stream's unread output is charged
            to it under the request's principal (None: unbounded).
        clock: the rate limiter's clock (monotonic seconds); for tests.

    Attributes:
        max_tokens_cap: clamp of every request's ``max_tokens`` (None: none).
        request_timeout_s: the server's time limit per request (None: none).
        limiter: the per-principal rate limits, or None when none is set: this process's
            own, or (``rill.cluster``) the one state every front door of a cluster shares.
        admission: the tokenizer pool (``PromptAdmission``).
        grammars: the grammar-compile pool (``GrammarAdmission``).
    """

    def __init__(
        self,
        config: PolicyConfig | None = None,
        engine: EngineConfig | None = None,
        *,
        memory: MemoryBudget | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config = config or PolicyConfig()
        engine = engine or EngineConfig()
        self.max_tokens_cap = config.max_tokens_cap
        self.request_timeout_s = config.request_timeout_s
        limits = RateLimits(
            requests=config.rate_limit_requests,
            window_s=config.rate_limit_window,
            tokens_per_s=config.rate_limit_tokens_per_s,
            burst=config.rate_limit_burst,
            audio_s=config.rate_limit_audio_s,
        )
        self.limiter: AsyncLimiter | None = LocalLimiter(RateLimiter(limits, clock)) if limits.is_on else None
        self.memory = memory
        self.max_queue = engine.max_queue
        self.max_prompt_logprobs_tokens = engine.max_prompt_logprobs_tokens
        self.admission = PromptAdmission(max_prompt_chars=engine.max_prompt_chars, num_threads=engine.tokenizer_threads)
        self.grammars = GrammarAdmission(num_threads=engine.grammar_threads)

    def close(self) -> None:
        """Stop the tokenizer and grammar pools (queued work that has not started is dropped)."""
        self.admission.close()
        self.grammars.close()

    # -- parameters ------------------------------------------------------------------------
    def capped(self, params: SamplingParams, limit: int | None = None) -> SamplingParams:
        """``params`` with ``max_tokens`` at most ``limit`` and the server's cap (``min_tokens``
        lowered with it); ``params`` itself when nothing changes. A valid input stays valid."""
        cap = self.max_tokens_cap
        if limit is not None:
            cap = limit if cap is None else min(cap, limit)
        if cap is None or params.max_tokens <= cap:
            return params
        return msgspec.structs.replace(params, max_tokens=cap, min_tokens=min(params.min_tokens, cap))

    def deadline_s(self, own_s: float | None) -> float | None:
        """A request's time limit: the shorter of its own and the server's (None: none)."""
        limits = [s for s in (own_s, self.request_timeout_s) if s]
        return min(limits) if limits else None

    def modified(self, params: SamplingParams, patch: dict[str, Any], vocab_size: int) -> SamplingParams:
        """``params`` with a ``modify``'s ``patch`` applied: validated once, with the vocabulary,
        then capped (the cap keeps it valid).

        Raises:
            InvalidParameter: an unknown name or a bad value; the request keeps ``params``.
        """
        return self.capped(params.patched(patch).validate(vocab_size=vocab_size))

    async def count_request(self, principal: str | None) -> None:
        """Count one request that generates nothing (``/v1/embeddings``) in its principal's
        request window (``--rate-limit-requests``), or raise ``RateLimited`` and count nothing.
        The token bucket meters generated tokens, so it is not touched."""
        if self.limiter is not None:
            await self.limiter.count_work(principal or ANONYMOUS_PRINCIPAL)

    async def count_audio(self, principal: str | None, audio_s: float) -> None:
        """Count one audio request of ``audio_s`` seconds (0 when not known before the work:
        speech) in its principal's window (``--rate-limit-requests``, ``--rate-limit-audio-s``),
        or raise ``RateLimited`` and count nothing."""
        if self.limiter is not None:
            await self.limiter.count_audio(principal or ANONYMOUS_PRINCIPAL, audio_s)

    def charge_audio(self, principal: str | None, audio_s: float) -> None:
        """Add the seconds of speech made for an admitted request to its principal's window."""
        if self.limiter is not None:
            self.limiter.charge_audio(principal or ANONYMOUS_PRINCIPAL, audio_s)

    # -- admission -------------------------------------------------------------------------
    async def plan_one(self, request: GenerateRequest, engine: Callable[[], Engine]) -> Choice:
        """The one engine request of ``generate(request)``: parameters capped and validated
        (with the vocabulary; prefill-only is the engine's to do, each protocol decides whether
        it offers it), then the prompt tokenized. ``engine`` is the client's readiness check,
        called again after every wait (the engine may die meanwhile)."""
        params = self.capped(request.sampling).validate(
            vocab_size=engine().model_info.vocab_size, allow_prefill_only=True
        )
        [prompt_ids] = await self._token_ids([request], engine)
        return Choice(
            request_id=request.request_id or f"req-{uuid.uuid4().hex}",
            prompt_ids=prompt_ids,
            params=params,
            principal=request.principal or ANONYMOUS_PRINCIPAL,
            protocol=request.protocol,
            deadline_s=self.deadline_s(request.deadline_s),
            priority=request.priority,
            require_cached_prefix_tokens=request.require_cached_prefix_tokens,
        )

    async def plan(self, submission: Submission, engine: Callable[[], Engine]) -> list[Choice]:
        """Every choice of ``submission``: prompts tokenized, then ``max_tokens`` fitted to each
        prompt's room and capped, the parameters validated once (with the vocabulary), and the
        submission's ``prepare`` run in the grammar pool. Raises the first refusal."""
        prompts_ids = await self._token_ids(submission.prompts, engine)
        vocab_size = engine().model_info.vocab_size
        context = engine().model_info.max_context_tokens
        principal = submission.principal or ANONYMOUS_PRINCIPAL
        deadline_s = self.deadline_s(submission.deadline_s)
        asked = submission.sampling
        choices: list[Choice] = []
        for ids in prompts_ids:
            params = self._fitted(asked, context - len(ids), submission.allow_prefill_only)
            if not choices:
                # Prompts differ only in max_tokens and min_tokens, each lowered into range: one
                # validation covers them all.
                params.validate(vocab_size=vocab_size, allow_prefill_only=submission.allow_prefill_only)
            for i in range(submission.num_candidates):
                candidate = params
                if i and params.seed is not None:
                    candidate = msgspec.structs.replace(candidate, seed=(params.seed + i) % MAX_SEED)
                if i and params.prompt_logprobs is not None:
                    # The prompt is the same: its logprobs come with the first candidate, and the
                    # others may share that candidate's prefill (the prefix cache) instead of redoing it.
                    candidate = msgspec.structs.replace(candidate, prompt_logprobs=None)
                choices.append(
                    Choice(
                        request_id=f"{submission.request_id}-{len(choices)}",
                        prompt_ids=ids,
                        params=candidate,
                        principal=principal,
                        protocol=submission.protocol,
                        deadline_s=deadline_s,
                    )
                )
        if submission.prepare is not None:
            await self.grammars.run(principal, submission.prepare)
            engine()
        return choices

    def _fitted(self, params: SamplingParams, room: int, allow_prefill_only: bool) -> SamplingParams:
        """``params`` with ``max_tokens`` at most ``room`` and the cap, ``min_tokens`` at most
        ``max_tokens`` (a prefill-only ask, 0, stays 0 where allowed)."""
        is_prefill_only = params.max_tokens == 0 and allow_prefill_only
        fitted = params if is_prefill_only else self.capped(params, max(1, room))
        if fitted.min_tokens > fitted.max_tokens:
            fitted = msgspec.structs.replace(fitted, min_tokens=fitted.max_tokens)
        return fitted

    async def _token_ids(self, prompts: Sequence[Prompt], engine: Callable[[], Engine]) -> list[list[int]]:
        current = engine()
        ids = await self.admission.token_ids(current.tokenizer, prompts, current.model_info)
        engine()  # the engine may have died while the prompts were tokenized
        return ids

    async def matcher(self, choice: Choice, engine: Callable[[], Engine]) -> Any:
        """The grammar matcher of a constrained choice (None otherwise), compiled in the grammar
        pool, or copied at once if compiled before. A request the rate limits would refuse at
        its end is refused before its compile costs anything."""
        constraint = choice.params.constraint
        if constraint is None:
            return None
        await self.check_constrained(choice)
        matcher = await self.grammars.matcher(engine().grammars, constraint, choice.principal)
        engine()
        return matcher

    async def check_constrained(self, choice: Choice) -> None:
        """Refuse (``RateLimited``) a constrained choice the rate limits would refuse at its end,
        before its grammar compile costs anything."""
        if choice.params.constraint is not None and self.limiter is not None:
            await self.limiter.check(choice.principal, choice.params.max_tokens)

    def admit(self, choice: Choice, engine: Engine, num_queued: int, is_running: Callable[[str], bool]) -> None:
        """The last checks of one engine request but its rate limits (``open_account``), in
        order: ``InvalidRequest`` (empty prompt, too long for prompt logprobs, an id that runs
        already), ``MemoryPressure`` (more beams than KV rows), ``QueueFull``."""
        if not choice.prompt_ids:
            raise InvalidRequest("the prompt is empty", field="prompt")
        params, limit = choice.params, self.max_prompt_logprobs_tokens
        if params.prompt_logprobs is not None and len(choice.prompt_ids) > limit:
            # Every scored position costs a forward and logits over the vocabulary that the
            # prefix cache cannot serve: bounded per request, on every protocol alike.
            raise InvalidRequest(
                f"prompt logprobs are computed for prompts of at most {limit} tokens "
                f"(--max-prompt-logprobs-tokens); this prompt has {len(choice.prompt_ids)}",
                field="prompt_logprobs",
            )
        if params.num_beams > engine.runner.num_rows:
            raise MemoryPressure(
                f"num_beams={params.num_beams} needs more KV rows than the cache has ({engine.runner.num_rows})"
            )
        if num_queued >= self.max_queue:
            raise QueueFull(f"the waiting queue is full ({self.max_queue} requests); retry later", retry_after_s=1.0)
        if is_running(choice.request_id):
            raise InvalidRequest(f"request_id '{choice.request_id}' is already running", field="request_id")

    async def open_account(self, choice: Choice) -> Account | None:
        """The last check of one engine request, after ``admit``'s (so that a request refused
        for another reason counts for nothing): its principal's rate limits, which count it and
        reserve its tokens in the account returned (None without limits), or ``RateLimited``."""
        if self.limiter is None:
            return None
        return await open_account(self.limiter, choice.principal, choice.params.max_tokens)

    async def charge_modify(
        self, old: SamplingParams, new: SamplingParams, principal: str, is_cached: Callable[[Any], bool] | None = None
    ) -> bool:
        """Whether a ``modify`` from ``old`` to ``new`` parameters brings a new constraint to
        compile; one not compiled before (``is_cached`` says; unknown: not) counts as one
        request in the principal's rate-limit window, refused with ``RateLimited`` when it is full."""
        constraint = new.constraint
        if constraint is None or (old.constraint is not None and old.constraint.cache_key() == constraint.cache_key()):
            return False
        if self.limiter is not None and (is_cached is None or not is_cached(constraint)):
            await self.limiter.count_work(principal)
        return True

    async def new_matcher(
        self, old: SamplingParams, new: SamplingParams, principal: str, engine: Callable[[], Engine]
    ) -> Any:
        """The matcher a ``modify`` from ``old`` to ``new`` parameters needs (None: the
        constraint did not change). One not compiled before counts as one request in the
        principal's rate-limit window (refused with ``RateLimited`` before compiling when it is
        full; counted even if the patch is refused after)."""
        compiler = engine().grammars
        if new.constraint is None or not await self.charge_modify(old, new, principal, compiler.is_cached):
            return None
        matcher = await self.grammars.matcher(compiler, new.constraint, principal)
        engine()
        return matcher
