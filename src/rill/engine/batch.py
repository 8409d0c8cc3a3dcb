"""The boundary between the scheduler and a model runner: what to compute in one step.

A *row* is a logical KV-cache row: one sequence's keys and values for positions
``[0, max_len)``. The scheduler owns which request holds which row and how many tokens of it
are valid; the runner owns the tensors (and may place rows physically as it likes, e.g.
keeping decode rows contiguous so attention reads a view).

This module is pure: no torch import, so the scheduler can be tested without a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class RowWork:
    """Tokens to feed for one row in one step.

    Attributes:
        row: the logical KV row the tokens' keys/values are written to.
        token_ids: the tokens to feed; one for a decode step, several for a prefill chunk.
        start: tokens already valid in the row before this step; ``token_ids[i]`` sits at
            position ``start + i``. Positions past ``start + len(token_ids)`` are garbage.
        need_logits: whether the logits after the last token of ``token_ids`` are wanted
            (False for a prefill chunk that is not the prompt's last).
        all_logits: the logits after *every* token of ``token_ids`` are wanted (prompt
            logprobs); the item then has ``len(token_ids)`` rows of logits, whatever
            ``need_logits`` says, and its last row is the one ``need_logits`` asks for.
        draft: a short chunk of a sequence that is decoding (a speculative draft being
            verified, a draft model catching up): a runner may compute it token by token as
            decode steps would (so that each position's logits are exactly those decoding
            would give), rather than as a prefill chunk.
    """

    row: int
    token_ids: list[int]
    start: int
    need_logits: bool = True
    all_logits: bool = False
    draft: bool = False

    @property
    def num_logits(self) -> int:
        """Rows of logits this item gets from ``ModelRunner.forward``."""
        if self.all_logits:
            return len(self.token_ids)
        return 1 if self.need_logits else 0


def check_work(work: Sequence[RowWork], num_rows: int, max_len: int, lengths: Sequence[int] | None = None) -> None:
    """Refuse one step's work that breaks the runner contract, before any KV is written.

    Every runner calls it: each row in range and scheduled at most once, each item's tokens
    non-empty and inside ``max_len``; with ``lengths`` (tokens valid in each row), no item may
    start past its row's end, where it would read positions never written.

    Raises:
        ValueError: naming the first row that breaks it.
    """
    seen: set[int] = set()
    for item in work:
        if not 0 <= item.row < num_rows or item.row in seen:
            raise ValueError(f"row {item.row} is out of range or scheduled twice in one step")
        if not item.token_ids or item.start < 0 or item.start + len(item.token_ids) > max_len:
            raise ValueError(
                f"row {item.row}: {len(item.token_ids)} tokens at start {item.start} do not fit in max_len {max_len}"
            )
        if lengths is not None and item.start > lengths[item.row]:
            raise ValueError(
                f"row {item.row} holds {lengths[item.row]} tokens; work at position "
                f"{item.start} would leave a gap of positions never written"
            )
        seen.add(item.row)


class ModelRunner(Protocol):
    """What the engine core needs from a model backend.

    Attributes:
        num_rows: how many logical KV rows exist (concurrent sequences plus cache entries).
        max_len: tokens per row (the engine's context length).
        kv_bytes_per_token: KV memory of one token over all layers.
        vocab_size: width of the logits rows.
        packs_rows: True when steps over rows with low, consecutive numbers run faster (the
            llama.cpp runner); the KV manager then gives a new sequence the lowest row it may
            take instead of the least recently used one.
    """

    num_rows: int
    max_len: int
    kv_bytes_per_token: int
    vocab_size: int
    packs_rows: bool

    @property
    def device(self) -> str | torch.device:
        """Where the logits live (the sampler works there)."""
        ...

    def forward(self, work: Sequence[RowWork]) -> Any:
        """Run one step; return float32 logits ``[n, vocab_size]`` (a torch tensor): each item's
        ``num_logits`` rows (one per position, in order), items in the order of ``work``."""
        ...

    def copy_row(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` positions of row ``src`` into row ``dst``."""
        ...

    def discard(self, row: int, keep_tokens: int) -> None:
        """Row ``row``'s positions from ``keep_tokens`` on will not be read again: a runner may
        give their memory back (the KV manager calls it when a row's sequence shrinks or ends)."""
        ...
