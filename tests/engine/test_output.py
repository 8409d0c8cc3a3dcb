"""The output stage's contract: token texts join to the text, whatever the chunking.

Property tests over the fake byte-level tokenizer (one token per byte, so every character
outside ASCII spans two to four tokens and is held back until complete), with stop strings
and outputs taken at random steps; then the same contract end to end over FakeRunner.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rill.engine.output import OutputStage
from rill.engine.request import AddCommand, ModifyCommand
from rill.testing.fake_runner import fake_tokenizer
from rill.types import SamplingParams
from tests.engine.fake_core import PROMPTS, make_engine, make_request, step

CHARS = st.sampled_from(list("ab ñé€😀\n"))
TEXTS = st.lists(CHARS, max_size=24).map("".join)
STOPS = st.lists(st.lists(CHARS, min_size=1, max_size=3).map("".join), max_size=3)


def expected_text(full: str, stops: list[str]) -> tuple[str, str | None]:
    """``full`` cut at the stop string that completes first (on a tie, the longest)."""
    found = [(full.find(s) + len(s), full.find(s), s) for s in stops if s and s in full]
    if not found:
        return full, None
    _, start, stop = min(found)
    return full[:start], stop


def run_stage(ids: list[int], stops: list[str], take_at: set[int]) -> tuple[list[int], list[str], str | None]:
    """Push ``ids`` (taking outputs after the indexes in ``take_at``) as the core does; return
    every delivered id and text, and the stop string matched."""
    stage = OutputStage(fake_tokenizer(), [1], stops)
    delivered_ids: list[int] = []
    texts: list[str] = []
    matched = None
    for i, token in enumerate(ids):
        matched = stage.push(token)
        if matched is not None:
            break
        if i in take_at:
            got_ids, got_texts, _ = stage.take(final=False)
            assert len(got_ids) == len(got_texts) and len(stage._token_ids) <= 1  # at most one token kept back
            delivered_ids += got_ids
            texts += got_texts
    if matched is None:
        matched = stage.flush()
    got_ids, got_texts, _ = stage.take(final=True)
    return delivered_ids + got_ids, texts + got_texts, matched


@settings(max_examples=300, deadline=None)
@given(text=TEXTS, stops=STOPS, take_at=st.sets(st.integers(0, 100)), cut_last_byte=st.booleans())
def test_token_texts_join_to_the_text_cut_at_the_first_stop_string(
    text: str, stops: list[str], take_at: set[int], cut_last_byte: bool
) -> None:
    tokenizer = fake_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    if cut_last_byte and ids and len(text[-1].encode()) > 1:
        ids = ids[:-1]  # generation ended inside a character: its bytes come out as U+FFFD
    full = tokenizer.decode(ids)
    want, want_stop = expected_text(full, stops)
    delivered_ids, texts, matched = run_stage(ids, stops, take_at)
    assert "".join(texts) == want
    assert matched == want_stop
    assert delivered_ids == ids[: len(delivered_ids)]
    if want_stop is None:
        assert delivered_ids == ids  # every token reaches the client, each with its own text


def test_a_token_is_kept_back_while_its_character_is_incomplete() -> None:
    tokenizer = fake_tokenizer()
    first, second = tokenizer.encode("é", add_special_tokens=False)
    stage = OutputStage(tokenizer, [1])
    stage.push(first)
    assert stage.take(final=False)[:2] == ([], [])  # "é" is half there: its first byte waits
    stage.push(second)
    assert stage.take(final=False)[:2] == ([first, second], ["", "é"])


def test_text_released_by_a_new_stop_list_goes_on_the_kept_back_token() -> None:
    tokenizer = fake_tokenizer()
    ids = tokenizer.encode("xab", add_special_tokens=False)
    stage = OutputStage(tokenizer, [1], ["abc"])
    for token in ids:
        stage.push(token)
    assert stage.take(final=False)[:2] == (ids[:2], ["x", ""])  # "ab" may begin "abc": its last token waits
    stage.set_stops([])
    assert stage.take(final=False)[:2] == (ids[2:], ["ab"])


STOP_LIST = ["stoxwu!", "t sh", "aab"]
"""Chosen from what the fake model writes for these prompts and seeds: r0 begins "stoxwf" (held
until its stop strings are dropped), r1 holds "t sh", r3 "aab"."""


def test_over_fakerunner_every_output_joins_and_a_stop_string_modify_releases_held_text() -> None:
    engine = make_engine()
    core = engine.core
    requests = [
        make_request(
            engine, f"r{i}", PROMPTS[i], temperature=1.0, seed=i, max_tokens=40, ignore_eos=True, stop=STOP_LIST
        )
        for i in range(4)
    ]
    for request in requests:
        core.apply(AddCommand(request))
    texts: dict[str, str] = {r.request_id: "" for r in requests}
    num_steps = 0
    while core.has_work():
        num_steps += 1
        assert num_steps < 500
        if num_steps == 6:
            assert texts["r0"] == ""  # "stoxw" so far, all of it a possible start of "stoxwu!"
            core.apply(ModifyCommand("r0", SamplingParams(temperature=1.0, seed=0, max_tokens=40, ignore_eos=True)))
        for out in step(engine, {}):
            assert "".join(out.token_texts) == out.text and len(out.token_texts) == len(out.token_ids)
            texts[out.request_id] += out.text
    stops = STOP_LIST
    for request in requests:
        full = engine.tokenizer.decode(request.output_ids)
        if request.request_id == "r0" and request.finish_reason == "length":
            assert texts["r0"] == full  # the stop strings were dropped before any matched
        else:
            assert texts[request.request_id] == expected_text(full, stops)[0]
    assert [r.finish_reason for r in requests] == ["length", "stop", "length", "stop"]
