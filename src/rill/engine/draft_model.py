"""``DraftModel``: greedy draft tokens from a smaller model with the target's vocabulary, on
its own runner (``--speculative-method draft``; ``rill.engine.speculative`` decides who
drafts and how much). Imports the runner boundary (``rill.engine.batch``) and the KV
manager's prefix helper.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rill.engine.batch import ModelRunner, RowWork
from rill.engine.kv_cache import common_prefix_len

CATCH_UP_AS_DECODE = 8  # a draft model catches up on this many tokens or fewer through its decode path


class DraftModel:
    """Greedy draft tokens from a smaller model with the target's vocabulary.

    Its runner has as many KV rows as the target's, and draft row ``i`` serves the request in
    target row ``i``; what each draft row holds is remembered as tokens, so a row taken over
    by another request, a rejected draft or a regenerate is caught up by feeding the tokens
    past the common prefix (the first proposal of a request prefills its prompt in the draft).
    One ``propose`` is one batched draft forward per draft position.

    Args:
        runner: the draft model's runner.
        vocab_size: the target's vocabulary (a draft token past it is never proposed).
    """

    def __init__(self, runner: ModelRunner, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = vocab_size
        self.held: list[list[int]] = [[] for _ in range(runner.num_rows)]
        self.step_s: float | None = None  # moving average of one draft decode forward

    def lag(self, row: int, context: list[int]) -> int:
        """Tokens draft row ``row`` would have to catch up on before drafting after ``context``."""
        return len(context) - common_prefix_len(self.held[row], context)

    def propose(self, entries: Sequence[tuple[int, list[int], int]]) -> list[list[int]]:
        """Drafts for ``(row, context, k)`` entries: up to ``k`` greedy tokens after ``context``
        (a list the draft model keeps as its record of the row, and extends)."""
        drafts: list[list[int]] = [[] for _ in entries]
        work, live = [], []
        for i, (row, context, k) in enumerate(entries):
            if k <= 0 or not context:
                continue
            held = self.held[row]
            valid = min(common_prefix_len(held, context), len(context) - 1)
            fed = context[valid:]
            # A short catch-up (the last verified tokens) runs like decode steps; a prompt, as a prefill.
            work.append(RowWork(row, fed, valid, draft=len(fed) <= CATCH_UP_AS_DECODE))
            self.held[row] = context  # the row's record from now on (drafts are appended to it)
            live.append(i)
        first = True
        while work:
            started = time.perf_counter()
            logits = self.runner.forward(work)
            if not first:  # a decode step (the first may prefill)
                elapsed = time.perf_counter() - started
                self.step_s = elapsed if self.step_s is None else 0.8 * self.step_s + 0.2 * elapsed
            first = False
            tokens = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
            work, going = [], []
            for token, i in zip(tokens, live):
                drafts[i].append(token)
                row, _, k = entries[i]
                if len(drafts[i]) < k:
                    work.append(RowWork(row, [token], len(self.held[row])))
                    self.held[row].append(token)
                    going.append(i)
            live = going
        return drafts
