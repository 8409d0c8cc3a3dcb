"""Property tests (STYLE rule 9, issue 12): every codec and every session of the six protocols,
under at least 10,000 generated inputs per target and run, raises only documented errors,
and accepts every valid input.

Hypothesis draws, per example, a seed for a batch of inputs from the fast seeded generators
of ``gen`` (valid messages, hostile variants of them, raw bytes), plus one byte string and
one JSON document of its own (with lone surrogates, huge integers, deep nesting). Runs are
derandomized, so CI is deterministic. ``RILL_FUZZ_EXAMPLES`` sets the number of inputs per
target (default 10,000); ``python -m tests.fuzz.longrun`` runs millions.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.fuzz import targets

NUM_INPUTS = int(os.environ.get("RILL_FUZZ_EXAMPLES", "10000"))
"""Generated inputs per target (codec + session) in one run."""

WITHOUT_VALID = {"evergreen.session"}
"""Targets whose inputs are all hostile or raw (the Evergreen session target sends
well-typed messages with hostile content)."""

BATCH = 25
"""Seeded inputs per Hypothesis example (keeps Hypothesis' own overhead small)."""

_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**63, -(2**63) - 1, 10**400, 2**64]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.sampled_from(["\ud800", "\udfff", "a\udc00", "\x00", "é", "[" * 70]),
)
_json = st.recursive(
    _leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def _to_bytes(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


blobs = st.one_of(st.binary(max_size=96), _json.map(_to_bytes))


@pytest.mark.parametrize("name", list(targets.TARGETS))
def test_codec_and_session_raise_only_documented_errors(name: str) -> None:
    stats = targets.Stats()
    num_examples = max(1, -(-NUM_INPUTS // (BATCH + 1)))

    @settings(
        max_examples=num_examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(seed=st.integers(min_value=0, max_value=2**62), blob=blobs)
    def check(seed: int, blob: bytes) -> None:
        for offset in range(BATCH):
            targets.run_one(name, seed + offset, stats)
        targets.run_one(name, seed, stats, given=blob)

    check()
    assert stats.num_inputs >= NUM_INPUTS
    # A decoder refusing everything fails here: valid inputs are a fifth or more of the run
    # and every one was accepted (run_one raises otherwise); hostile ones are mostly refused.
    valid, accepted_of_valid = stats.by_kind.get("valid", [0, 0])
    assert accepted_of_valid == valid and (name in WITHOUT_VALID or valid >= stats.num_inputs // 5)
    if "hostile" in stats.by_kind:
        hostile, accepted_of_hostile = stats.by_kind["hostile"]
        assert 0 < accepted_of_hostile < hostile
    assert 0 < stats.num_accepted < stats.num_inputs
