"""A GGUF file loaded with quantized weights, kept in rill's cache so later starts skip the work.

The first load of a Q4_K_M file parses its metadata (8.9 s for Qwen2.5-Coder-1.5B: the
tokenizer's 151,936 tokens and merges go through the ``gguf`` reader) and decodes and packs
every matrix (another ~20 s on 2 cores). Afterwards the packed model (every parameter and
buffer, in safetensors) and what the file's metadata gave (the config, the generation config,
the tokenizer) are written to ``<cache root>/quantized/<file stem>-<key>/``; the next start
reads that folder in seconds. The key hashes the file's resolved path, size and modification
time, the weights mode, dtype and device, the kernel in use and ``FORMAT``, so a changed file
or another setting builds a new entry. Entries are built atomically (``rill.cache``); a
folder that fails to load is ignored (and rebuilt), never trusted half-written.

Imports torch, safetensors and ``rill.models``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

import rill.models.quant as quant
from rill.cache import build_atomically, cache_root

log = logging.getLogger("rill.models")

FORMAT = 5
"""Version of the folder's layout; bump it when a weight class's buffers change (5: a tied LM
head has a packed weight of its own, ``lm_head``)."""

_WEIGHTS_FILE = "weights.safetensors"
_META_FILE = "meta.json"


def entry_folder(file: Path, weights: str, dtype: torch.dtype, device: str) -> Path:
    """The cache folder of ``file`` loaded this way."""
    stat = file.stat()
    backend = _backend()
    key = json.dumps(
        [
            FORMAT,
            str(file.resolve()),
            stat.st_size,
            stat.st_mtime_ns,
            weights,
            str(dtype),
            str(device),
            backend,
            torch.__version__,
        ]
    )
    return cache_root() / "quantized" / f"{file.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _backend() -> str:
    import rill.models.qkernel as qkernel

    return "vnni" if qkernel.available() else "torch"


def _is_complete(folder: Path) -> bool:
    return (folder / _WEIGHTS_FILE).is_file() and (folder / _META_FILE).is_file()


def save(folder: Path, model: nn.Module, config: dict[str, Any]) -> Path:
    """Write ``model`` (quantized modules described in the metadata) and ``config`` (what the
    GGUF metadata gave: ``hf_config``, ``generation_config``, ``tokenizer``) into ``folder``."""
    modules = []
    for name, module in model.named_modules():
        if isinstance(module, (quant.QuantizedLinear, quant.QuantizedEmbedding)):
            weight = module.weight
            modules.append(
                {
                    "path": name,
                    "wrapper": type(module).__name__,
                    "class": type(weight).__name__,
                    "shape": list(weight.shape),
                    "attrs": weight.cache_attrs(),
                }
            )
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(tensor) in seen:  # a tied weight is stored once
            aliases[name] = seen[id(tensor)]
            continue
        seen[id(tensor)] = name
        tensors[name] = tensor.detach().contiguous().cpu()

    def build(tmp: Path) -> None:
        save_file(tensors, str(tmp / _WEIGHTS_FILE))
        meta = {"format": FORMAT, "modules": modules, "aliases": aliases, **config}
        (tmp / _META_FILE).write_text(json.dumps(meta))

    return build_atomically(folder, build, _is_complete, rebuild=True, progress=False, what="the quantized model")


def peek(folder: Path) -> dict[str, Any] | None:
    """The saved metadata of a complete entry in this format, or None."""
    if not _is_complete(folder):
        return None
    try:
        meta = json.loads((folder / _META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def load(folder: Path, model: nn.Module, dtype: torch.dtype, device: str) -> dict[str, Any] | None:
    """Fill ``model`` (built on the meta device) from ``folder``; return the saved config, or
    None when there is no usable entry (the caller loads the GGUF and saves a new one)."""
    if not _is_complete(folder):
        return None
    try:
        meta = json.loads((folder / _META_FILE).read_text())
        if meta.get("format") != FORMAT:
            return None
        # Fresh allocations: a tensor read from safetensors may sit at any offset of the file's
        # buffer, and torch's int8 kernel crashed on such an unaligned weight.
        tensors = {name: t.clone() for name, t in load_file(str(folder / _WEIGHTS_FILE), device=str(device)).items()}
        for spec in meta["modules"]:
            path = spec["path"]
            prefix = f"{path}.weight."
            buffers = {name[len(prefix) :]: tensors.pop(name) for name in list(tensors) if name.startswith(prefix)}
            weight = _weight_class(spec["class"]).from_buffers(tuple(spec["shape"]), buffers, spec["attrs"])
            wrapper: nn.Module
            if spec["wrapper"] == "QuantizedEmbedding":
                wrapper = quant.QuantizedEmbedding(weight)  # type: ignore[arg-type]
            else:
                bias = tensors.pop(f"{path}.bias", None)
                wrapper = quant.QuantizedLinear(weight, bias)
            parent_name, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, wrapper)
        state = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in tensors.items()}
        for alias, name in meta["aliases"].items():
            state.setdefault(alias, state.get(name, _find(model, name)))
        model.load_state_dict(state, assign=True, strict=False)
        left = quant.unloaded(model)
        if left:
            raise ValueError(f"not in the cache: {left[:3]}")
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, SafetensorError) as exc:
        log.warning("the cached quantized model in %s is unusable (%s); loading the GGUF file", folder, exc)
        return None
    return meta


def _find(model: nn.Module, name: str) -> torch.Tensor:
    module_name, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(module_name) if module_name else model, leaf)


def _weight_class(name: str) -> type[quant.QuantWeight]:
    import rill.models.qkernel as qkernel

    classes = {"Int4Weight": quant.Int4Weight, "Int8Weight": quant.Int8Weight, "BlockedWeight": qkernel.BlockedWeight}
    if name not in classes:
        raise ValueError(f"unknown weight class {name}")
    return classes[name]
