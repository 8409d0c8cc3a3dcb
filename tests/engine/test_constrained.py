"""Constrained decoding in the sampler: llguidance masks applied per row, matchers advanced per token."""

from __future__ import annotations

import json
import re

import pytest
import torch

from rill.engine import grammar as grammar_module
from rill.engine.grammar import GrammarCompiler, grammar_of, matcher_bytes
from rill.engine.sampler import Sampler
from rill.errors import InvalidRequest
from rill.testing.checkpoints import make_tokenizer
from rill.types import ResponseFormat, SamplingParams

EOS = 2


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def grammars(tok) -> GrammarCompiler:
    return GrammarCompiler(tok.to_str(), tok.get_vocab_size(), [EOS])


def run(sampler: Sampler, keys: list[int], vocab: int, steps: int, seed: int = 0) -> dict[int, list[int]]:
    """Sample until every key's grammar is complete (or ``steps``); the tokens each key got."""
    gen = torch.Generator().manual_seed(seed)
    tokens: dict[int, list[int]] = {k: [] for k in keys}
    for _ in range(steps):
        live = [k for k in keys if not sampler.is_constraint_complete(k)]
        if not live:
            break
        out = sampler.sample(torch.randn(len(live), vocab, generator=gen) * 3, live)
        assert not out.errors
        for key, token in zip(live, out.token_ids):
            tokens[key].append(token)
    return tokens


def text_of(tok, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t != EOS])


def test_regex_rows_and_a_free_row_in_one_batch(tok, grammars: GrammarCompiler) -> None:
    vocab = tok.get_vocab_size()
    s = Sampler(vocab, 8)
    fmt = ResponseFormat(type="regex", regex="(yes|no), [a-z]{2,5}!")
    for key in (0, 1, 2):
        s.add(key, SamplingParams(seed=key), [1], {EOS}, matcher=grammars.matcher(fmt))
    s.add(3, SamplingParams(seed=9), [1], {EOS})
    tokens = run(s, [0, 1, 2, 3], vocab, 40)
    for key in (0, 1, 2):
        assert s.is_constraint_complete(key)
        assert re.fullmatch(r"(yes|no), [a-z]{2,5}!", text_of(tok, tokens[key]))
    assert not s.is_constraint_complete(3)


def test_greedy_row_follows_the_json_schema(tok, grammars: GrammarCompiler) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "c": {"enum": ["x", "y"]}},
        "required": ["n", "c"],
        "additionalProperties": False,
    }
    s = Sampler(tok.get_vocab_size(), 4)
    fmt = ResponseFormat(type="json_schema", json_schema={"schema": schema, "strict": True})
    s.add(0, SamplingParams(temperature=0.0), [1], {EOS}, matcher=grammars.matcher(fmt))
    value = json.loads(text_of(tok, run(s, [0], tok.get_vocab_size(), 40)[0]))
    assert set(value) == {"n", "c"} and 0 <= value["n"] <= 9 and value["c"] in ("x", "y")


def test_the_grammar_wins_over_a_min_tokens_ban(tok, grammars: GrammarCompiler) -> None:
    # min_tokens bans eos, but once "ok" is written the grammar allows nothing else.
    s = Sampler(tok.get_vocab_size(), 2)
    s.add(
        0, SamplingParams(min_tokens=50), [1], {EOS}, matcher=grammars.matcher(ResponseFormat(type="regex", regex="ok"))
    )
    assert text_of(tok, run(s, [0], tok.get_vocab_size(), 10)[0]) == "ok" and s.is_constraint_complete(0)


def test_update_switches_the_constraint_on_mid_stream_and_reset_restarts_it(tok, grammars: GrammarCompiler) -> None:
    vocab = tok.get_vocab_size()
    s = Sampler(vocab, 2)
    s.add(0, SamplingParams(seed=3), [1], {EOS})
    free_ids = run(s, [0], vocab, 5)[0]
    free = text_of(tok, free_ids)
    s.update(0, SamplingParams(seed=3), matcher=grammars.matcher(ResponseFormat(type="regex", regex="[0-9]{3}")))
    constrained_ids = run(s, [0], vocab, 10)[0]
    assert s.is_constraint_complete(0)
    text = text_of(tok, free_ids + constrained_ids)
    assert text.startswith(free) and re.fullmatch("[0-9]{3}", text[len(free) :])
    s.reset(0, [1])
    assert not s.is_constraint_complete(0)
    assert re.fullmatch("[0-9]{3}", text_of(tok, run(s, [0], vocab, 10)[0]))


def test_compiled_constraints_are_cached_and_copies_are_independent(grammars: GrammarCompiler) -> None:
    fmt = ResponseFormat(type="regex", regex="a+b")
    first, second = grammars.matcher(fmt), grammars.matcher(ResponseFormat(type="regex", regex="a+b"))
    assert first is not second
    assert grammars._cache[fmt.cache_key()][0] is not first  # a pristine original stays in the cache
    assert grammars.matcher(ResponseFormat(type="text")) is None


def schema_of(index: int, num_fields: int) -> ResponseFormat:
    """A distinct JSON schema of ``num_fields`` string properties."""
    properties = {f"s{index}_field_{k}": {"type": "string", "maxLength": 8} for k in range(num_fields)}
    return ResponseFormat(
        type="json_schema", json_schema={"name": "s", "schema": {"type": "object", "properties": properties}}
    )


def test_the_compiled_cache_is_bounded_by_memory_not_only_by_count(tok, monkeypatch: pytest.MonkeyPatch) -> None:
    """Distinct schemas past the byte budget evict the least recently used (a count alone let
    100 large schemas hold +200 MiB); one larger than the whole budget is used, not kept."""
    grammars = GrammarCompiler(tok.to_str(), tok.get_vocab_size(), [EOS])
    one = matcher_bytes(grammar_of(schema_of(0, 40)))
    monkeypatch.setattr(grammar_module, "CACHE_BYTES", 3 * one + one // 2)
    formats = [schema_of(i, 40) for i in range(6)]
    for fmt in formats[:3]:
        grammars.matcher(fmt)
    grammars.matcher(formats[0])  # used again: the most recent now
    for fmt in formats[3:5]:
        grammars.matcher(fmt)
    assert grammars.cached_bytes <= grammar_module.CACHE_BYTES
    assert [grammars.is_cached(f) for f in formats] == [True, False, False, True, True, False]
    huge = schema_of(99, 200)
    assert matcher_bytes(grammar_of(huge)) > grammar_module.CACHE_BYTES
    assert grammars.matcher(huge) is not None and not grammars.is_cached(huge)
    assert grammars.is_cached(formats[4])  # the huge one evicted nothing


@pytest.mark.parametrize(
    "fmt",
    [
        ResponseFormat(type="regex", regex="(("),
        ResponseFormat(type="grammar", grammar="start: undefined_rule"),
        ResponseFormat(type="json_schema", json_schema={"schema": {"type": "nonsense"}, "strict": True}),
    ],
)
def test_bad_constraints_are_invalid_requests(grammars: GrammarCompiler, fmt: ResponseFormat) -> None:
    with pytest.raises(InvalidRequest) as caught:
        grammars.matcher(fmt)
    assert caught.value.field == "response_format"


def test_a_forced_tool_call_survives_an_added_non_special_opener() -> None:
    """Qwen2.5's ``<tool_call>`` is an added token that is not special. llguidance used to
    force it as the opener's only allowed token and then refuse it when consumed, so every
    forced call on that model failed. Walking the mask (always the highest allowed id, which
    would pick such a token) now ends in an accepted, parseable call."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    from tokenizers import AddedToken

    from rill.protocols._shared.tool_calls import call_grammar

    tokenizer = make_tokenizer()
    tokenizer.add_tokens(
        [
            AddedToken("<tool_call>", normalized=False, special=False),
            AddedToken("</tool_call>", normalized=False, special=False),
        ]
    )
    vocab = tokenizer.get_vocab_size()
    compiler = GrammarCompiler(tokenizer.to_str(), vocab, [EOS])
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"],
                },
            },
        }
    ]
    matcher = compiler.matcher(ResponseFormat(type="grammar", grammar=call_grammar("hermes", tools)))
    mask = allocate_token_bitmask(1, vocab)
    tokens: list[int] = []
    for _ in range(200):
        if matcher.is_accepting():
            break
        fill_next_token_bitmask(matcher, mask, 0)
        allowed = [i for i in range(vocab) if (int(mask[0, i // 32]) >> (i % 32)) & 1 and i != EOS]
        assert allowed, matcher.get_error()
        token = max(allowed)
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == "get_weather" and isinstance(call["arguments"]["city"], str)
