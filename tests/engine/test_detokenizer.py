"""Tests of rill.engine.detokenizer: incremental detokenization and stop strings.

Tokenizers are trained here with the ``tokenizers`` library on generated text full of
multi-byte characters: a byte-level BPE (GPT-2/Llama-3 style), a Metaspace BPE, and a
Llama-2 style BPE with byte fallback.
"""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from rill.engine.detokenizer import MAX_WINDOW_TOKENS, IncrementalDetokenizer, StopStringMatcher
from rill.models.tokenizer import Tokenizer

WORDS = [
    "hello",
    "world",
    "the",
    "quick",
    "brown",
    "fox",
    "über",
    "café",
    "naïve",
    "日本語",
    "中文字符",
    "测试",
    "😀",
    "🚀🔥",
    "👩‍👩‍👧",
    "façade",
    "Ελληνικά",
    "русский",
    "¡hola!",
    "ok",
    "\n",
    "  ",
    "\t",
    "1234",
    "é",
]
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _corpus(num_lines: int, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    return [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(3, 12))) for _ in range(num_lines)]


def _wrap(backend: HFTokenizer) -> Tokenizer:
    return Tokenizer(
        backend,
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
    )


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(_corpus(1500), trainer)
    return _wrap(backend)


@pytest.fixture(scope="module")
def metaspace() -> Tokenizer:
    backend = HFTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *SPECIALS], show_progress=False)
    backend.train_from_iterator(_corpus(1500), trainer)
    return _wrap(backend)


@pytest.fixture(scope="module")
def byte_fallback() -> Tokenizer:
    """Llama-2 style: no pre-tokenizer, "▁" normalizer, rare characters as <0xNN> tokens."""
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", *SPECIALS], limit_alphabet=40, show_progress=False
    )
    trainer_tok.train_from_iterator(_corpus(600), trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    backend = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizer
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(SPECIALS)
    return _wrap(backend)


def _stream(tokenizer: Tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas = [detok.push(token_id) for token_id in output]
    deltas.append(detok.flush())
    return deltas


def _valid_ids(tokenizer: Tokenizer, rnd: random.Random, num_fragments: int) -> list[int]:
    """Ids of valid text (so every character is complete), built from random fragments."""
    ids: list[int] = []
    for _ in range(num_fragments):
        ids += tokenizer.encode(" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(1, 4))), add_special_tokens=False)
        if rnd.random() < 0.1:
            ids.append(tokenizer.token_to_id(rnd.choice(SPECIALS)))
    return ids


# ---------------------------------------------------------------- property: concat == decode


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_random_ids_concatenate_to_decode(byte_level: Tokenizer, skip: bool) -> None:
    rnd = random.Random(1)
    for _ in range(300):
        output = [rnd.randrange(byte_level.vocab_size) for _ in range(rnd.randint(1, 40))]
        prompt = _valid_ids(byte_level, rnd, rnd.randint(0, 3))
        deltas = _stream(byte_level, prompt, output, skip)
        assert "".join(deltas) == byte_level.decode(output, skip_special_tokens=skip), (prompt, output)


@pytest.mark.parametrize("fixture", ["byte_level", "metaspace", "byte_fallback"])
def test_valid_text_concatenates_to_decode_and_never_splits_a_character(fixture: str, request) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(fixture)
    rnd = random.Random(2)
    for _ in range(200):
        output = _valid_ids(tokenizer, rnd, rnd.randint(1, 8))
        deltas = _stream(tokenizer, [], output)
        assert "".join(deltas) == tokenizer.decode(output), output
        assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.parametrize("fixture", ["metaspace", "byte_fallback"])
def test_sentencepiece_random_ids_concatenate_to_decode(fixture: str, request) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(fixture)
    rnd = random.Random(3)
    # Random ids, except that byte tokens come in whole valid characters: ByteFallback
    # decodes a run of byte tokens all at once, so an invalid run changes earlier text.
    byte_ids = set(range(3, 259)) if fixture == "byte_fallback" else set()
    plain = [i for i in range(tokenizer.vocab_size) if i not in byte_ids]
    for _ in range(300):
        output: list[int] = []
        while len(output) < rnd.randint(1, 40):
            output += _valid_ids(tokenizer, rnd, 1) if rnd.random() < 0.3 else [rnd.choice(plain)]
        deltas = _stream(tokenizer, [], output)
        assert "".join(deltas) == tokenizer.decode(output), output


@pytest.mark.parametrize("fixture", ["byte_level", "metaspace", "byte_fallback"])
def test_with_prompt_deltas_are_what_the_output_adds_to_the_prompt(fixture: str, request) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(fixture)
    rnd = random.Random(4)
    for _ in range(200):
        prompt = tokenizer.encode(" ".join(rnd.choice(WORDS[:9]) for _ in range(4)), add_special_tokens=False)
        output = _valid_ids(tokenizer, rnd, rnd.randint(1, 6))
        full, prompt_text = tokenizer.decode(prompt + output), tokenizer.decode(prompt)
        assert full.startswith(prompt_text)
        assert "".join(_stream(tokenizer, prompt, output)) == full[len(prompt_text) :]
        if fixture == "byte_level":
            assert "".join(_stream(tokenizer, prompt, output)) == tokenizer.decode(output)


# ---------------------------------------------------------------- behaviour


def test_multibyte_character_is_held_until_complete(byte_level: Tokenizer) -> None:
    byte_ids = [byte_level.token_to_id(ch) for ch in "ðŁĺĢ"]  # byte-level spelling of 😀 (F0 9F 98 80)
    assert byte_level.decode(byte_ids) == "😀"
    detok = IncrementalDetokenizer(byte_level, byte_level.encode("hi", add_special_tokens=False))
    assert [detok.push(i) for i in byte_ids] == ["", "", "", "😀"]
    detok = IncrementalDetokenizer(byte_level, [])
    assert detok.push(byte_level.token_to_id("a")) == "a"
    assert detok.push(byte_ids[0]) == ""
    assert detok.flush() == "\ufffd"  # generation ended mid-character


@pytest.mark.parametrize("fixture", ["byte_level", "byte_fallback"])
def test_complete_text_before_a_partial_character_is_released(fixture: str, request) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(fixture)
    ids = tokenizer.encode("ok 🦀", add_special_tokens=False)  # 🦀 is not in the corpus: bytes
    assert len(ids) > 3
    deltas = IncrementalDetokenizer(tokenizer, []).push_many(ids[:-1])
    assert deltas == "ok "  # the space is out although 🦀 is incomplete
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.push(i) for i in ids][-1] == "🦀"


def test_leading_space_of_first_generated_token_is_kept_after_a_prompt(metaspace: Tokenizer) -> None:
    prompt = metaspace.encode("hello", add_special_tokens=False)
    output = metaspace.encode("hello world", add_special_tokens=False)[len(prompt) :]
    assert metaspace.id_to_token(output[0]).startswith("▁")
    assert metaspace.decode(output).startswith("world")  # decode alone drops the space
    assert "".join(_stream(metaspace, prompt, output)) == " world"
    assert "".join(_stream(metaspace, [], output)) == "world"


def test_special_tokens_are_skipped_or_kept(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("ok<|im_end|> fox", add_special_tokens=False)
    assert "".join(_stream(byte_level, [], ids)) == "ok fox"
    assert "".join(_stream(byte_level, [], ids, skip=False)) == "ok<|im_end|> fox"


def test_skipped_special_token_keeps_sentencepiece_spacing(metaspace: Tokenizer) -> None:
    hello = metaspace.encode("hello", add_special_tokens=False)
    world = metaspace.encode("hello world", add_special_tokens=False)[len(hello) :]
    ids = hello + [metaspace.token_to_id("<|im_end|>")] * 3 + world
    assert "".join(_stream(metaspace, [], ids)) == metaspace.decode(ids) == "hello world"


def test_reset_starts_over(byte_level: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_level, [])
    first = detok.push_many(byte_level.encode("café 😀", add_special_tokens=False))
    detok.reset(byte_level.encode("prompt", add_special_tokens=False))
    again = detok.push_many(byte_level.encode("café 😀", add_special_tokens=False)) + detok.flush()
    assert first == again == "café 😀"


class _CountingDecoder:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens)


@pytest.mark.parametrize("fixture", ["byte_level", "byte_fallback"])
def test_cost_per_token_is_bounded(fixture: str, request) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(fixture)
    prompt, ids = _valid_ids(tokenizer, random.Random(5), 10), _valid_ids(tokenizer, random.Random(6), 600)
    counter = _CountingDecoder(tokenizer)
    detok = IncrementalDetokenizer(counter, prompt)
    text = detok.push_many(ids) + detok.flush()
    assert text == tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)) :]
    assert len(counter.lengths) <= 2 * len(ids) + 2
    assert max(counter.lengths) <= 10  # a window, never the whole sequence


def test_invalid_bytes_do_not_grow_the_window_forever(byte_level: Tokenizer) -> None:
    lone = byte_level.token_to_id("Ģ")  # byte 0x80: a continuation byte with no start
    counter = _CountingDecoder(byte_level)
    detok = IncrementalDetokenizer(counter, [])
    text = detok.push_many([lone] * 200) + detok.flush()
    assert text == "\ufffd" * 200 == byte_level.decode([lone] * 200)
    assert max(counter.lengths) <= MAX_WINDOW_TOKENS + 1


# ---------------------------------------------------------------- stop strings


def _feed_all(stops: list[str], chunks: list[str]) -> tuple[str, str | None]:
    matcher = StopStringMatcher(stops)
    out = []
    for chunk in chunks:
        text, matched = matcher.feed(chunk)
        out.append(text)
        if matched is not None:
            return "".join(out), matched
    return "".join(out) + matcher.flush(), None


def test_stop_split_over_three_tokens() -> None:
    matcher = StopStringMatcher(["<END>"])
    assert matcher.feed("Hello <E") == ("Hello ", None)
    assert matcher.held == "<E"
    assert matcher.feed("N") == ("", None)
    assert matcher.feed("D> after") == ("", "<END>")
    assert matcher.feed("more") == ("", None)  # finished
    assert matcher.flush() == ""


def test_false_start_is_released() -> None:
    matcher = StopStringMatcher(["<END>"])
    assert matcher.feed("a <EN") == ("a ", None)
    assert matcher.feed("X") == ("<ENX", None)
    assert matcher.feed("<") == ("", None)
    assert matcher.flush() == "<"


def test_stop_that_is_a_prefix_of_another_wins_when_it_completes_first() -> None:
    assert _feed_all(["abc", "ab"], ["xa", "b", "c"]) == ("x", "ab")
    assert _feed_all(["abc", "ab"], ["xabcd"]) == ("x", "ab")  # same result in one chunk
    assert _feed_all(["abc", "bc"], ["xab", "c"]) == ("x", "abc")  # same end: the longer one


def test_overlapping_partial_matches() -> None:
    assert _feed_all(["aab"], ["a", "a", "a", "b", "z"]) == ("a", "aab")
    assert _feed_all(["abab"], ["ab", "a", "b", "ab"]) == ("", "abab")
    assert _feed_all(["abac"], ["aba", "b", "ac!"]) == ("ab", "abac")
    matcher = StopStringMatcher(["aab"])
    assert matcher.feed("xaa") == ("x", None) and matcher.held == "aa"
    assert matcher.feed("a") == ("a", None) and matcher.held == "aa"


def test_stop_at_the_very_start() -> None:
    assert _feed_all(["STOP"], ["STOP and more"]) == ("", "STOP")
    assert _feed_all(["STOP"], ["S", "T", "O", "P"]) == ("", "STOP")


def test_hold_back_only_what_could_begin_a_stop() -> None:
    matcher = StopStringMatcher(["abc", "xyz"])
    assert matcher.feed("hello ab") == ("hello ", None)
    assert matcher.feed("d") == ("abd", None)
    assert matcher.feed("wxy") == ("w", None)
    assert StopStringMatcher([]).feed("anything") == ("anything", None)
    assert StopStringMatcher(["", "a"]).stops == ("a",)


def test_multibyte_stop_strings() -> None:
    assert _feed_all(["😀🔥"], ["日本", "😀", "🔥", "x"]) == ("日本", "😀🔥")
    assert _feed_all(["。"], ["你好", "。再见"]) == ("你好", "。")


def test_random_chunkings_match_a_reference() -> None:
    rnd = random.Random(6)
    alphabet = "ab c😀"
    for _ in range(2000):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 20)))
        stops = ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 4))) for _ in range(rnd.randint(1, 3))]
        cuts = sorted(rnd.sample(range(len(text) + 1), min(len(text) + 1, rnd.randint(0, 6))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        expected = (text[: min(hits)[1]], min(hits)[2]) if hits else (text, None)
        assert _feed_all(stops, chunks) == expected, (text, stops, chunks)


def test_detokenizer_and_matcher_chain(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("hello 日本語 world 😀 fox", add_special_tokens=False)
    detok, matcher = IncrementalDetokenizer(byte_level, []), StopStringMatcher(["語 wor"])
    out, matched = [], None
    for token_id in ids:
        text, matched = matcher.feed(detok.push(token_id))
        out.append(text)
        if matched:
            break
    assert ("".join(out), matched) == ("hello 日本", "語 wor")
