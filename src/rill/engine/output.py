"""The output stage of one request: token ids in, per-token texts out, joined exactly.

``OutputStage`` owns a request's detokenizer, its stop strings and the tokens not yet
delivered. It guarantees the contract of ``RequestOutput``: the ``token_texts`` of the tokens
``take`` returns concatenate to the text they carry, and over a whole request to its text.

The rule: each token's text is what the stage released when the token arrived (the
detokenizer's delta, cut by the stop strings: a token inside a matched stop string gets "").
Text released without a new token (the held tail at the end, or held text a new stop list
no longer holds) goes to the last token not yet delivered. So that such a token always
exists, ``take`` keeps the last token back while the stage holds text: an incomplete
character or a possible start of a stop string. Its id, text so far and logprob then come
with the next output.

``take_outputs`` turns what each request gained since its last output (the stage's tokens, its
events, a finish) into the ``RequestOutput`` the core returns from a step.

Pure: the tokenizer is duck-typed (see ``rill.engine.detokenizer``); no torch, no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from rill.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from rill.types import RequestOutput, TokenLogprob, Usage

if TYPE_CHECKING:
    from rill.engine.request import Request

log = logging.getLogger("rill.engine")


class OutputStage:
    """Detokenizer, stop strings and undelivered tokens of one request."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        """Start after ``prompt_ids``; ``stop``: the request's stop strings."""
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stops: StopStringMatcher | None = None
        self._token_ids: list[int] = []
        self._texts: list[str] = []
        self._logprobs: list[TokenLogprob | None] = []
        self._carry = ""  # released text with no token to go on (see ``_release``)
        self.set_stops(stop)

    def push(self, token_id: int, logprob: TokenLogprob | None = None, match_stops: bool = True) -> str | None:
        """Add a generated token; return the stop string it completed, if any.

        ``match_stops=False`` passes its text by the stop strings (beam search streams
        agreed tokens only, and stops only at its end).
        """
        text = self.detokenizer.push(token_id)
        matched = None
        if match_stops and self.stops is not None:
            text, matched = self.stops.feed(text)
        self._token_ids.append(token_id)
        self._texts.append(self._carry + text)
        self._logprobs.append(logprob)
        self._carry = ""
        return matched

    def flush(self) -> str | None:
        """Generation ends: release every held text; return a stop string the tail completes."""
        tail = self.detokenizer.flush()
        matched = None
        if self.stops is not None:
            tail, matched = self.stops.feed(tail)
            if matched is None:
                tail += self.stops.flush()
        self._release(tail)
        return matched

    def set_stops(self, stop: Sequence[str]) -> None:
        """Match ``stop`` from now on; text held for the old stop strings is released."""
        held = self.stops.flush() if self.stops is not None else ""
        self.stops = StopStringMatcher(list(stop)) if stop else None
        self._release(held)

    def reset(self, prompt_ids: Sequence[int], stop: Sequence[str]) -> None:
        """Forget every generated token, delivered or not (regenerate from the prompt)."""
        self.detokenizer.reset(prompt_ids)
        self.stops = StopStringMatcher(list(stop)) if stop else None
        self._token_ids, self._texts, self._logprobs, self._carry = [], [], [], ""

    @property
    def is_holding(self) -> bool:
        """True while some text is held back (an incomplete character, a possible stop start)."""
        return self.detokenizer.has_held_text or (self.stops is not None and bool(self.stops.held))

    def take(self, final: bool) -> tuple[list[int], list[str], list[TokenLogprob | None]]:
        """The tokens to deliver now: ids, texts and logprobs (None where none was given).

        Unless ``final``, the last token stays while text is held (the module's rule).
        """
        count = len(self._token_ids) - (0 if final or not self.is_holding else 1)
        ids, self._token_ids = self._token_ids[:count], self._token_ids[count:]
        texts, self._texts = self._texts[:count], self._texts[count:]
        logprobs, self._logprobs = self._logprobs[:count], self._logprobs[count:]
        if final and self._carry:
            log.warning("dropping %d characters the tokenizer released with no token", len(self._carry))
            self._carry = ""
        return ids, texts, logprobs

    def _release(self, text: str) -> None:
        if not text:
            return
        if self._texts:
            self._texts[-1] += text
        else:
            # Unreachable while the decoder never rewrites text it already gave out: held text
            # keeps its token back. Kept for the next token rather than breaking the contract.
            self._carry += text


def take_outputs(touched: Iterable[Request], live: dict[str, Request]) -> list[RequestOutput]:
    """What each ``touched`` request gained since its last output, as ``RequestOutput``s: its
    pending events and modifications are handed over (cleared), its prompt logprobs the first
    time they are complete, and a finished request leaves ``live`` (the core's requests).

    One call per step, one loop over the requests it touched.
    """
    outputs = []
    for request in touched:
        finished = request.is_finished
        wants_logprobs = request.params.logprobs is not None
        # No stage: its AddCommand failed before making one.
        token_ids, token_texts, logprobs = request.output.take(finished) if request.output else ([], [], [])
        outputs.append(
            RequestOutput(
                request_id=request.request_id,
                text="".join(token_texts),
                token_ids=token_ids,
                token_texts=token_texts,
                logprobs=[lp for lp in logprobs if lp is not None] if wants_logprobs else None,
                prompt_logprobs=_take_prompt_logprobs(request),
                cumulative_logprob=request.cumulative_logprob if wants_logprobs else None,
                events=request.pending_events,
                modified=request.pending_modified,
                finished=finished,
                finish_reason=request.finish_reason if finished else None,
                stop_reason=request.stop_reason if finished else None,
                error=request.error if finished else None,
                usage=Usage(
                    prompt_tokens=len(request.prompt_ids),
                    completion_tokens=request.num_output_tokens_counted,
                    cached_tokens=request.num_cached_prompt_tokens,
                ),
                arrival_time=request.arrival_time,
                scheduled_time=request.scheduled_time,
                first_token_time=request.first_token_time,
                last_token_time=request.last_token_time,
            )
        )
        request.pending_events = []
        request.pending_modified = []
        if finished:
            live.pop(request.request_id, None)
    return outputs


def _take_prompt_logprobs(request: Request) -> list[TokenLogprob | None] | None:
    """The request's prompt logprobs the first time they are complete, else None."""
    if request.prompt_logprobs is None or request.is_prompt_logprobs_sent or request.needs_prompt_logits:
        return None
    request.is_prompt_logprobs_sent = True
    return request.prompt_logprobs
