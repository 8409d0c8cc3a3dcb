"""A GGUF file's tokenizer, rebuilt from its ``tokenizer.ggml.*`` metadata as a Hugging Face
``tokenizers.Tokenizer``: byte-level BPE (GPT-2, Llama 3, Qwen2 and SmolLM splits) or
SentencePiece-style BPE, with the file's special tokens, BOS/EOS rules and chat template
(``TokenizerSpec``). ``rill.models.gguf_loader`` reads the file and asks for it.

Imports tokenizers and ``rill.errors`` (and ``rill.models.tokenizer`` when a spec is wrapped).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from rill.errors import ModelLoadError

log = logging.getLogger("rill.models.gguf")

# llama.cpp token types (tokenizer.ggml.token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Pre-tokenizer splits of byte-level BPE vocabularies by ``tokenizer.ggml.pre``: the regexes
# their merges were learned with (applied in order, each piece isolated).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BPE_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),  # llama.cpp's converter's name for it
    # SmolLM, StarCoder and friends split every digit apart before the GPT-2 rules.
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}
"""``tokenizer.ggml.pre`` → the regex splits of byte-level BPE models."""


@dataclass
class TokenizerSpec:
    """A tokenizer built from GGUF metadata, ready to wrap or to save as ``tokenizer.json``.

    Attributes:
        backend: the ``tokenizers.Tokenizer`` (post-processor adds BOS/EOS as the file says).
        special_tokens: ``bos_token``/``eos_token``/``unk_token``/``pad_token`` → text.
        chat_template: ``tokenizer.chat_template`` or None.
        eos_token_ids: end-of-sequence ids (``tokenizer.ggml.eos_token_id`` and ``eot_token_id``).
        add_bos_token, add_eos_token: what ``encode(add_special_tokens=True)`` adds.
    """

    backend: tokenizers.Tokenizer
    special_tokens: dict[str, str]
    chat_template: str | None
    eos_token_ids: list[int]
    add_bos_token: bool
    add_eos_token: bool

    def tokenizer(self, name: str) -> Any:
        """The ``rill.models.tokenizer.Tokenizer`` of these parts, named ``name``."""
        from rill.models.tokenizer import Tokenizer

        return Tokenizer(
            self.backend,
            special_tokens=self.special_tokens,
            chat_templates={"default": self.chat_template} if self.chat_template else {},
            extra_eos_token_ids=self.eos_token_ids,
            name=name,
        )

    def to_json(self) -> dict[str, Any]:
        """JSON values ``from_json`` rebuilds the spec from (the packed-model cache keeps them)."""
        return {
            "backend": self.backend.to_str(),
            "special_tokens": self.special_tokens,
            "chat_template": self.chat_template,
            "eos_token_ids": self.eos_token_ids,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TokenizerSpec:
        """The spec ``to_json`` wrote."""
        return cls(
            tokenizers.Tokenizer.from_str(data["backend"]),
            data["special_tokens"],
            data["chat_template"],
            data["eos_token_ids"],
            data.get("add_bos_token", False),
            data.get("add_eos_token", False),
        )


def build_tokenizer(reader: Any, metadata: dict[str, Any], source: str) -> TokenizerSpec:
    """Build the tokenizer of ``tokenizer.ggml.model`` (``gpt2`` byte-level BPE, or ``llama``
    sentencepiece-style BPE with byte fallback) from the file's vocabulary.

    Raises:
        ModelLoadError: another tokenizer model, or missing vocabulary.
    """
    kind = metadata.get("tokenizer.ggml.model")
    fields = reader.fields
    if "tokenizer.ggml.tokens" not in fields:
        raise ModelLoadError(f"{source}: the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"].contents())
    types: list[int] = (
        list(fields["tokenizer.ggml.token_type"].contents()) if "tokenizer.ggml.token_type" in fields else []
    )
    if kind == "gpt2":
        merges = list(fields["tokenizer.ggml.merges"].contents()) if "tokenizer.ggml.merges" in fields else []
        backend, spelled = _byte_level_bpe(tokens, merges, str(metadata.get("tokenizer.ggml.pre", "default")), source)
    elif kind == "llama":
        backend, spelled = _sentencepiece_bpe(tokens, metadata)
    else:
        raise ModelLoadError(f"{source}: tokenizer model {kind!r} is not supported (gpt2 and llama are)")
    _add_special_tokens(backend, tokens, spelled, types)
    special = {
        name: tokens[int(metadata[f"tokenizer.ggml.{key}"])]
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
        if f"tokenizer.ggml.{key}" in metadata and 0 <= int(metadata[f"tokenizer.ggml.{key}"]) < len(tokens)
    }
    # llama.cpp adds BOS to sentencepiece vocabularies whose file does not say otherwise.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    _set_post_processor(backend, special, add_bos, add_eos)
    eos_ids = [
        int(metadata[key]) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if key in metadata
    ]
    template = metadata.get("tokenizer.chat_template")
    return TokenizerSpec(
        backend,
        special,
        template if isinstance(template, str) else None,
        list(dict.fromkeys(eos_ids)),
        add_bos,
        add_eos,
    )


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte → printable character table: printable Latin-1 bytes map to
    # themselves, the other 68 bytes to code points from 256 upwards, in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_bpe(
    tokens: list[str], merges: list[str], pre: str, source: str
) -> tuple[tokenizers.Tokenizer, list[str]]:
    table = _bytes_to_unicode()
    alphabet = set(table.values())
    # Tokens are stored in the byte alphabet; a control token written in other characters is
    # spelled byte by byte so the vocabulary keeps one entry per id.
    spelled = [t if set(t) <= alphabet else "".join(table[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))  # type: ignore[arg-type]
    splits = BPE_PRE_TOKENIZERS.get(pre)
    if splits is None:
        log.warning("%s: unknown pre-tokenizer %r; splitting text as GPT-2 does", source, pre)
        splits = BPE_PRE_TOKENIZERS["gpt2"]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend, spelled


def _sentencepiece_bpe(tokens: list[str], metadata: dict[str, Any]) -> tuple[tokenizers.Tokenizer, list[str]]:
    # llama.cpp stores sentencepiece pieces with "▁" for spaces, except Gemma's pieces made only
    # of spaces, which it stores as real spaces: spell those back.
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    merges = _merges_from_vocab(spelled, vocab)
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    unk_token = spelled[int(unk)] if unk is not None else None
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    if metadata.get("tokenizer.ggml.add_space_prefix", False):
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    else:
        backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if metadata.get("tokenizer.ggml.add_space_prefix") else [])
    )
    return backend, spelled


def _merges_from_vocab(spelled: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    # A GGUF sentencepiece vocabulary lists no merges. Every way of cutting a piece into two
    # pieces of the vocabulary is a merge; earlier pieces in the file merge first (the file's
    # order is sentencepiece's merge order), and for one piece, the longer left part first.
    ranked: list[tuple[int, int, str, str]] = []
    for index, piece in enumerate(spelled):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((index, -cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], spelled: list[str], types: list[int]) -> None:
    # Control tokens (<|im_end|>, <start_of_turn>) must never be cut into pieces; user-defined
    # ones (e.g. "\n\n" in Gemma) are matched whole too but are ordinary text.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, s, kind in zip(tokens, spelled, types)
        if kind == _TOKEN_CONTROL and t == s
    ]
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, s, kind in zip(tokens, spelled, types)
        if kind == _TOKEN_USER_DEFINED and t == s
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _set_post_processor(backend: tokenizers.Tokenizer, special: dict[str, str], add_bos: bool, add_eos: bool) -> None:
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    if not (add_bos or add_eos):
        return
    single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
    pair = single + " " + " ".join([f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
    ids = [(bos, backend.token_to_id(bos))] * add_bos + [(eos, backend.token_to_id(eos))] * add_eos  # type: ignore[arg-type]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)
