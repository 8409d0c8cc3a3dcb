"""Model code: configuration, the Llama-family transformer, loading and saving checkpoints.

Public entry points: ``load_model``, ``build_model``, ``save_checkpoint``, ``LoadedModel``,
``ModelConfig``, ``LlamaModel``.
"""

from rill.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, parse_config
from rill.models.llama import LlamaModel
from rill.models.loader import LoadedModel, build_model, default_dtype, load_model, save_checkpoint

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "build_model",
    "default_dtype",
    "load_model",
    "parse_config",
    "save_checkpoint",
]
