"""Cutting engine deltas into per-token pieces (pure helpers of the session).

A ``RequestOutput`` may carry several tokens (the stream coalesces when the consumer lags)
and a restart; its ``token_texts`` join to its text (the engine's contract), so a delta cuts
at any token.
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
    pieces = out.token_texts
    old_text, new_text = "".join(pieces[:cut]), "".join(pieces[cut:])
    logprobs = out.logprobs
    stale = RequestOutput(
        request_id=out.request_id,
        text=old_text,
        token_ids=out.token_ids[:cut],
        token_texts=pieces[:cut],
        logprobs=logprobs[:cut] if logprobs is not None else None,
        usage=out.usage,
    )
    fresh = msgspec.structs.replace(
        out,
        text=new_text,
        token_ids=out.token_ids[cut:],
        token_texts=pieces[cut:],
        logprobs=logprobs[cut:] if logprobs is not None else None,
    )
    return stale, fresh
