"""The model registry: which code serves which checkpoint.

A *family* is one module (listed in ``FAMILY_MODULES``) exposing ``FAMILY``, a ``ModelFamily``
that names the Hugging Face architectures (``config.json`` ``architectures``) and GGUF
architectures (``general.architecture``) it serves and says how to:

* parse ``config.json`` into a ``ModelConfig`` (``parse_config`` picks the family's parser);
* build the model (a ``CausalLM``) and map Hugging Face tensor names onto its weights;
* read a GGUF file: its metadata → a ``config.json`` dict, its tensor names → Hugging Face
  names, and the fix-ups llama.cpp's converter applied to some tensors.

Adding a family is one new module plus its tests, and one line in ``FAMILY_MODULES``. The
engine's runner only talks to the ``CausalLM`` protocol.

Encoders (the text towers of sentence-embedding models, served at ``/v1/embeddings`` by
``--embedding-model``) have a registry of their own beside it: a module in ``ENCODER_MODULES``
exposes ``FAMILY``, an ``EncoderFamily`` that parses ``config.json``, builds the
``torch.nn.Module`` (ids and mask → one hidden state per token) and maps checkpoint tensors
onto it; ``rill.models.embedder`` pools its output.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rill.errors import ModelLoadError
from rill.models.attention import StepBatch
from rill.models.config import ModelConfig

FAMILY_MODULES = ("rill.models.llama", "rill.models.gemma3")
"""Modules that define a ``FAMILY``; the order decides nothing (names never overlap)."""

ENCODER_MODULES = ("rill.models.bert",)
"""Modules that define an encoder ``FAMILY`` (an ``EncoderFamily``)."""


class CausalLM(Protocol):
    """What the runner, the loader and the trainer need from a model (a ``torch.nn.Module``)."""

    config: ModelConfig

    @property
    def windows(self) -> set[int | None]:
        """The distinct attention windows of the layers (None = full attention)."""
        ...

    def lm_weight(self) -> torch.Tensor:
        """The LM head matrix ``[vocab, hidden]`` (the embedding when tied)."""
        ...

    def ensure_rope(self, length: int) -> None:
        """Make rotary tables cover positions ``[0, length)``."""
        ...

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Cache-free causal forward: ``[B, T]`` ids → ``[B, T, vocab]`` logits."""
        ...

    def forward_step(self, batch: StepBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One cached engine step → float32 logits ``[M, vocab]`` (see ``rill.models.attention``)."""
        ...

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face names."""
        ...


@dataclass(frozen=True)
class ModelFamily:
    """How one family of architectures is parsed, built, loaded and read from GGUF.

    Attributes:
        name: a short label (``"llama"``, ``"gemma3"``).
        model_types: Hugging Face architecture name → ``config.json`` ``model_type``.
        gguf_architectures: ``general.architecture`` values this family reads.
        parse_config: ``(architecture, config.json dict, generation_config dict or None, source)
            → ModelConfig``; ``architecture`` is the name ``resolve_architecture`` chose.
        build: ``ModelConfig → CausalLM`` (uninitialised weights; works on the meta device).
        expected_hf_names: ``ModelConfig →`` the Hugging Face tensor names a checkpoint needs.
        from_hf: ``(HF tensors, ModelConfig) →`` the model's state dict.
        to_hf: ``(state dict, ModelConfig) →`` HF tensors (inverse of ``from_hf``).
        init_weights: ``(model, initializer_range, seed)``: random init for training.
        gguf_config: ``(metadata, tensor shapes by GGUF name (HF order), source) →`` a ``config.json`` dict.
        gguf_tensor_name: GGUF tensor name → HF name, or None when unknown.
        gguf_fix_tensor: ``(HF name, float32 tensor, config.json dict) →`` the tensor as a
            Hugging Face checkpoint holds it (undoes the converter's permutations/offsets).
    """

    name: str
    model_types: dict[str, str]
    gguf_architectures: tuple[str, ...]
    parse_config: Callable[[str, dict[str, Any], dict[str, Any] | None, str], ModelConfig]
    build: Callable[[ModelConfig], Any]
    expected_hf_names: Callable[[ModelConfig], list[str]]
    from_hf: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]]
    to_hf: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]]
    init_weights: Callable[[Any, float, int | None], None]
    gguf_config: Callable[[dict[str, Any], dict[str, tuple[int, ...]], str], dict[str, Any]]
    gguf_tensor_name: Callable[[str], str | None]
    gguf_fix_tensor: Callable[[str, torch.Tensor, dict[str, Any]], torch.Tensor]

    @property
    def architectures(self) -> tuple[str, ...]:
        """The Hugging Face architecture names of this family."""
        return tuple(self.model_types)


@functools.cache
def families() -> tuple[ModelFamily, ...]:
    """Every registered family (their modules are imported on first use)."""
    return tuple(importlib.import_module(name).FAMILY for name in FAMILY_MODULES)


def supported_architectures() -> tuple[str, ...]:
    """Every Hugging Face architecture name rill can load."""
    return tuple(arch for family in families() for arch in family.architectures)


def supported_gguf_architectures() -> tuple[str, ...]:
    """Every GGUF ``general.architecture`` rill can load."""
    return tuple(arch for family in families() for arch in family.gguf_architectures)


def family_for_architecture(architecture: str) -> ModelFamily | None:
    """The family serving a Hugging Face architecture name, or None."""
    return next((f for f in families() if architecture in f.model_types), None)


def resolve_architecture(hf: dict[str, Any], source: str) -> tuple[str, ModelFamily]:
    """The first supported name in ``config.json``'s ``architectures`` and its family.

    Raises:
        ModelLoadError: no supported architecture; the message lists the supported ones.
    """
    names = hf.get("architectures") or []
    for name in names:
        family = family_for_architecture(name)
        if family is not None:
            return name, family
    shown = ", ".join(names) if names else f"none (model_type={hf.get('model_type')!r})"
    hint = " (an embedding model: serve it beside a chat model with --embedding-model)" if _is_encoder(hf) else ""
    raise ModelLoadError(
        f"{source}: unsupported architecture {shown}{hint}; supported: {', '.join(supported_architectures())}"
    )


def parse_config(
    hf: dict[str, Any], generation: dict[str, Any] | None = None, *, source: str = "config.json"
) -> ModelConfig:
    """Build a ``ModelConfig`` from a ``config.json`` dict (and optional ``generation_config.json``)
    with the parser of its architecture's family.

    Raises:
        ModelLoadError: unsupported architecture, activation, RoPE type, or a missing field;
            the message names ``source``.
    """
    architecture, family = resolve_architecture(hf, source)
    return family.parse_config(architecture, hf, generation, source)


def family_for_config(hf: dict[str, Any], source: str = "config.json") -> ModelFamily:
    """The family of a ``config.json`` dict (see ``resolve_architecture``)."""
    return resolve_architecture(hf, source)[1]


def family_for_gguf(architecture: str, source: str) -> ModelFamily:
    """The family reading GGUF files of ``general.architecture``.

    Raises:
        ModelLoadError: no family reads it; the message lists the ones supported.
    """
    for family in families():
        if architecture in family.gguf_architectures:
            return family
    raise ModelLoadError(
        f"{source}: GGUF architecture {architecture!r} is not supported; "
        f"supported: {', '.join(supported_gguf_architectures())}"
    )


@dataclass(frozen=True)
class EncoderFamily:
    """How one family of encoders is parsed, built and loaded.

    Attributes:
        name: a short label (``"bert"``).
        model_types: Hugging Face architecture name → ``config.json`` ``model_type``.
        parse_config: ``(config.json dict, source) →`` the family's config object.
        build: ``config →`` the ``torch.nn.Module`` (uninitialised weights), whose
            ``forward(input_ids [B, T], attention_mask [B, T])`` returns hidden states
            ``[B, T, hidden]``.
        from_hf: ``(checkpoint tensors, config) →`` the module's state dict (raises
            ``ModelLoadError`` naming missing tensors).
    """

    name: str
    model_types: dict[str, str]
    parse_config: Callable[[dict[str, Any], str], Any]
    build: Callable[[Any], torch.nn.Module]
    from_hf: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]


@functools.cache
def encoder_families() -> tuple[EncoderFamily, ...]:
    """Every registered encoder family (their modules are imported on first use)."""
    return tuple(importlib.import_module(name).FAMILY for name in ENCODER_MODULES)


def _is_encoder(hf: dict[str, Any]) -> bool:
    """Whether an encoder family reads this ``config.json`` (see ``encoder_family_for_config``)."""
    try:
        encoder_family_for_config(hf)
    except ModelLoadError:
        return False
    return True


def encoder_family_for_config(hf: dict[str, Any], source: str = "config.json") -> EncoderFamily:
    """The encoder family of a ``config.json`` dict: by its ``architectures``, else (a folder
    saved from a task model such as ``BertForMaskedLM``, or with no ``architectures``) by its
    ``model_type``.

    Raises:
        ModelLoadError: no encoder family reads it; the message lists the supported ones.
    """
    names = hf.get("architectures") or []
    for family in encoder_families():
        if any(name in family.model_types for name in names):
            return family
    for family in encoder_families():
        if hf.get("model_type") in family.model_types.values():
            return family
    supported = ", ".join(
        f"{arch} (model_type {kind})" for f in encoder_families() for arch, kind in f.model_types.items()
    )
    shown = ", ".join(names) or "none"
    raise ModelLoadError(
        f"{source}: not an embedding model rill runs (architectures {shown}, model_type "
        f"{hf.get('model_type')!r}); supported: {supported}"
    )
