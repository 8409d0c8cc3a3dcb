"""Load, build and save Llama-family checkpoints in the Hugging Face folder layout.

A folder holds ``config.json``, ``model.safetensors`` (or ``model.safetensors.index.json`` plus
shards) and optionally ``generation_config.json``. Loading reads the tensors with
``safetensors``, fuses projections, casts to the requested dtype and moves to the device.
Every failure is a ``rill.errors.ModelLoadError`` whose message names the file or tensor.

Does not import transformers (a test dependency only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rill.errors import ModelLoadError
from rill.models.config import ModelConfig, dtype_name, parse_config
from rill.models.llama import LlamaModel, fuse_hf_state_dict, init_weights, unfuse_state_dict

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
"""Weight files looked for in a model folder, in order."""


@dataclass(slots=True)
class LoadedModel:
    """A model ready for inference.

    Attributes:
        model: the ``LlamaModel`` in eval mode on ``config.device`` in ``config.dtype``.
        config: the parsed configuration with the runtime dtype and device.
        path: the folder it was loaded from.
    """

    model: LlamaModel
    config: ModelConfig
    path: Path


def default_dtype(device: str | torch.device = "cpu") -> str:
    """``bfloat16`` when the device computes it natively (CUDA with bf16, CPU with AVX512-BF16
    or AMX), else ``float32``."""
    device = torch.device(device)
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    if device.type != "cpu":
        return "float32"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    is_native = "avx512_bf16" in flags or "amx_bf16" in flags
    return "bfloat16" if is_native or torch.backends.cpu.get_cpu_capability() == "AMX" else "float32"


def load_model(path: str | Path, dtype: str = "auto", device: str = "cpu") -> LoadedModel:
    """Load a Hugging Face style checkpoint folder.

    Args:
        path: the model folder.
        dtype: ``"auto"`` (see ``default_dtype``), ``"float32"`` or ``"bfloat16"`` (``"float16"`` also works).
        device: a torch device string.

    Raises:
        ModelLoadError: missing folder, ``config.json`` or weights; unsupported architecture;
            missing tensors; shape mismatch; bad dtype.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    hf_config = _read_json(folder / "config.json", required=True)
    generation = _read_json(folder / "generation_config.json", required=False)
    try:
        name = default_dtype(device) if dtype == "auto" else dtype_name(dtype)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    config = parse_config(hf_config, generation, source=str(folder / "config.json")).with_runtime(name, str(device))
    tensors = _read_tensors(folder)
    with torch.device("meta"):
        model = LlamaModel(config)
    _check_tensors(unfuse_state_dict(model.state_dict(), config), tensors, folder)
    state = fuse_hf_state_dict(tensors, config)
    state = {key: value.to(dtype=config.torch_dtype, device=device) for key, value in state.items()}
    model.load_state_dict(state, assign=True, strict=True)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, config=config, path=folder)


def build_model(config: dict[str, Any], dtype: str = "float32", device: str = "cpu", seed: int | None = None) -> LlamaModel:
    """Create a randomly initialised model from an HF-style ``config.json`` dict (for training).

    Weights are drawn as transformers does with ``config["initializer_range"]`` (default 0.02).
    The model is in train mode with gradients enabled.
    """
    parsed = parse_config(config, None, source="config").with_runtime(dtype_name(dtype), str(device))
    model = LlamaModel(parsed)
    init_weights(model, float(config.get("initializer_range", 0.02)), seed)
    return model.to(dtype=parsed.torch_dtype, device=device)


def save_checkpoint(
    model_or_state: LlamaModel | dict[str, torch.Tensor],
    config: dict[str, Any],
    folder: str | Path,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ ``generation_config.json``) in HF format.

    Args:
        model_or_state: a ``LlamaModel`` or a state dict with Hugging Face names.
        config: the ``config.json`` dict (``architectures`` must name a supported class).
        folder: created if missing; existing files are overwritten.
        generation_config: written as ``generation_config.json`` when given.

    Returns the folder. ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads it.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(model_or_state, LlamaModel):
        tensors = model_or_state.to_hf_state_dict()
    else:
        tensors = {name: tensor.detach().contiguous() for name, tensor in model_or_state.items()}
    parsed = parse_config(config, None, source="config")
    if parsed.tie_word_embeddings:
        # safetensors refuses shared storage; transformers re-ties from the embedding.
        tensors.pop("lm_head.weight", None)
    dtypes = {tensor.dtype for tensor in tensors.values()}
    config = dict(config)
    # AutoConfig needs model_type; derive it from the architecture when the caller left it out.
    config.setdefault("model_type", _MODEL_TYPES[parsed.architecture])
    config.setdefault("dtype", str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "float32")
    save_file({name: tensor.cpu() for name, tensor in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2, sort_keys=True) + "\n")
    return out


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.name} not found in {path.parent}")
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    single, index = (folder / name for name in WEIGHT_FILES)
    try:
        if single.is_file():
            return load_file(str(single))
        if index.is_file():
            weight_map = _read_json(index, required=True).get("weight_map", {})
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
