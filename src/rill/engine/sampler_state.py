"""What the sampler keeps per key (``Slot``), what one step's rows need (``Plan``) and the scratch
arrays kept across steps (``Workspace``). Pure numpy and torch (a seeded row's generator)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rill.types import SamplingParams


@dataclass(slots=True)
class Slot:
    """Everything the sampler keeps for one key, with flags precomputed for the per-step plan."""

    params: SamplingParams
    eos_ids: set[int]
    prompt: list[int]
    outputs: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    is_greedy: bool = False
    is_penalized: bool = False
    is_filtered: bool = False  # top_k, top_p or min_p active
    bias_ids: np.ndarray | None = None
    bias_values: np.ndarray | None = None
    ban_always: np.ndarray | None = None  # eos ids under ignore_eos
    ban_early: np.ndarray | None = None  # ids banned while len(outputs) < min_tokens
    allow_ids: np.ndarray | None = None  # allowed_token_ids within the vocabulary
    matcher: Any = None  # llguidance.LLMatcher of a constrained row (rill.engine.grammar)


class Workspace:
    """Scratch arrays kept across steps, reshaped per use.

    NOTE(sampler): fresh multi-megabyte temporaries page-fault on every step (glibc hands freed
    ones back to the OS), which measured up to 2x the arithmetic at 64 rows x 16k. The workspace
    holds about 13 bytes per row and vocabulary entry, sized to the largest batch seen.
    """

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, int], dtype) -> np.ndarray:
        """A C-contiguous array of ``shape`` with arbitrary contents; valid until the next get
        of ``name`` (callers keep the lifetimes of same-named uses apart)."""
        size = shape[0] * shape[1]
        flat = self._arrays.get(name)
        if flat is None or flat.size < size:
            flat = self._arrays[name] = np.empty(max(size, 0 if flat is None else 2 * flat.size), dtype)
        return flat[:size].reshape(shape)


@dataclass(slots=True)
class Plan:
    """Which rows of this step need which work, from one pass over the slots."""

    greedy_rows: list[int]
    sampled_rows: list[int]
    penalty_rows: list[int]
    bias_rows: list[int]
    ban_rows: list[tuple[int, np.ndarray]]
    logprob_rows: list[int]
    mask_rows: list[int]
    allow_rows: list[int]

    @property
    def is_plain_greedy(self) -> bool:
        """All rows greedy and nothing changes the logits: a bare argmax."""
        return not (
            self.sampled_rows
            or self.penalty_rows
            or self.bias_rows
            or self.ban_rows
            or self.mask_rows
            or self.allow_rows
        )

    @classmethod
    def build(cls, slots: list[Slot]) -> Plan:
        """Sort the rows of one step by the work they need."""
        plan = cls([], [], [], [], [], [], [], [])
        for i, sl in enumerate(slots):
            (plan.greedy_rows if sl.is_greedy else plan.sampled_rows).append(i)
            if sl.is_penalized:
                plan.penalty_rows.append(i)
            if sl.bias_ids is not None:
                plan.bias_rows.append(i)
            # ban_early (eos + stop ids) includes ban_always (eos under ignore_eos).
            early = sl.ban_early is not None and len(sl.outputs) < sl.params.min_tokens
            ban = sl.ban_early if early else sl.ban_always
            if ban is not None:
                plan.ban_rows.append((i, ban))
            if sl.params.logprobs is not None:
                plan.logprob_rows.append(i)
            if sl.matcher is not None:
                plan.mask_rows.append(i)
            if sl.allow_ids is not None:
                plan.allow_rows.append(i)
        return plan
