"""Cutting engine deltas into per-token pieces (pure helpers of the session).

A ``RequestOutput`` may carry several tokens (the stream coalesces when the consumer lags);
the spec sends one ``token`` message per token with the cumulative text, so the text must be
cut into per-token pieces that always add up to exactly the delta's text.
"""

from __future__ import annotations

import msgspec

from rill.types import RequestOutput


def split_at_restart(out: RequestOutput) -> tuple[RequestOutput, RequestOutput]:
    """Split a delta holding a ``REGENERATING`` event into the dropped run's tokens and the
    new run's.

    The engine drops pending tokens when it restarts, but the stream may have merged an
    earlier delta (the consumer was behind) with the restart's; the merged usage counts the
    new run only, so the new run's tokens are the last ``completion_tokens`` of the delta.
    """
    num_tokens = len(out.token_ids)
    num_new = min(num_tokens, out.usage.completion_tokens)
    cut = num_tokens - num_new
    if cut == 0:
        return RequestOutput(request_id=out.request_id, usage=out.usage), out
    pieces = split_text(out.text, out.token_texts, num_tokens)
    old_text, new_text = "".join(pieces[:cut]), "".join(pieces[cut:])
    logprobs = out.logprobs
    stale = RequestOutput(request_id=out.request_id, text=old_text, token_ids=out.token_ids[:cut],
                          token_texts=pieces[:cut], logprobs=logprobs[:cut] if logprobs is not None else None,
                          usage=out.usage)
    fresh = msgspec.structs.replace(out, text=new_text, token_ids=out.token_ids[cut:], token_texts=pieces[cut:],
                                    logprobs=logprobs[cut:] if logprobs is not None else None)
    return stale, fresh


def split_text(text: str, token_texts: list[str], num_tokens: int) -> list[str]:
    """Per-token pieces whose concatenation is exactly ``text``.

    ``token_texts`` usually concatenate to ``text``; where the detokenizer held text back
    or a stop string was cut they do not, so each piece is taken only while it keeps the
    running concatenation a prefix of ``text`` and the last piece takes the remainder.
    """
    count = max(num_tokens, len(token_texts))
    if count == 0:
        return [text] if text else []
    pieces: list[str] = []
    done = ""
    for i in range(count - 1):
        candidate = done + (token_texts[i] if i < len(token_texts) else "")
        piece = candidate[len(done):] if text.startswith(candidate) else ""
        pieces.append(piece)
        done += piece
    pieces.append(text[len(done):])
    return pieces
