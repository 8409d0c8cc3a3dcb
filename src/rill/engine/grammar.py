"""Constrained decoding: ``ResponseFormat`` → a grammar matcher that yields per-step token masks.

The grammar engine is llguidance (``llguidance`` on PyPI). Both maintained engines were
measured on this 2-core CPU with SmolLM2's 49,152-token BPE vocabulary and three JSON schemas
(a nested object with enum, integer bounds and a bounded array; an array of objects; 20 string
fields), random tokens drawn from each mask for 200 steps (``benchmarks/grammar_engines.py``):

=============  ==================  ============================  =================
engine         tokenizer setup     compile per schema            mask per step
=============  ==================  ============================  =================
llguidance     1.5 s (once)        1.3 / 9 / 14 ms               0.10-0.19 ms mean
xgrammar       0.15 s (once)       15 / 44 / 800 ms              0.01-0.16 ms mean
=============  ==================  ============================  =================

Masks cost about the same; compiling differs by up to 60x, and with one schema per request
(agents send a schema per call) compiling is on the admission path of every request, so
llguidance wins. It also installs alone (a Rust wheel), while xgrammar pulls torch, triton
and a TVM runtime. Its Lark dialect takes regexes, grammars and ``%json {schema}`` rules
alike, which is how forced tool calls are written.

``GrammarCompiler.matcher`` runs at admission (frontend), never in the engine step: it
builds the grammar once per distinct constraint (an LRU of pristine matchers keyed by
``ResponseFormat.cache_key``) and hands out deep copies, which take microseconds. The
sampler then asks each matcher for its mask every step and advances it with each token.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance

from rill.errors import ConstraintFailed, InvalidRequest
from rill.types import ResponseFormat

CACHE_SIZE = 256
"""Most distinct constraints whose compiled matcher is kept."""

CACHE_BYTES = 64 * 2**20
"""Most memory the kept matchers may hold, as ``matcher_bytes`` estimates it.

A count alone did not bound memory: a 63 KB schema compiles to a ~4 MiB matcher, and 100
distinct ones sent as ``modify`` kept +200 MiB resident after their clients left."""

MATCHER_BASE_BYTES = 64 * 1024
MATCHER_BYTES_PER_GRAMMAR_BYTE = 80
"""Resident memory of a compiled matcher against its grammar text, measured with SmolLM2's
49k vocabulary (one arena, trimmed): 1.2 KiB of JSON-schema grammar held 251 KiB, 18 KiB held
894 KiB, 57 KiB held 4.4 MiB (x79), a 71 KiB nested schema 3.5 MiB (x51), a 20 KiB regex of
alternatives 378 KiB (x18), small regexes and Lark grammars 32-37 KiB."""

MAX_ERROR_CHARS = 200
"""Most characters of a grammar engine's message kept in an error (and so in a log line)."""

# Without verbose errors: llguidance's default appends the parser state and the whole grammar
# to every message, and a 60 KB schema's failure then logged 60 KB per request.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)

_ANY_OBJECT = {"type": "object"}
# Compact JSON (", " and ": " separators, no free whitespace): a model may not pad its output
# with unbounded whitespace, so a bounded schema has a bounded length. A schema's own
# "x-guidance" options win.
_JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}


class GrammarCompiler:
    """Compiles response formats for one tokenizer; thread-safe.

    Args:
        tokenizer_json: the ``tokenizers`` JSON of the model's tokenizer.
        vocab_size: the model's vocabulary (the logits' width; may exceed the tokenizer's).
        eos_token_ids: tokens that end generation; the matcher allows them once the grammar
            is complete.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer_args = (_plain_added_tokens(tokenizer_json), vocab_size, sorted(eos_token_ids))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, tuple[llguidance.LLMatcher, int]] = OrderedDict()
        """Pristine matchers by ``ResponseFormat.cache_key``, each with its ``matcher_bytes``."""
        self.cached_bytes = 0
        """The kept matchers' estimated memory (``matcher_bytes``), at most ``CACHE_BYTES``."""
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (or by ``warm``)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                text, vocab_size, eos = self._tokenizer_args
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
            return self._tokenizer

    def warm(self) -> None:
        """Build the tokenizer view now (~1.5 s for a 49k vocabulary); the engine runs it in a
        background thread at load, so neither start-up nor the first constrained request waits."""
        self.tokenizer  # noqa: B018 - the property builds it

    def matcher(self, fmt: ResponseFormat | None) -> llguidance.LLMatcher | None:
        """A fresh matcher for ``fmt`` (None when it does not constrain).

        Raises:
            InvalidRequest: the schema, regex or grammar is invalid or unsupported (the
                message says why, ``field`` is ``response_format``).
        """
        if fmt is None or not fmt.is_constraint:
            return None
        key = fmt.cache_key()
        with self._lock:
            pristine = self._pristine(key)
        if pristine is None:
            grammar = grammar_of(fmt)
            pristine = self._compile(grammar)  # outside the lock: other requests need not wait
            self._keep(key, pristine, matcher_bytes(grammar))
        return pristine.deep_copy()

    def _keep(self, key: str, pristine: llguidance.LLMatcher, cost: int) -> None:
        """Cache ``pristine`` under ``key``, evicting the least recently used past either bound
        (a matcher larger than the whole budget is used once and not kept)."""
        if cost > CACHE_BYTES:
            return
        with self._lock:
            if key in self._cache:  # compiled twice at once: keep the first
                return
            self._cache[key] = (pristine, cost)
            self.cached_bytes += cost
            while len(self._cache) > CACHE_SIZE or self.cached_bytes > CACHE_BYTES:
                _, (_, freed) = self._cache.popitem(last=False)
                self.cached_bytes -= freed

    def _pristine(self, key: str) -> llguidance.LLMatcher | None:
        """Under the lock: the cached matcher of ``key`` (now the most recently used), or None."""
        entry = self._cache.get(key)
        if entry is None:
            return None
        self._cache.move_to_end(key)
        return entry[0]

    def cached(self, fmt: ResponseFormat | None) -> llguidance.LLMatcher | None:
        """A fresh matcher for ``fmt`` if its grammar is compiled already (a copy, ~0.1 ms for
        a 45 KB schema), else None: never compiles, so callers may use it on an event loop."""
        if fmt is None or not fmt.is_constraint:
            return None
        key = fmt.cache_key()
        with self._lock:
            pristine = self._pristine(key)
        return None if pristine is None else pristine.deep_copy()

    def is_cached(self, fmt: ResponseFormat | None) -> bool:
        """Whether ``matcher(fmt)`` would copy a compiled grammar rather than compile one
        (true for a format that does not constrain: there is nothing to compile)."""
        if fmt is None or not fmt.is_constraint:
            return True
        with self._lock:
            return fmt.cache_key() in self._cache

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise InvalidRequest(f"response_format cannot be enforced: {matcher.get_error()}", field="response_format")
        return matcher


def matcher_bytes(grammar: str) -> int:
    """Estimated resident memory of the matcher compiled from ``grammar`` (llguidance does not
    report it): ``MATCHER_BASE_BYTES`` plus ``MATCHER_BYTES_PER_GRAMMAR_BYTE`` per character."""
    return MATCHER_BASE_BYTES + MATCHER_BYTES_PER_GRAMMAR_BYTE * len(grammar)


def bounded(message: str) -> str:
    """A grammar engine's message cut to ``MAX_ERROR_CHARS`` (its first line: the rest is state)."""
    first = message.strip().split("\n", 1)[0]
    return first if len(first) <= MAX_ERROR_CHARS else first[: MAX_ERROR_CHARS - 3] + "..."


def constraint_failed(matcher: llguidance.LLMatcher, what: str) -> ConstraintFailed:
    """The error of a row whose grammar could not be followed while sampling (``what``
    happened); the engine ends that request with it and logs it as one short line."""
    return ConstraintFailed(
        f"the response_format grammar could not be followed: {what}: {bounded(matcher.get_error())}"
    )


def _plain_added_tokens(tokenizer_json: str) -> str:
    """The tokenizer without its non-special added tokens, which stay in the vocabulary as text.

    llguidance marks every added token as special when it checks a sampled token, yet spells a
    forced literal with the tokenizer, which matches added tokens: Qwen2.5's ``<tool_call>``
    (id 151657, added but not special) was the only token a forced tool call allowed and then
    "doesn't satisfy the grammar" (every forced call failed). As plain vocabulary the literal is
    forced as text pieces and the call parses the same; special (control) tokens are untouched.
    """
    try:
        spec = json.loads(tokenizer_json)
    except ValueError:
        return tokenizer_json
    added = spec.get("added_tokens") if isinstance(spec, dict) else None
    if not isinstance(added, list) or all(entry.get("special", True) for entry in added):
        return tokenizer_json
    spec["added_tokens"] = [entry for entry in added if entry.get("special", True)]
    return json.dumps(spec)


def grammar_of(fmt: ResponseFormat) -> str:
    """The llguidance grammar text of a constraining ``fmt``; ``InvalidRequest`` when malformed."""
    try:
        if fmt.type == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(_ANY_OBJECT), defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
        if fmt.type == "json_schema":
            spec = fmt.json_schema or {}
            schema: Any = spec.get("schema")
            # Not strict: keywords llguidance cannot enforce are skipped rather than refused.
            defaults = _JSON_DEFAULTS if spec.get("strict") else {**_JSON_DEFAULTS, "lenient": True}
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults)  # type: ignore[arg-type]
        if fmt.type == "regex":
            return llguidance.LLMatcher.grammar_from_regex(fmt.regex or "")
        if fmt.type == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(fmt.grammar or "")
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"response_format is not valid: {exc}", field="response_format") from exc
    raise InvalidRequest(f"response_format type '{fmt.type}' does not constrain", field="response_format")
