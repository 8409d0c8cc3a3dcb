"""The three logprob shapes of the OpenAI API, built from the engine's ``TokenLogprob``s (pure).

* completions' legacy ``logprobs``: parallel lists of tokens, logprobs, ``{token: logprob}``
  alternatives (the chosen token merged in) and text offsets (``completion``, ``prompt``
  for an echoed prompt, ``join`` to put one before the other);
* chat's ``logprobs.content``: one entry per token with its bytes and the N most likely
  tokens at the position (``chat``);
* vLLM's ``prompt_logprobs``: per prompt token, ``{token id: {logprob, rank, decoded_token}}``
  (``vllm_prompt``).

Token strings come from ``token_text`` (the client's ``decode([id])``), passed in so this
module stays pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from rill.protocols.openai_http.messages import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprobOut,
    PromptLogprobs,
    TopLogprobOut,
)
from rill.types import TokenLogprob


@dataclass(frozen=True)
class LogprobShapes:
    """Builds the logprobs of one response.

    Args:
        num_top: None (no logprobs asked), or how many alternatives per token the client asked for.
        num_prompt_top: None, or how many alternatives vLLM's ``prompt_logprobs`` shows.
        token_text: the text of one token id.
    """

    num_top: int | None
    num_prompt_top: int | None
    token_text: Callable[[int], str]

    def completion(self, logprobs: list[TokenLogprob] | None, offset: int) -> CompletionLogprobs | None:
        """Legacy logprobs of generated tokens whose text starts at character ``offset``
        (None when none were asked or none came)."""
        if self.num_top is None or logprobs is None:
            return None
        out = CompletionLogprobs(top_logprobs=[])
        for lp in logprobs:
            token = self.token_text(lp.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob)
            out.text_offset.append(offset)
            offset += len(token)
            assert out.top_logprobs is not None
            out.top_logprobs.append(self._top_dict(token, lp))
        return out

    def prompt(self, token_ids: list[int], entries: list[TokenLogprob | None] | None) -> CompletionLogprobs:
        """Legacy logprobs of an echoed prompt: its tokens from offset 0, their logprobs and
        alternatives null where the engine has none (the first token; all of them when the
        prompt was not scored)."""
        out = CompletionLogprobs(top_logprobs=[])
        assert out.top_logprobs is not None
        offset = 0
        for token_id, lp in zip(token_ids, entries or [None] * len(token_ids)):
            token = self.token_text(token_id)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            out.token_logprobs.append(None if lp is None else lp.logprob)
            out.top_logprobs.append(None if lp is None else self._top_dict(token, lp))
        return out

    def _top_dict(self, token: str, lp: TokenLogprob) -> dict[str, float]:
        # As vLLM does: the top alternatives plus the chosen token, most likely first.
        top = {token: lp.logprob}
        for alt in lp.top[: self.num_top]:
            top.setdefault(self.token_text(alt.token_id), alt.logprob)
        return dict(sorted(top.items(), key=lambda kv: -kv[1]))

    def vllm_prompt(self, entries: list[TokenLogprob | None] | None) -> PromptLogprobs | msgspec.UnsetType:
        """vLLM's ``prompt_logprobs`` of one prompt (left out of the response unless asked)."""
        if self.num_prompt_top is None or entries is None:
            return msgspec.UNSET
        out: PromptLogprobs = []
        for lp in entries:
            if lp is None:
                out.append(None)
                continue
            shown = {
                str(lp.token_id): PromptLogprobOut(
                    logprob=lp.logprob, rank=lp.rank, decoded_token=self.token_text(lp.token_id)
                )
            }
            for rank, alt in enumerate(lp.top[: self.num_prompt_top], start=1):
                # Alternatives are the most likely tokens in order: their rank is their place.
                place = rank if lp.rank is None or rank < lp.rank else rank + 1
                shown.setdefault(
                    str(alt.token_id),
                    PromptLogprobOut(logprob=alt.logprob, rank=place, decoded_token=self.token_text(alt.token_id)),
                )
            out.append(shown)
        return out

    def chat(self, logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
        """Chat's ``logprobs`` of generated tokens (None when none were asked or none came)."""
        if self.num_top is None or logprobs is None:
            return None
        content = []
        for lp in logprobs:
            token = self.token_text(lp.token_id)
            # OpenAI's top_logprobs are the N most likely tokens at the position, which may
            # or may not include the chosen one: merge it in, sort, keep N.
            ranked = sorted(
                [(lp.token_id, lp.logprob)] + [(a.token_id, a.logprob) for a in lp.top], key=lambda kv: -kv[1]
            )[: self.num_top]
            top = [_top(self.token_text(tid), value) for tid, value in ranked]
            content.append(
                ChatTokenLogprob(token=token, logprob=lp.logprob, bytes=list(token.encode()), top_logprobs=top)
            )
        return ChatLogprobs(content=content)


def join(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    """Legacy logprobs of ``first``'s tokens followed by ``then``'s."""
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=(first.top_logprobs or []) + (then.top_logprobs or []),
        text_offset=first.text_offset + then.text_offset,
    )


def _top(token: str, logprob: float) -> TopLogprobOut:
    return TopLogprobOut(token=token, logprob=logprob, bytes=list(token.encode()))
