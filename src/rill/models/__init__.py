"""Model code: configuration, the model registry and its families, loading and saving checkpoints.

Public entry points: ``load_model`` (Hugging Face folders and GGUF files), ``build_model``,
``save_checkpoint``, ``LoadedModel``, ``ModelConfig``, ``CausalLM``, ``LlamaModel``.
"""

from rill.models.config import ModelConfig
from rill.models.llama import LlamaModel
from rill.models.loader import LoadedModel, auto_dtype, build_model, default_dtype, load_model, save_checkpoint
from rill.models.registry import CausalLM, parse_config, supported_architectures

SUPPORTED_ARCHITECTURES = supported_architectures()
"""Hugging Face ``architectures`` names this package can load."""

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "auto_dtype",
    "build_model",
    "default_dtype",
    "load_model",
    "parse_config",
    "save_checkpoint",
]
