"""Load, build and save checkpoints: Hugging Face folders and GGUF files.

A folder holds ``config.json``, ``model.safetensors`` (or ``model.safetensors.index.json`` plus
shards) and optionally ``generation_config.json``. Loading reads the tensors with
``safetensors``, maps them onto the model of the architecture's family (``rill.models.registry``),
casts to the requested dtype and moves to the device. A ``.gguf`` file (or a folder holding
one and no ``config.json``) is read by ``rill.models.gguf_loader``: its tensors are dequantized
to the serving dtype and its tokenizer comes from the file too (``LoadedModel.tokenizer``).
Every failure is a ``rill.errors.ModelLoadError`` whose message names the file or tensor.

Does not import transformers (a test dependency only).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import rill.models.quant as quant
import rill.models.quant_cache as quant_cache
import rill.models.quant_values as quant_values
from rill.errors import ModelLoadError
from rill.models.config import ModelConfig, dtype_name
from rill.models.gguf_loader import find_gguf, read_gguf
from rill.models.gguf_tokenizer import TokenizerSpec
from rill.models.quant import WEIGHT_MODES
from rill.models.registry import CausalLM, family_for_config, parse_config

log = logging.getLogger("rill.models")

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
"""Weight files looked for in a model folder, in order."""


@dataclass(slots=True)
class LoadedModel:
    """A model ready for inference.

    Attributes:
        model: the ``CausalLM`` in eval mode on ``config.device`` in ``config.dtype``.
        config: the parsed configuration with the runtime dtype and device.
        path: the folder (or GGUF file) it was loaded from.
        tokenizer: the tokenizer when the source carries it in the weights file (GGUF), else
            None (load it from the folder with ``Tokenizer.from_folder``).
        weights: how the projections are held: ``dense`` (the dtype), ``int4``, ``int8`` or
            ``int4+int8`` (``rill.models.quant``).
    """

    model: CausalLM
    config: ModelConfig
    path: Path
    tokenizer: Any = None
    weights: str = "dense"


def default_dtype(device: str | torch.device = "cpu") -> str:
    """``bfloat16`` when the device computes it natively (CUDA with bf16, CPU with AVX512-BF16
    or AMX), else ``float32``."""
    return auto_dtype(device)[0]


def auto_dtype(device: str | torch.device = "cpu") -> tuple[str, str]:
    """``(dtype, reason)``: what ``--dtype auto`` picks on ``device`` and why (for the log)."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "the GPU computes bfloat16 natively"
        return "float32", "the GPU has no native bfloat16"
    if device.type != "cpu":
        return "float32", f"bfloat16 support on {device.type} is unknown"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    for flag in ("amx_bf16", "avx512_bf16"):
        if flag in flags:
            return "bfloat16", f"the CPU has {flag} (native bfloat16 matmuls)"
    if torch.backends.cpu.get_cpu_capability() == "AMX":
        return "bfloat16", "the CPU has AMX (native bfloat16 matmuls)"
    return "float32", "the CPU has neither AVX512-BF16 nor AMX, so bfloat16 would be emulated (slower than float32)"


def _runtime_dtype(dtype: str, device: str) -> str:
    try:
        if dtype != "auto":
            return dtype_name(dtype)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    name, reason = auto_dtype(device)
    log.info("dtype auto: %s, because %s", name, reason)
    return name


def load_model(
    path: str | Path,
    dtype: str = "auto",
    device: str = "cpu",
    weights: str = "dense",
    progress: Callable[[float, str], None] | None = None,
) -> LoadedModel:
    """Load a Hugging Face style checkpoint folder or a GGUF file.

    Args:
        path: the model folder, a ``.gguf`` file, or a folder holding one ``.gguf`` file.
        dtype: ``"auto"`` (see ``auto_dtype``; the choice and its reason are logged),
            ``"float32"`` or ``"bfloat16"`` (``"float16"`` also works).
        device: a torch device string.
        weights: ``rill.models.quant.WEIGHT_MODES``: ``dense`` dequantizes every tensor to
            ``dtype``; ``auto`` keeps a GGUF file's quantized matrices quantized (int4 for Q4
            types, int8 for the others) and a folder dense; ``int8``/``int4`` quantize every
            matrix.
        progress: called with (fraction done 0-1, stage) while a GGUF is read.

    Raises:
        ModelLoadError: missing folder, ``config.json`` or weights; unsupported architecture
            or quantization type; missing tensors; shape mismatch; bad dtype.
    """
    folder = Path(path)
    if not folder.exists():
        raise ModelLoadError(f"model folder {folder} does not exist")
    gguf_file = find_gguf(folder)
    if weights not in WEIGHT_MODES:
        raise ModelLoadError(f"--weights must be one of {', '.join(WEIGHT_MODES)}, not {weights!r}")
    weights = "dense" if weights == "bf16" else weights
    if gguf_file is not None:
        return _load_gguf(gguf_file, _runtime_dtype(dtype, device), device, weights, progress or (lambda f, s: None))
    if not folder.is_dir():
        raise ModelLoadError(f"{folder} is neither a model folder nor a .gguf file")
    hf_config = read_json(folder / "config.json", required=True)
    generation = read_json(folder / "generation_config.json", required=False)
    name = _runtime_dtype(dtype, device)
    config = parse_config(hf_config, generation, source=str(folder / "config.json")).with_runtime(name, str(device))
    tensors: dict[str, Any] = dict(read_tensors(folder))
    if weights in ("int8", "int4"):
        # A folder's matrices are quantized at load; the rest stays dense.
        for key, tensor in tensors.items():
            if tensor.dim() == 2:
                tensors[key] = quant_values.quantize(tensor, weights)
    model = _assemble(config, tensors, folder)
    return LoadedModel(model=model, config=config, path=folder, weights=_weights_kind(model))


def _load_gguf(
    file: Path, dtype: str, device: str, weights: str, progress: Callable[[float, str], None]
) -> LoadedModel:
    if weights != "dense" and torch.device(device).type != "cpu":
        # int4 packs for the CPU kernel only; int8 weights run anywhere.
        weights = "int8" if weights in ("auto", "int4") else weights
    if weights != "dense":
        progress(0.0, "reading the cached quantized model")
        cached = _load_cached_gguf(file, dtype, device, weights)
        if cached is not None:
            return cached
    progress(0.0, "reading the GGUF metadata")
    checkpoint = read_gguf(file)
    config = parse_config(checkpoint.hf_config, checkpoint.generation_config, source=str(file))
    config = config.with_runtime(dtype, str(device))
    stage = "reading tensors" if weights == "dense" else "reading and packing quantized tensors"

    def tensor_done(done: int, total: int) -> None:
        progress(0.1 + 0.8 * done / total, stage)

    model = _assemble(config, checkpoint.tensors(config.torch_dtype, tensor_done, weights=weights), file)
    loaded = LoadedModel(
        model=model, config=config, path=file, tokenizer=checkpoint.tokenizer(), weights=_weights_kind(model)
    )
    if weights != "dense":
        progress(0.95, "caching the quantized model for the next start")
        saved = {
            "hf_config": checkpoint.hf_config,
            "generation_config": checkpoint.generation_config,
            "tokenizer": checkpoint.tokenizer_spec().to_json(),
        }
        try:
            quant_cache.save(quant_cache.entry_folder(file, weights, config.torch_dtype, device), model, saved)  # type: ignore[arg-type]
        except OSError as exc:  # a read-only or full cache costs the next start time, nothing more
            log.warning("could not cache the quantized model: %s", exc)
    return loaded


def _load_cached_gguf(file: Path, dtype: str, device: str, weights: str) -> LoadedModel | None:
    """The model from ``rill.models.quant_cache`` when an entry for this file and setting exists."""
    torch_dtype = getattr(torch, dtype)
    folder = quant_cache.entry_folder(file, weights, torch_dtype, device)
    meta = quant_cache.peek(folder)
    if meta is None:
        return None
    config = parse_config(meta["hf_config"], meta["generation_config"], source=str(file)).with_runtime(
        dtype, str(device)
    )
    family = family_for_config(config.hf_config, str(file))
    with torch.device("meta"):
        model = family.build(config)
    if quant_cache.load(folder, model, config.torch_dtype, device) is None:
        return None
    model.eval().requires_grad_(False)
    tokenizer = TokenizerSpec.from_json(meta["tokenizer"]).tokenizer(str(file))
    log.info("loaded the quantized model from the cache (%s)", folder)
    return LoadedModel(model=model, config=config, path=file, tokenizer=tokenizer, weights=_weights_kind(model))


def _weights_kind(model: CausalLM) -> str:
    """``dense``, ``int4``, ``int8`` or ``int4+int8``: the kinds of the model's projections."""
    kinds = sorted({module.weight.kind for module in model.modules() if isinstance(module, quant.QuantizedLinear)})  # type: ignore[attr-defined]
    return "+".join(kinds) if kinds else "dense"


def _assemble(config: ModelConfig, tensors: dict[str, torch.Tensor], source: Path) -> CausalLM:
    """Check ``tensors`` (Hugging Face names) against the family's model and load them into it."""
    family = family_for_config(config.hf_config, str(source))
    with torch.device("meta"):
        model = family.build(config)
    _check_tensors(family.to_hf(model.state_dict(), config), tensors, source)
    state = family.from_hf(tensors, config)
    state = {
        key: value if quant.is_quantized(value) else value.to(dtype=config.torch_dtype, device=config.device)
        for key, value in state.items()
    }
    dense = quant.install(model, state, config.torch_dtype, config.device)  # type: ignore[arg-type]
    # Quantized modules came with their buffers (and biases): check what is left on meta instead of strict names.
    result = model.load_state_dict(dense, assign=True, strict=False)
    left = quant.unloaded(model)
    if left or result.unexpected_keys:
        raise ModelLoadError(
            f"{source}: weights do not fit the model: missing {left[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    model.eval().requires_grad_(False)
    return model


def build_model(
    config: dict[str, Any], dtype: str = "float32", device: str = "cpu", seed: int | None = None
) -> CausalLM:
    """Create a randomly initialised model from an HF-style ``config.json`` dict (for training).

    Weights are drawn as transformers does with ``config["initializer_range"]`` (default 0.02).
    The model is in train mode with gradients enabled.
    """
    parsed = parse_config(config, None, source="config").with_runtime(dtype_name(dtype), str(device))
    family = family_for_config(config, "config")
    model = family.build(parsed)
    family.init_weights(model, float(config.get("initializer_range", 0.02)), seed)
    return model.to(dtype=parsed.torch_dtype, device=device)


def save_checkpoint(
    model_or_state: CausalLM | dict[str, torch.Tensor],
    config: dict[str, Any],
    folder: str | Path,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ ``generation_config.json``) in HF format.

    Args:
        model_or_state: a model of ``rill.models`` or a state dict with Hugging Face names.
        config: the ``config.json`` dict (``architectures`` must name a supported class).
        folder: created if missing; existing files are overwritten.
        generation_config: written as ``generation_config.json`` when given.

    Returns the folder. ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads it.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(model_or_state, dict):
        tensors = {name: tensor.detach().contiguous() for name, tensor in model_or_state.items()}
    else:
        tensors = model_or_state.to_hf_state_dict()
    parsed = parse_config(config, None, source="config")
    if parsed.tie_word_embeddings:
        # safetensors refuses shared storage; transformers re-ties from the embedding.
        tensors.pop("lm_head.weight", None)
    dtypes = {tensor.dtype for tensor in tensors.values()}
    config = dict(config)
    # AutoConfig needs model_type; derive it from the architecture when the caller left it out.
    config.setdefault("model_type", family_for_config(config, "config").model_types[parsed.architecture])
    config.setdefault("dtype", str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "float32")
    save_file(
        {name: tensor.cpu() for name, tensor in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2, sort_keys=True) + "\n")
    return out


def read_json(path: Path, required: bool) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` when it is absent and not ``required``.

    Raises:
        ModelLoadError: a required file is missing, or the file is not valid JSON.
    """
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.name} not found in {path.parent}")
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's ``model.safetensors`` (or of the shards its index lists).

    Raises:
        ModelLoadError: no weight file, a missing shard, or an unreadable file.
    """
    single, index = (folder / name for name in WEIGHT_FILES)
    try:
        if single.is_file():
            return load_file(str(single))
        if index.is_file():
            weight_map = read_json(index, required=True).get("weight_map", {})
            tensors: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                if not (folder / shard).is_file():
                    raise ModelLoadError(f"{index.name} lists shard {shard}, which is missing from {folder}")
                tensors.update(load_file(str(folder / shard)))
            return tensors
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"cannot read weights in {folder}: {exc}") from exc
    raise ModelLoadError(f"no weights in {folder}: looked for {' and '.join(WEIGHT_FILES)}")


def _check_tensors(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Every tensor the model needs is there with the shape the config implies."""
    # Checked on the Hugging Face names, before fusing, so messages name the file's tensors.
    missing = [name for name in expected if name not in tensors]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{folder}: weights are missing tensors: {shown}")
    for name, want in expected.items():
        if tuple(tensors[name].shape) != tuple(want.shape):
            raise ModelLoadError(
                f"{folder}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                f"but config.json implies {tuple(want.shape)}"
            )
