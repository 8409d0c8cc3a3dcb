"""Linear layers with weights pre-packed for oneDNN's CPU kernels (bf16 and float32).

``F.linear`` on a bf16 CPU tensor reaches oneDNN, but with the weight in its plain row-major
layout oneDNN reorders it into its blocked layout on every call. Packing each weight once
(``torch.ops.mkldnn._reorder_linear_weight``, the call inductor makes when it freezes a CPU
graph) removes that reorder. Measured on a 2-core AVX-512-BF16 machine, SmolLM2-135M shapes,
2 threads: the 49152×576 LM head at one row 1.69 → 0.86 ms, 32 rows 4.09 → 2.16 ms; a
3072×576 projection at one row 0.100 → 0.045 ms. A whole decode step at B=1 went from 15.0 to
10.7 ms. In bf16 the results are bit-identical to ``F.linear`` at every batch size (checked in
``tests/models/test_packed.py``), so batch invariance and transformers parity are unchanged.

float32 ``F.linear`` goes to MKL's sgemm instead, which on a 2-core AVX2 machine (AMD EPYC, no
AVX-512) read the LM head at half the memory's speed (9.2 ms at one row against 4.9 packed,
30.2 against 15.0 at 32 rows) and takes another kernel for one row than for several, so a
row's logits changed in their last bits with the batch it ran in. The packed oneDNN kernel
gives every row the same bits at any batch size (tested) and differs from MKL's sums by
rounding only (~1e-4 on unit-scale products). SmolLM2-135M float32 decode steps there: B=1
71.1 → 52.7 ms, B=32 187.8 → 140.1 ms (medians of 40 steps on the runner alone).

Packing replaces: ``pack_linears(..., release=True)`` (what the runner does) frees each
projection's original storage once its packed copy exists, so a served model holds one copy of
every weight (the 1.5B Qwen2.5 in bf16 held 2,944 MiB twice before). A tied LM head's matrix
is the embedding, which lookups still read in its plain layout: it keeps both forms. A
released weight is an empty tensor: the packed forward works, ``state_dict`` and autograd do
not (serving never trains).

``pack_linears(model)`` packs every ``nn.Linear`` of a model plus its LM head where the
device and dtype allow; ``linear(x, weight)`` is ``F.linear`` that uses a weight's packed copy
when it has one. ``normed_linear`` (an RMS norm, then a projection) and ``swiglu_linear``
(SiLU-gated product, then a projection) let a quantized weight's kernel do the step before it
while reading its activations: on Qwen2.5-Coder-1.5B that removed 85 small operations from
each decode step. Imports torch only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from rill.models.quant import QuantWeight

_PACKED = "_rill_packed"
"""Attribute of a weight ``Parameter`` that holds its packed copy.

NOTE: the copy rides on the tensor, read with one ``getattr`` per product: the weight is all
``linear`` is given (the models pass ``module.weight``, the LM head's matrix is the embedding's
when tied), and that lookup (~50 ns) is as cheap as any typed home keyed by the tensor
(a ``Parameter`` subclass costs an ``isinstance`` more; a weak-key registry, a hash call
more). ``packed_copy`` is the one reader outside the hot path."""


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be packed here: float32, or bf16 on a CPU whose oneDNN has bf16
    kernels, on a CPU build with oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and (
            weight.dtype == torch.float32
            or (weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
        )
    )


class RMSNormModule(Protocol):
    """What ``normed_linear`` needs of a norm: ``weight * rms_norm(x, eps)`` when called."""

    @property
    def weight(self) -> torch.Tensor:
        """The per-channel scale."""
        ...

    @property
    def eps(self) -> float:
        """Added to the mean square before its root."""
        ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised ``x``."""
        ...


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy ``pack_weight`` attached to ``weight``, or None."""
    return getattr(weight, _PACKED, None)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the weight's packed copy when it has one.

    Falls back to ``F.linear`` when autograd needs the weight (packed kernels have no backward).
    """
    # A quantized weight (rill.models.quant) is a module with its own kernel; isinstance on
    # nn.Module is the cheaper test (torch.Tensor's metaclass makes that one a Python call).
    if isinstance(weight, nn.Module):
        out = weight.linear(x)
        return out if bias is None else out + bias
    packed = getattr(weight, _PACKED, None)
    if packed is None or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def normed_linear(
    x: torch.Tensor, norm: RMSNormModule, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``linear(norm(x), weight, bias)`` for an RMS norm module (``weight * rms_norm(x)``:
    ``weight``, ``eps``).

    A quantized weight does both in its ``linear_rms`` (one kernel call where its kernel
    applies the norm as it reads the activations); a dense weight gets ``norm(x)`` as the
    module computes it (bit for bit), then ``linear``.
    """
    if isinstance(weight, nn.Module):
        out = weight.linear_rms(x, norm.weight, norm.eps)
        return out if bias is None else out + bias
    return linear(norm(x), weight, bias)


def swiglu_linear(
    gate_up: torch.Tensor, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``linear(silu(gate) * up, weight, bias)`` for ``gate_up [..., 2K]`` (gate first); a
    quantized weight does it in its ``linear_swiglu`` (one kernel call where its kernel can)."""
    if isinstance(weight, nn.Module):
        out = weight.linear_swiglu(gate_up)
        return out if bias is None else out + bias
    gate, up = gate_up.chunk(2, dim=-1)
    return linear(F.silu(gate) * up, weight, bias)


def pack_weight(weight: torch.Tensor, release: bool = False) -> int:
    """Attach a packed copy to ``weight`` if it can be packed; return the bytes it adds
    (0 with ``release``: the original's storage is freed, leaving an empty tensor)."""
    if not isinstance(weight, torch.Tensor) or packed_copy(weight) is not None or not can_pack(weight):
        return 0
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    setattr(weight, _PACKED, packed)
    if release:
        weight.data = weight.data.new_empty((0,))
        return 0
    return weight.numel() * weight.element_size()


class _PackedForward:
    """An ``nn.Linear.forward`` replacement that calls ``linear`` on the module's weight."""

    def __init__(self, module: nn.Linear) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.module.weight, self.module.bias)


def pack_linears(model: nn.Module, lm_weight: torch.Tensor | None = None, release: bool = False) -> int:
    """Pack every ``nn.Linear`` in ``model`` and ``lm_weight`` (the LM head matrix); return bytes added.

    With ``release`` the originals are freed (see the module doc), except an ``lm_weight``
    that an ``nn.Embedding`` of ``model`` also uses. A no-op (0) on devices or dtypes without
    packed kernels. Idempotent.
    """
    added = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and isinstance(module.weight, torch.Tensor):
            packable = can_pack(module.weight) and packed_copy(module.weight) is None
            added += pack_weight(module.weight, release)
            if packable:
                module.forward = _PackedForward(module)  # type: ignore[method-assign,assignment]
    if lm_weight is not None:
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        added += pack_weight(lm_weight, release and id(lm_weight) not in embeddings)
    return added
