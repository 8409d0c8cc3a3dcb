"""Segmenter: sentences as text streams, reasoning never spoken, tags split anywhere."""

from __future__ import annotations

import pytest

from rill.protocols._shared.segmenter import Segmenter, SegmenterLimits, split


def run(deltas: list[str], **kwargs) -> tuple[list[list[str]], list[str]]:
    seg = Segmenter(**kwargs)
    return [seg.feed(d) for d in deltas], seg.flush()


def all_segments(deltas: list[str], **kwargs) -> list[str]:
    fed, rest = run(deltas, **kwargs)
    return [s for group in fed for s in group] + rest


def test_sentence_is_returned_once_the_next_character_arrives() -> None:
    fed, rest = run(["Hello there.", " How are", " you? Fine"])
    assert fed == [[], ["Hello there."], ["How are you?"]]
    assert rest == ["Fine"]


def test_decimal_point_and_abbreviation_without_space_do_not_cut() -> None:
    assert all_segments(["Pi is 3.14 and e.g.x is odd. Done"]) == ["Pi is 3.14 and e.g.x is odd.", "Done"]


def test_newline_and_cjk_punctuation_cut_at_once() -> None:
    fed, _ = run(["第一句。第二", "句！", "line one\nline"])
    assert fed == [["第一句。"], ["第二句！"], ["line one"]]


def test_thinking_block_is_never_spoken_even_when_tags_are_split() -> None:
    deltas = ["Sure. <th", "ink>secret plan. more", " secret.</thi", "nk> The answer is 4. ", "Bye"]
    segments = all_segments(deltas)
    assert segments == ["Sure.", "The answer is 4.", "Bye"]
    assert not any("secret" in s for s in segments)


@pytest.mark.parametrize("split", range(1, 30))
def test_any_split_point_gives_the_same_segments(split: int) -> None:
    text = "A b. <think>x. y.</think> C d! E"
    assert all_segments([text[:split], text[split:]]) == ["A b.", "C d!", "E"]


def test_reply_starting_inside_thinking_speaks_only_after_close_tag() -> None:
    assert all_segments(["plan it. ok.</think>", "Answer. "], starts_in_thinking=True) == ["Answer."]


def test_unclosed_thinking_is_dropped_at_the_end() -> None:
    assert all_segments(["Hi. <think>never closed. more"]) == ["Hi."]


def test_stray_close_tag_is_removed() -> None:
    assert all_segments(["Hello </think>world. "]) == ["Hello world."]


def test_other_tag_pairs() -> None:
    assert all_segments(["<reasoning>no.</reasoning>Yes. "]) == ["Yes."]


def test_text_without_punctuation_is_cut_at_a_word_boundary() -> None:
    seg = Segmenter(SegmenterLimits(max_chars=20, min_clause_chars=60, first_max_chars=20))
    out = seg.feed("one two three four five six seven")
    assert out == ["one two three four"]
    assert seg.flush() == ["five six seven"]


def test_first_segment_is_shorter_so_speech_starts_sooner() -> None:
    seg = Segmenter(SegmenterLimits(max_chars=30, first_max_chars=10, min_clause_chars=100, first_min_clause_chars=100))
    assert seg.feed("aaa bbb ccc ddd eee fff ggg hhh iii jjj kkk lll ") == ["aaa bbb", "ccc ddd eee fff ggg hhh iii"]
    seg = Segmenter(SegmenterLimits(first_min_clause_chars=5))
    assert seg.feed("Well, then more") == ["Well,"]


def test_long_word_is_cut_hard() -> None:
    seg = Segmenter(SegmenterLimits(max_chars=10, first_max_chars=10))
    assert seg.feed("abcdefghijklmnop") == ["abcdefghij"]


def test_comma_cuts_only_a_long_clause() -> None:
    seg = Segmenter(SegmenterLimits(max_chars=200, min_clause_chars=10, first_min_clause_chars=10))
    assert seg.feed("Hi, there is a long clause here, and more") == ["Hi, there is a long clause here,"]


def test_segments_without_letters_or_digits_are_skipped() -> None:
    assert all_segments(["... !!! ", "—. ", "ok. "]) == ["ok."]


def test_partial_tag_at_the_end_is_text_when_the_reply_ends() -> None:
    assert all_segments(["a < b and x <thi"]) == ["a < b and x <thi"]


def test_split_cuts_a_whole_text_into_sentences_of_bounded_length() -> None:
    """``/v1/audio/speech``'s input: sentences, tags read as written, no segment over the cap."""
    assert split("Dr. Who? Yes!\nIt is 3.5 m long.  ") == ["Dr.", "Who?", "Yes!", "It is 3.5 m long."]
    assert split("no end") == ["no end"]
    assert split("<think>Said aloud.</think> Too.") == ["<think>Said aloud.</think> Too."]
    limits = SegmenterLimits(max_chars=40, first_max_chars=20)
    words = " ".join(f"word{i}" for i in range(100))  # no punctuation at all
    pieces = split(words, limits)
    assert len(pieces[0]) <= 20 and max(len(p) for p in pieces) <= 40
    assert " ".join(pieces) == words
    assert max(len(p) for p in split("x" * 1000)) <= SegmenterLimits().max_chars  # not even a space
