"""GGUF files (llama.cpp, Ollama) as a first-class model input: weights, config and tokenizer.

``find_gguf(path)`` says whether ``path`` is a ``.gguf`` file or a folder holding exactly one
(and no ``config.json``). ``read_gguf(path)`` opens it with the ``gguf`` package and returns a
``GGUFCheckpoint``: a Hugging Face style ``config.json`` dict, ``generation_config.json``
fields, and a ``tokenizer()`` built from the ``tokenizer.ggml.*`` metadata
(``rill.models.gguf_tokenizer``). Its
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
import torch

import rill.models.quant_values as quant_values
from rill.errors import ModelLoadError
from rill.models.gguf_tokenizer import TokenizerSpec, build_tokenizer

log = logging.getLogger("rill.models.gguf")

GGUF_SUFFIX = ".gguf"

SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
"""GGML tensor types this loader dequantizes (others are refused by name)."""

_DENSE_TYPES = ("F32", "F16", "BF16")
"""Types ``--weights auto`` serves dense (in the serving dtype)."""


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
        self,
        dtype: torch.dtype = torch.float32,
        progress: Callable[[int, int], None] | None = None,
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
                yield (
                    tensor.name,
                    quant_values.quantize(torch.from_numpy(values), "int4" if weights == "int4" else "int8"),
                )
                continue
            yield tensor.name, values

    def tokenizer(self) -> Any:
        """The ``rill.models.tokenizer.Tokenizer`` the file's metadata describes."""
        return self.tokenizer_spec().tokenizer(str(self.path))

    def tokenizer_spec(self) -> TokenizerSpec:
        """The tokenizer's parts (backend, special tokens, template, flags)."""
        return build_tokenizer(self.reader, self.metadata, str(self.path))


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
        for key, name in (
            ("bos_token_id", "bos_token_id"),
            ("eos_token_id", "eos_token_id"),
            ("pad_token_id", "padding_token_id"),
        )
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
    (out / "generation_config.json").write_text(
        json.dumps(checkpoint.generation_config, indent=2, sort_keys=True) + "\n"
    )
    spec = checkpoint.tokenizer_spec()
    spec.backend.save(str(out / "tokenizer.json"))
    tokenizer_config: dict[str, Any] = dict(
        spec.special_tokens,
        add_bos_token=spec.add_bos_token,
        add_eos_token=spec.add_eos_token,
        model_max_length=int(checkpoint.hf_config.get("max_position_embeddings", 2048)),
    )
    if spec.chat_template:
        tokenizer_config["chat_template"] = spec.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    return out
