"""The adaptive prefill chunk: how many prompt tokens a step may add beside running decodes.

A long prompt is prefilled in chunks, each riding in a step with the running requests'
decode tokens; the bigger the chunk, the sooner the prompt is done and the longer that step
makes every running stream wait for its next token. ``PrefillChunkTuner`` steers the cap so
that a step with a chunk costs about two decode steps: running streams' inter-token latency
at most doubles while a long prompt is prefilled.

Pure: the core times its steps and hands each one over (``observe``); nothing here reads a clock.
"""

from __future__ import annotations

from rill.engine.scheduler import SchedulerOutput
from rill.engine.speculative import step_cost

ITL_TARGET_HIGH = 1.8
"""A step with a chunk that costs more decode steps than this shrinks the cap."""

ITL_TARGET_LOW = 1.4
"""A step with a chunk that costs fewer decode steps than this, with the cap binding, grows it."""

DECODE_STEP_ALPHA = 0.2
"""Weight of the newest decode-only step in the running estimate of a decode step."""


class PrefillChunkTuner:
    """Steers the scheduler's prefill chunk cap so a step with a chunk costs about twice a decode step.

    A feedback loop rather than a cost model: a chunk also has a fixed cost (masks, its own
    attention call), so "decode time / per-token prefill time" measured on small chunks
    overstates the per-token cost and spirals the cap down. Instead the cap shrinks when a
    step with a chunk took more than ``ITL_TARGET_HIGH`` decode steps and grows while it took
    less than ``ITL_TARGET_LOW`` with the cap binding.

    Args:
        min_chunk_tokens: the cap never goes below this.
        max_chunk_tokens: nor above this (the step's token budget).
    """

    def __init__(self, min_chunk_tokens: int, max_chunk_tokens: int) -> None:
        self.min_chunk_tokens = min_chunk_tokens
        self.max_chunk_tokens = max_chunk_tokens
        self.decode_step_s: float | None = None
        """Running estimate of a plain decode step (None until a decode-only step was seen)."""

    def observe(self, plan: SchedulerOutput, elapsed_s: float, cap: int) -> int:
        """Take the time of the step ``plan`` ran (its forward and sampling); return the cap
        the next steps' chunks get (``cap`` is the current one)."""
        if plan.num_prefill_tokens == 0 and plan.num_decode_tokens:
            plain_s = elapsed_s
            if plan.num_draft_tokens:  # a verification step: what a plain step would have cost
                plain_s = elapsed_s / step_cost(max(len(item.draft) for item in plan.scheduled))
            alpha = DECODE_STEP_ALPHA
            self.decode_step_s = (
                plain_s if self.decode_step_s is None else (1 - alpha) * self.decode_step_s + alpha * plain_s
            )
        elif plan.num_prefill_tokens and plan.num_decode_tokens and self.decode_step_s:
            ratio = elapsed_s / self.decode_step_s
            if ratio > ITL_TARGET_HIGH:
                cap = int(cap * 0.7)
            elif ratio < ITL_TARGET_LOW and plan.num_prefill_tokens >= 0.9 * cap:
                cap = int(cap * 1.3) + 1
            return max(self.min_chunk_tokens, min(cap, self.max_chunk_tokens))
        return cap
