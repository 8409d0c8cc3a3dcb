"""GGUF files (llama.cpp, Ollama) as a first-class model input: weights, config and tokenizer.

``find_gguf(path)`` says whether ``path`` is a ``.gguf`` file or a folder holding exactly one
(and no ``config.json``). ``read_gguf(path)`` opens it with the ``gguf`` package and returns a
``GGUFCheckpoint``: a Hugging Face style ``config.json`` dict, ``generation_config.json``
fields, and a ``tokenizer()`` built from the ``tokenizer.ggml.*`` metadata. Its
``tensors(dtype)`` dequantizes every tensor (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K) and renames it to the Hugging Face name, undoing what llama.cpp's converter
changed: the q/k row permutation of Llama-architecture models and the ``+1`` folded into
Gemma's norm weights. ``convert_to_folder`` writes the same as a Hugging Face folder.

What differs per GGUF architecture (config keys, tensor renames and fix-ups) lives in
``rill.models.registry``'s families; this module only reads, dequantizes and tokenizes.

Imports numpy, torch, tokenizers and gguf; not transformers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

import rill.models.quant_values as quant_values
from rill.errors import ModelLoadError

log = logging.getLogger("rill.models.gguf")

GGUF_SUFFIX = ".gguf"

SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
"""GGML tensor types this loader dequantizes (others are refused by name)."""

_DENSE_TYPES = ("F32", "F16", "BF16")
"""Types ``--weights auto`` serves dense (in the serving dtype)."""

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


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the only ``*.gguf`` of a folder that
    has no ``config.json``; None when ``path`` is not a GGUF input.

    Raises:
        ModelLoadError: a folder (without ``config.json``) holds several ``.gguf`` files.
    """
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise ModelLoadError(f"{path} holds several GGUF files ({names}); pass the one to load with --model")
    return files[0] if files else None


@dataclass
class GGUFCheckpoint:
    """An opened GGUF file.

    Attributes:
        path: the file.
        architecture: ``general.architecture`` (``llama``, ``gemma3``...).
        metadata: every key/value except the tokenizer's large arrays.
        hf_config: the equivalent Hugging Face ``config.json`` dict.
        generation_config: ``generation_config.json`` fields (special ids).
        reader: the open ``gguf.GGUFReader`` (tensors are read from it on demand).
    """

    path: Path
    architecture: str
    metadata: dict[str, Any]
    hf_config: dict[str, Any]
    generation_config: dict[str, Any]
    reader: Any = field(repr=False)

    def tensor_types(self) -> dict[str, str]:
        """GGML type name per tensor (``{"blk.0.attn_q.weight": "Q4_K", ...}``)."""
        return {t.name: t.tensor_type.name for t in self.reader.tensors}

    def tensors(
        self, dtype: torch.dtype = torch.float32, progress: Callable[[int, int], None] | None = None,
        weights: str = "dense",
    ) -> dict[str, Any]:
        """Every tensor under its Hugging Face name: dequantized to ``dtype``, or, for the
        matrices ``weights`` keeps quantized (``rill.models.quant.WEIGHT_MODES``), as
        ``Int4Values`` / ``Int8Values``.

        ``progress(done, total)`` is called after each tensor.

        Raises:
            ModelLoadError: a tensor type outside ``SUPPORTED_TENSOR_TYPES``, or a tensor name
                the architecture does not know.
        """
        from rill.models.registry import family_for_gguf

        family = family_for_gguf(self.architecture, str(self.path))
        rename = family.gguf_tensor_name
        fix = family.gguf_fix_tensor
        out: dict[str, torch.Tensor] = {}
        total = len(self.reader.tensors)
        for done, (gguf_name, values) in enumerate(self._read(weights), start=1):
            hf_name = rename(gguf_name)
            if hf_name is None:
                raise ModelLoadError(f"{self.path}: tensor {gguf_name} is not part of a {self.architecture} model")
            if isinstance(values, np.ndarray):
                out[hf_name] = fix(hf_name, torch.from_numpy(values), self.hf_config).to(dtype).contiguous()
            else:
                # Row fix-ups (llama.cpp's q/k permutation) move every per-row field alike.
                out[hf_name] = quant_values.map_rows(values, lambda t: fix(hf_name, t, self.hf_config).contiguous())  # type: ignore[assignment]  # noqa: B023 - called before the loop moves on
            if progress is not None:
                progress(done, total)
        return out

    def _read(self, weights: str) -> Iterator[tuple[str, Any]]:
        from gguf import quants

        for tensor in self.reader.tensors:
            kind = tensor.tensor_type.name
            if kind not in SUPPORTED_TENSOR_TYPES:
                raise ModelLoadError(
                    f"{self.path}: tensor {tensor.name} has quantization type {kind}, which rill cannot "
                    f"dequantize; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
                )
            shape = tuple(reversed([int(n) for n in tensor.shape]))
            is_matrix = len(shape) == 2
            if is_matrix and kind in quant_values.INT4_TYPES and weights in ("auto", "int4", "int8"):
                exact = quant_values.gguf_int4(tensor.data, kind, shape)  # type: ignore[arg-type]
                yield tensor.name, quant_values.to_int8(exact) if weights == "int8" else exact
                continue
            if is_matrix and kind == "Q6_K" and weights == "auto" and shape[1] % 256 == 0:
                yield tensor.name, quant_values.gguf_int6(tensor.data, shape)  # type: ignore[arg-type]  # kept 6-bit where rill's kernel runs
                continue
            # dequantize() gives float32 in the Hugging Face [out, in] layout; copy off the mmap.
            values = np.array(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32, copy=True)
            if is_matrix and (weights in ("int4", "int8") or (weights == "auto" and kind not in _DENSE_TYPES)):
                # auto: the quantized types left here (Q5, Q8, a Q6_K narrower than 256) are kept as int8.
                yield tensor.name, quant_values.quantize(torch.from_numpy(values), "int4" if weights == "int4" else "int8")
                continue
            yield tensor.name, values

    def tokenizer(self) -> Any:
        """The ``rill.models.tokenizer.Tokenizer`` the file's metadata describes."""
        return self.tokenizer_spec().tokenizer(str(self.path))

    def tokenizer_spec(self) -> TokenizerSpec:
        """The tokenizer's parts (backend, special tokens, template, flags)."""
        return build_tokenizer(self.reader, self.metadata, str(self.path))


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
        return {"backend": self.backend.to_str(), "special_tokens": self.special_tokens,
                "chat_template": self.chat_template, "eos_token_ids": self.eos_token_ids,
                "add_bos_token": self.add_bos_token, "add_eos_token": self.add_eos_token}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TokenizerSpec:
        """The spec ``to_json`` wrote."""
        return cls(tokenizers.Tokenizer.from_str(data["backend"]), data["special_tokens"], data["chat_template"],
                   data["eos_token_ids"], data.get("add_bos_token", False), data.get("add_eos_token", False))


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open a GGUF file and derive its Hugging Face config (tensors stay on disk until asked).

    Raises:
        ModelLoadError: unreadable file, unsupported architecture, missing metadata.
    """
    from rill.models.registry import family_for_gguf

    path = Path(path)
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path), "r")
    except Exception as exc:  # the reader raises ValueError/struct.error/OSError on bad files
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    metadata = _metadata(reader)
    architecture = str(metadata.get("general.architecture", ""))
    family = family_for_gguf(architecture, str(path))
    shapes = {t.name: tuple(reversed([int(n) for n in t.shape])) for t in reader.tensors}
    hf_config = family.gguf_config(metadata, shapes, str(path))
    generation = {
        key: metadata[f"tokenizer.ggml.{name}"]
        for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id"))
        if f"tokenizer.ggml.{name}" in metadata
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in generation:
            hf_config.setdefault(key, generation[key])
    return GGUFCheckpoint(path, architecture, metadata, hf_config, generation, reader)


# Arrays read in full only when building the tokenizer (262k strings for Gemma).
_LARGE_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def _metadata(reader: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, entry in reader.fields.items():
        if key in _LARGE_ARRAYS or key.startswith("GGUF."):
            continue
        values[key] = entry.contents()
    return values


def metadata_value(metadata: dict[str, Any], key: str, source: str) -> Any:
    """``metadata[key]``, or a ``ModelLoadError`` naming the key and the file."""
    if key not in metadata:
        raise ModelLoadError(f"{source}: GGUF metadata {key} is missing")
    return metadata[key]


GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
"""llama.cpp's names of the tensors outside the blocks → Hugging Face names."""


def rename_tensor(name: str, layer_names: dict[str, str]) -> str | None:
    """``blk.N.<part>`` → ``model.layers.N.<layer_names[part]>``; the global tensors by
    ``GLOBAL_TENSOR_NAMES``; None for names neither knows."""
    if name in GLOBAL_TENSOR_NAMES:
        return GLOBAL_TENSOR_NAMES[name]
    prefix, _, rest = name.partition(".")
    index, _, part = rest.partition(".")
    if prefix != "blk" or not index.isdigit() or part not in layer_names:
        return None
    return f"model.layers.{index}.{layer_names[part]}"


def shape_of(shapes: dict[str, tuple[int, ...]], name: str, source: str) -> tuple[int, ...]:
    """The (Hugging Face order) shape of tensor ``name``, or a ``ModelLoadError``."""
    if name not in shapes:
        raise ModelLoadError(f"{source}: GGUF tensor {name} is missing")
    return shapes[name]


# ------------------------------------------------------------------------------- tokenizer


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
    types: list[int] = list(fields["tokenizer.ggml.token_type"].contents()) if "tokenizer.ggml.token_type" in fields else []
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
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))
        if f"tokenizer.ggml.{key}" in metadata and 0 <= int(metadata[f"tokenizer.ggml.{key}"]) < len(tokens)
    }
    # llama.cpp adds BOS to sentencepiece vocabularies whose file does not say otherwise.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    _set_post_processor(backend, special, add_bos, add_eos)
    eos_ids = [int(metadata[key]) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if key in metadata]
    template = metadata.get("tokenizer.chat_template")
    return TokenizerSpec(backend, special, template if isinstance(template, str) else None,
                         list(dict.fromkeys(eos_ids)), add_bos, add_eos)


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


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str, source: str) -> tuple[tokenizers.Tokenizer, list[str]]:
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
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk_token,
                                              fuse_unk=True, byte_fallback=True))
    if metadata.get("tokenizer.ggml.add_space_prefix", False):
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    else:
        backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if metadata.get("tokenizer.ggml.add_space_prefix") else []))
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
    control = [AddedToken(t, normalized=False, special=True)
               for t, s, kind in zip(tokens, spelled, types) if kind == _TOKEN_CONTROL and t == s]
    user = [AddedToken(t, normalized=False, special=False)
            for t, s, kind in zip(tokens, spelled, types) if kind == _TOKEN_USER_DEFINED and t == s]
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


# ------------------------------------------------------------------------------ conversion


def convert_to_folder(
    checkpoint: GGUFCheckpoint,
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write ``checkpoint`` as a Hugging Face folder: ``config.json``, ``generation_config.json``,
    ``model.safetensors`` (dequantized to ``dtype``), ``tokenizer.json``, ``tokenizer_config.json``.

    ``rill.models.load_model`` and ``Tokenizer.from_folder`` then load the folder as they load
    any other. Not atomic: write into a temporary folder and rename it.
    """
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint.tensors(dtype, progress)
    if checkpoint.hf_config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = dict(checkpoint.hf_config, dtype=str(dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(checkpoint.generation_config, indent=2, sort_keys=True) + "\n")
    spec = checkpoint.tokenizer_spec()
    spec.backend.save(str(out / "tokenizer.json"))
    tokenizer_config: dict[str, Any] = dict(spec.special_tokens, add_bos_token=spec.add_bos_token,
                                            add_eos_token=spec.add_eos_token,
                                            model_max_length=int(checkpoint.hf_config.get("max_position_embeddings", 2048)))
    if spec.chat_template:
        tokenizer_config["chat_template"] = spec.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    return out
