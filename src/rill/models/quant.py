"""Weights that stay quantized, packed for a kernel and put in a model in place of dense modules.

The values come from ``rill.models.quant_values`` (exact int4/int6 from a GGUF file, int8 by
rounding). Where rill's kernel does not run, ``Int4Weight`` and ``Int8Weight`` multiply through
torch's CPU kernels (``aten._weight_int4pack_mm_for_cpu``, ``aten._weight_int8pack_mm``; one
scale per row for int8, and Q6_K held as int8).

Measured on a 2-core AVX-512-BF16 machine, an 8960x1536 projection (Qwen2.5-1.5B's down
projection) read from memory, bf16 activations: int4 0.39 ms at one row against 1.09 ms for
the oneDNN-packed bf16 weight and 0.78 ms for int8; at 8 rows int4 1.41 ms, bf16 0.92 ms,
int8 2.38 ms; at 32 rows 5.75, 2.48 and 8.05 ms: torch's kernels cost more with every row.
Where the CPU has AVX-512 VNNI, ``pack`` puts weights in rill's own kernel's layout instead
(``rill.models.qkernel``: 0.29 ms at one row, 0.67 at 8, 2.08 at 32), and torch's kernels
remain the fallback.

``QuantizedLinear`` and ``QuantizedEmbedding`` replace a model's ``nn.Linear`` and
``nn.Embedding`` modules; ``packed.linear`` sends a quantized weight to its own kernel, so
the models' LM-head code is unchanged. An embedding keeps int8 rows (a lookup reads them);
a tied LM head multiplies them where rill's kernel does not run, and elsewhere gets the file's
values in the kernel's layout as a head of its own (``_tied_head``).

Imports numpy, torch, ``rill.models.packed`` and ``rill.models.quant_values`` (and
``rill.models.qkernel`` when packing: it builds on ``QuantWeight``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import rill.models.packed as packed
from rill.models.quant_values import GROUP_SIZE, Int4Values, Int6Values, Int8Values, QuantValues, is_values, to_int8

WEIGHT_MODES = ("auto", "dense", "bf16", "int8", "int4")
"""``--weights`` choices: ``auto`` keeps a file's own precision (int4 for Q4 types, int8 for the
other quantized types, dense for float tensors); ``dense`` (alias ``bf16``) dequantizes to the
serving dtype; ``int8`` and ``int4`` quantize every projection."""


def is_quantized(value: object) -> bool:
    """Whether ``value`` is a quantized weight (before or after packing)."""
    return is_values(value) or isinstance(value, QuantWeight)


def unloaded(model: nn.Module) -> list[str]:
    """Names of ``model``'s parameters and buffers still on the meta device (never loaded)."""
    return [name for name, value in [*model.named_parameters(), *model.named_buffers()] if value.is_meta]


# ------------------------------------------------------------------------ packed weights


class QuantWeight(nn.Module):
    """A quantized ``[N, K]`` weight in its kernel's layout, with ``linear(x)`` (``x @ w.T``).

    Built by ``pack``; its buffers are the only copy of the weight.
    """

    kind: str

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.shape = torch.Size(shape)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (activations in and out)."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Where the weight lives."""
        return next(self.buffers()).device

    @property
    def nbytes(self) -> int:
        """Memory the weight takes."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K] @ w.T`` → ``[..., N]`` in ``x``'s dtype."""
        flat = x.reshape(-1, x.shape[-1])
        if flat.dtype != self.dtype:
            flat = flat.to(self.dtype)
        out = self._mm(flat.contiguous())
        return out.reshape(*x.shape[:-1], self.shape[0]).to(x.dtype)

    def linear_rms(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``(norm_weight * rms_norm(x, eps)) @ w.T``: the norm as ``rill.models.llama``'s
        ``RMSNorm`` computes it (bit for bit), then the product. A kernel that can apply the
        norm as it reads the activations overrides this (``rill.models.qkernel``)."""
        return self.linear(norm_weight * F.rms_norm(x, (x.shape[-1],), eps=eps))

    def linear_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``(silu(gate) * up) @ w.T`` for ``gate_up [..., 2K]`` (gate first). A kernel that
        can gate the activations as it reads them overrides this (``rill.models.qkernel``)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.linear(F.silu(gate) * up)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def cache_attrs(self) -> dict[str, Any]:
        """What besides its buffers rebuilds this weight (``from_buffers``), as JSON values."""
        return {}

    @classmethod
    def from_buffers(
        cls, shape: tuple[int, ...], buffers: dict[str, torch.Tensor], attrs: dict[str, Any]
    ) -> QuantWeight:
        """The weight whose buffers and ``cache_attrs`` were saved (``rill.models.quant_cache``)."""
        weight = cls.__new__(cls)
        QuantWeight.__init__(weight, tuple(shape))  # type: ignore[arg-type]
        weight._restore(attrs)
        for name, tensor in buffers.items():
            weight.register_buffer(name, tensor)
        return weight

    def _restore(self, attrs: dict[str, Any]) -> None:
        """Set what ``cache_attrs`` saved."""

    def extra_repr(self) -> str:
        """Shown by ``print(model)``."""
        return f"{self.kind}, shape={tuple(self.shape)}"


class Int4Weight(QuantWeight):
    """int4 values packed for ``aten._weight_int4pack_mm_for_cpu`` with per-group scales and zeros."""

    kind = "int4"

    def __init__(self, values: Int4Values, dtype: torch.dtype) -> None:
        super().__init__(tuple(values.shape))  # type: ignore[arg-type]
        rows, cols = values.shape
        if cols % GROUP_SIZE:
            raise ValueError(f"int4 needs an input width that is a multiple of {GROUP_SIZE}, not {cols}")
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.q.to(torch.int32), 2))
        # The kernel computes (q - 8) * scale + zero: fold the 8 into the offset.
        zeros = values.offset + 8.0 * values.scale
        self.register_buffer("scales_zeros", torch.stack([values.scale.t(), zeros.t()], dim=-1).to(dtype).contiguous())

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype."""
        return self.scales_zeros.dtype  # type: ignore[return-value]

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_zeros)


class Int8Weight(QuantWeight):
    """int8 rows with one scale each, for ``aten._weight_int8pack_mm``; also serves row lookups."""

    kind = "int8"

    def __init__(self, values: Int8Values, dtype: torch.dtype) -> None:
        super().__init__(tuple(values.shape))  # type: ignore[arg-type]
        values = to_int8(values, per_row=True)  # the kernel takes one scale per row
        # torch's kernel reads whole blocks of 16 rows (a 840-row matrix crashed it): pad with zeros.
        padding = -values.q.shape[0] % 16
        self.register_buffer("q", torch.nn.functional.pad(values.q, (0, 0, 0, padding)).contiguous())
        self.register_buffer("scale", torch.nn.functional.pad(values.scale[:, 0], (0, padding)).to(dtype).contiguous())

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype."""
        return self.scale.dtype  # type: ignore[return-value]

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)
        return out if out.shape[1] == self.shape[0] else out[:, : self.shape[0]]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows ``ids`` (an embedding lookup) in the compute dtype."""
        return self.q[ids].to(self.dtype) * self.scale[ids].unsqueeze(-1)  # type: ignore[index]


def pack(values: QuantValues, dtype: torch.dtype, device: torch.device | str = "cpu") -> QuantWeight:
    """The kernel form of ``values`` for activations of ``dtype`` on ``device``.

    Raises:
        ValueError: int4 off the CPU (torch's int4 kernel for other devices packs differently).
    """
    device = torch.device(device)
    kernel_form = _kernel_form(values, dtype, device)
    if kernel_form is not None:
        return kernel_form
    if isinstance(values, Int6Values):
        values = to_int8(values)  # torch has no 6-bit kernel: the nearest 8-bit values, a scale per 32
    if isinstance(values, Int4Values):
        if device.type != "cpu":
            raise ValueError(f"int4 weights run on the CPU only; use --weights int8 or dense on {device}")
        if values.shape[0] % 16 == 0:
            return Int4Weight(values, dtype)
        values = to_int8(values)  # torch's int4 packing takes whole blocks of 16 output rows
    return Int8Weight(Int8Values(values.q.to(device), values.scale.to(device)), dtype)


def _kernel_form(values: QuantValues, dtype: torch.dtype, device: torch.device | str) -> QuantWeight | None:
    """``values`` in rill's own kernel's layout, or None where that kernel does not run (another
    device, a CPU without it, an input width it does not take)."""
    if torch.device(device).type != "cpu" or values.shape[1] % GROUP_SIZE:
        return None
    import rill.models.qkernel as qkernel

    return qkernel.BlockedWeight(values, dtype) if qkernel.available() else None


class QuantizedLinear(nn.Module):
    """``nn.Linear`` over a ``QuantWeight`` (bias kept in the compute dtype)."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T + b``."""
        return packed.linear(x, self.weight, self.bias)


class QuantizedEmbedding(nn.Module):
    """``nn.Embedding`` over int8 rows (dequantized as they are looked up)."""

    def __init__(self, weight: Int8Weight) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids``."""
        return self.weight.rows(ids)


def install(
    model: nn.Module, state: dict[str, object], dtype: torch.dtype, device: torch.device | str
) -> dict[str, object]:
    """Put the quantized weights of ``state`` into ``model`` in place of its dense modules.

    ``state`` maps the model's parameter names to tensors or quantized values; every
    ``<module>.weight`` that is quantized replaces ``<module>`` (an ``nn.Linear`` keeps its
    bias from ``state``; an ``nn.Embedding`` gets int8 rows). Returns what is left of
    ``state`` for ``load_state_dict``.

    Raises:
        ValueError: a quantized weight for a module that is neither linear nor an embedding.
    """
    rest = dict(state)
    for name, value in state.items():
        if not is_values(value):
            continue
        module_name = name.removesuffix(".weight")
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = getattr(parent, child)
        del rest[name]
        if isinstance(module, nn.Embedding):
            replacement: nn.Module = QuantizedEmbedding(Int8Weight(to_int8(value, per_row=True), dtype).to(device))
            if module is getattr(model, "embed_tokens", None) and getattr(model, "lm_head", False) is None:
                head = _tied_head(value, dtype, device)
                if head is not None:
                    model.lm_head = QuantizedLinear(head, None)
        elif isinstance(module, nn.Linear):
            bias = rest.pop(f"{module_name}.bias", None)
            bias_tensor = None if bias is None else bias.to(dtype=dtype, device=device)  # type: ignore[attr-defined]
            replacement = QuantizedLinear(pack(value, dtype, device), bias_tensor)
        else:
            raise ValueError(
                f"{name}: quantized weights serve linear layers and embeddings, not {type(module).__name__}"
            )
        setattr(parent, child, replacement)
    return rest


def _tied_head(values: QuantValues, dtype: torch.dtype, device: torch.device | str) -> QuantWeight | None:
    """The LM head of a model that ties it to its embedding, as its own weight in rill's kernel's
    layout (the file's own values), or None where that kernel does not run.

    The embedding keeps int8 rows for its lookups, a few rows a step; the head multiplies every
    row of that matrix by every token of the step, and through torch's int8 kernel that was the
    dearest product of SmolLM2's decode step. Measured on the 2-core machine (49,152 x 576):
    0.63 ms at one row, 2.13 at 8, 8.22 at 32 through torch; 0.24, 0.91 and 2.68 ms in the
    kernel, whose products of many rows are also handed out to free threads where the engine
    shares its cores (``qkernel.share_cores``). The price is a second copy of the matrix
    (28 MB for SmolLM2's 8-bit values).
    """
    return _kernel_form(values, dtype, device)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model`` and of the packed copies attached to
    them (``rill.models.packed``), each storage once."""
    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [copy for t in tensors if (copy := packed.packed_copy(t)) is not None]
    for tensor in tensors:
        if tensor.device.type == "meta" or tensor.is_mkldnn:
            total += 0 if tensor.device.type == "meta" else tensor.numel() * tensor.element_size()
            continue
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += tensor.untyped_storage().nbytes()
    return total
