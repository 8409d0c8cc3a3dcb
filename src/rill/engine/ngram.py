"""Prompt lookup: draft tokens for speculative decoding from the request's own context.

When a model quotes (code edits, summaries, answers that repeat the question), the tokens it
is about to write have often appeared before in its context. ``NgramProposer`` keeps a
request's tokens (prompt, then each accepted token) and, for the last ``n`` of them, finds
their most recent earlier occurrence, longest ``n`` first (``max_n`` down to ``min_n``), and
proposes the ``k`` tokens that followed it. No second model is involved; the target model
verifies the draft in one forward, and rejected tokens never enter the proposer.

Each token appended costs ``max_n - min_n + 1`` dictionary updates (an index from every n-gram
to the position after its latest occurrence), so a proposal costs at most that many lookups
whatever the context's length. The index holds one entry per distinct n-gram: bounded by the
request's context, which the engine already bounds.

Pure: imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramProposer:
    """Draft tokens from the last n-gram's earlier occurrence in one request's context.

    Args:
        k: the most tokens a proposal holds.
        min_n, max_n: the n-gram lengths tried, longest first.

    Raises:
        ValueError: ``k < 1`` or not ``1 <= min_n <= max_n``.
    """

    def __init__(self, k: int = 4, min_n: int = 1, max_n: int = 4) -> None:
        if k < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n, not k={k}, min_n={min_n}, max_n={max_n}")
        self.k = k
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # n -> n-gram -> the position right after its latest occurrence that is not the suffix.
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the context (the prompt at first, then each accepted token)."""
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # the new token's position
            # The n-grams ending just before the new token now have a successor: index them.
            # The suffix itself is indexed only once a token follows it, so it never finds itself.
            for n, index in self._after.items():
                if end >= n:
                    index[tuple(self.tokens[end - n : end])] = end

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (a regenerate or a rewound stream); rebuilds the index."""
        kept = self.tokens[: max(0, length)]
        self.tokens = []
        for index in self._after.values():
            index.clear()
        self.extend(kept)

    def propose(self, k: int | None = None, at_most_n: bool = False) -> list[int]:
        """Up to ``k`` (default ``self.k``) tokens that followed the longest recurring suffix,
        or ``[]`` when no suffix of ``min_n`` tokens or more has occurred before.

        ``at_most_n``: no more tokens than the matched suffix is long (a one-token match is a
        weaker sign of a copy than a four-token one).
        """
        limit = self.k if k is None else k
        if limit < 1:
            return []
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            after = self._after[n].get(tuple(tokens[len(tokens) - n :]))
            if after is not None:
                return tokens[after : after + (min(limit, n) if at_most_n else limit)]
        return []
