"""Prompt lookup (``rill.engine.ngram``): proposals equal a brute-force search of the context."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rill.engine.ngram import NgramProposer


def _searched(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: the longest suffix (max_n down to min_n) that occurred earlier, its
    latest earlier occurrence, and the k tokens after it."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):  # earlier occurrences, latest first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_a_quoted_span_is_proposed_from_where_it_appeared() -> None:
    proposer = NgramProposer(k=3, min_n=2, max_n=3)
    proposer.extend([5, 6, 7, 8, 9, 1, 2])
    assert proposer.propose() == []  # (1, 2) and (2,) with min_n=2: nothing recurs yet
    proposer.extend([6, 7])
    assert proposer.propose() == [8, 9, 1]  # "6 7" appeared at 1-2; what followed it
    assert proposer.propose(k=1) == [8] and proposer.propose(k=0) == []
    proposer.extend([8, 9, 1, 2])
    assert proposer.propose() == [6, 7, 8]  # the latest earlier "9 1 2" is at 4-6 (longest n first)


def test_the_suffix_never_matches_itself_and_a_proposal_may_run_short() -> None:
    proposer = NgramProposer(k=4, min_n=1, max_n=2)
    proposer.extend([3])
    assert proposer.propose() == []
    proposer.extend([3])
    assert proposer.propose() == [3]  # "3" occurred at 0, followed by the current "3"
    proposer.extend([4, 3])
    assert proposer.propose() == [4, 3]  # latest earlier "3" (position 1): 4, 3 then the end


def test_truncate_forgets_what_was_cut() -> None:
    proposer = NgramProposer(k=2, min_n=1, max_n=3)
    proposer.extend([1, 2, 3, 1, 2, 3, 9, 1])
    proposer.truncate(3)
    assert proposer.tokens == [1, 2, 3] and proposer.propose() == []
    proposer.extend([1])
    assert proposer.propose() == [2, 3]


def test_bad_settings_are_refused() -> None:
    for kwargs in ({"k": 0}, {"min_n": 0}, {"min_n": 3, "max_n": 2}):
        with pytest.raises(ValueError):
            NgramProposer(**kwargs)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=60),
    cuts=st.lists(st.integers(1, 7), max_size=12),
    k=st.integers(1, 5),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    truncate_at=st.integers(0, 70),
)
def test_proposals_equal_a_search_of_the_context_however_it_arrived(tokens, cuts, k, min_n, extra, truncate_at) -> None:
    """Fed in any chunks, and after a truncation, every proposal is the brute-force one."""
    proposer = NgramProposer(k=k, min_n=min_n, max_n=min_n + extra)
    pos, sizes = 0, iter(cuts)
    while pos < len(tokens):
        size = next(sizes, len(tokens))
        proposer.extend(tokens[pos : pos + size])
        pos += size
        assert proposer.propose() == _searched(tokens[:pos], k, min_n, min_n + extra)
    proposer.truncate(truncate_at)
    assert proposer.propose() == _searched(tokens[:truncate_at], k, min_n, min_n + extra)
