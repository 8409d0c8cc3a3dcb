"""Quantized weights before packing: exact int4, int6 and int8 values, from GGUF blocks or by rounding.

A GGUF file's Q4_0, Q4_1 and Q4_K tensors are 4-bit values ``q`` in groups of 32 with one
scale ``s`` and one offset ``b`` per group (``w = s * q + b``): ``Int4Values`` keeps exactly
that (no requantization), and for Q4_K also the file's own 6-bit scales (``KScales``), so
rill's kernel can store 4.625 bits a weight as the file does. Q6_K tensors stay as they are
(``Int6Values``: 6-bit values, an int8 scale per 16, an fp16 scale per 256). Other quantized
types (Q5_0, Q5_1, Q5_K, Q8_0) become ``Int8Values``: the dequantized values rounded to 8 bits
with one scale per 32 inputs; the added error is a fraction of those types' own step (bounded
in ``tests/models/test_quant.py``). Fusing q/k/v and gate/up concatenates values by rows
(``cat``); parts of mixed kinds are all made int8.

``rill.models.quant`` packs these values for a kernel (``pack``) and puts them in a model.
Imports numpy and torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

import numpy as np
import torch

GROUP_SIZE = 32
"""Values per scale/offset group of int4 weights (the GGUF Q4 types' block)."""

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
"""GGUF types kept as int4 exactly (values, per-32 scales and offsets)."""


# ------------------------------------------------------------------ weights before packing


@dataclass
class Int4Values:
    """int4 weights before packing: ``w[n, k] = scale[n, g] * q[n, k] + offset[n, g]``,
    ``g = k // GROUP_SIZE``.

    Attributes:
        q: uint8 ``[N, K]`` holding 0..15.
        scale: float32 ``[N, K / GROUP_SIZE]``.
        offset: float32 ``[N, K / GROUP_SIZE]``.
    """

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    k: KScales | None = None

    @property
    def shape(self) -> torch.Size:
        """``[N, K]``."""
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``."""
        return self.q.float() * self.scale.repeat_interleave(GROUP_SIZE, 1) + self.offset.repeat_interleave(
            GROUP_SIZE, 1
        )


@dataclass
class KScales:
    """A Q4_K tensor's own scales, from which ``Int4Values.scale = d * sc`` and ``offset =
    -dmin * mn`` were computed: kept so rill's kernel can store 4.625 bits a weight, as the
    file does, instead of fp16 scales and offsets per 32 (5 bits).

    Attributes:
        sc, mn: uint8 ``[N, K / 32]`` (6-bit values).
        d, dmin: float32 ``[N, K / 256]`` (fp16 values).
    """

    sc: torch.Tensor
    mn: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor


@dataclass
class Int8Values:
    """int8 weights before packing: ``w[n, k] = scale[n, k // (K / G)] * q[n, k]``.

    Attributes:
        q: int8 ``[N, K]``.
        scale: float32 ``[N, G]``: one scale per group of 32 inputs (``G = K / 32``), or per
            row (``G = 1``).
    """

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """``[N, K]``."""
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``."""
        return self.q.float() * self.scale.repeat_interleave(self.q.shape[1] // self.scale.shape[1], 1)


@dataclass
class Int6Values:
    """A GGUF Q6_K tensor's own values before packing: ``w[n, k] = d[n, k // 256] *
    sub[n, k // 16] * (q[n, k] - 32)``.

    Attributes:
        q: uint8 ``[N, K]`` holding 0..63.
        sub: int8 ``[N, K / 16]``: the 8-bit scale of each 16 inputs.
        d: float32 ``[N, K / 256]``: the fp16 scale of each 256 inputs.
    """

    q: torch.Tensor
    sub: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """``[N, K]``."""
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]`` (the products in the order ``gguf`` dequantizes them, so equal to it)."""
        scale = self.d.repeat_interleave(16, 1) * self.sub.float()
        return scale.repeat_interleave(16, 1) * (self.q.float() - 32.0)


QuantValues = Int4Values | Int8Values | Int6Values


def map_rows(values: QuantValues, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantValues:
    """``values`` (changed in place) with ``fn`` applied to each of its tensors, the Q4_K scales
    included: every field of every values class is per output row, so a row reordering moves
    them all alike."""
    for name in values.__dataclass_fields__:
        field = getattr(values, name)
        if isinstance(field, torch.Tensor):
            setattr(values, name, fn(field))
        elif isinstance(field, KScales):
            map_rows(field, fn)  # type: ignore[arg-type]
    return values


def is_values(value: object) -> TypeGuard[QuantValues]:
    """Whether ``value`` is a quantized weight before packing (``QuantValues``)."""
    return isinstance(value, (Int4Values, Int8Values, Int6Values))


def to_int8(weight: torch.Tensor | QuantValues, per_row: bool = False) -> Int8Values:
    """Round ``weight`` to 8 bits with a symmetric scale per group of 32 inputs (per output
    row when ``per_row`` or when the width is not a multiple of 32)."""
    if isinstance(weight, Int8Values) and (weight.scale.shape[1] == 1 or not per_row):
        return weight
    values = weight.float() if isinstance(weight, torch.Tensor) else weight.dequantize()
    rows, cols = values.shape
    groups = 1 if per_row or cols % GROUP_SIZE else cols // GROUP_SIZE
    grouped = values.reshape(rows, groups, cols // groups)
    scale = grouped.abs().amax(dim=2).clamp_min(1e-12) / 127.0
    q = torch.round(grouped / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return Int8Values(q.reshape(rows, cols), scale)


def to_int4(weight: torch.Tensor | QuantValues) -> Int4Values:
    """Round ``weight`` to 4 bits with a scale and offset per group of 32 (min/max of the group).

    Raises:
        ValueError: the input width is not a multiple of 32.
    """
    if isinstance(weight, Int4Values):
        return weight
    values = weight.float() if isinstance(weight, torch.Tensor) else weight.dequantize()
    rows, cols = values.shape
    if cols % GROUP_SIZE:
        raise ValueError(f"int4 needs an input width that is a multiple of {GROUP_SIZE}, not {cols}")
    groups = values.reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scale = ((high - low) / 15.0).clamp_min(1e-12)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return Int4Values(q.reshape(rows, cols), scale, low)


def quantize(weight: torch.Tensor | QuantValues, mode: str) -> QuantValues:
    """``weight`` in ``mode`` (``int4`` or ``int8``); int4 groups are 32 wide, so a matrix whose
    input width is not a multiple of 32 becomes int8."""
    if mode == "int4" and weight.shape[1] % GROUP_SIZE == 0:
        return to_int4(weight)
    return to_int8(weight)


def cat(parts: list[torch.Tensor | QuantValues]) -> torch.Tensor | QuantValues:
    """Concatenate weights by output rows (fused q/k/v, gate/up); ``torch.cat`` for dense ones.

    Quantized parts of one kind stay that kind; mixed kinds (a Q6_K v beside Q4_K q and k)
    all become int8, and dense parts beside quantized ones are quantized likewise.
    """
    if not any(is_values(part) for part in parts):
        return torch.cat(parts)  # type: ignore[arg-type]
    if all(isinstance(part, Int4Values) for part in parts):
        fused = Int4Values(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "offset")))  # type: ignore[arg-type]
        if all(p.k is not None for p in parts):  # type: ignore[union-attr]
            fused.k = KScales(*(torch.cat([getattr(p.k, f) for p in parts]) for f in ("sc", "mn", "d", "dmin")))  # type: ignore[union-attr]
        return fused
    if all(isinstance(part, Int6Values) for part in parts):
        return Int6Values(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "sub", "d")))
    eights = [to_int8(part) for part in parts]
    return Int8Values(torch.cat([p.q for p in eights]), torch.cat([p.scale for p in eights]))


# ------------------------------------------------------------------------- GGUF blocks


def gguf_int4(data: np.ndarray, kind: str, shape: tuple[int, int]) -> Int4Values:
    """The exact int4 form of a Q4_0, Q4_1 or Q4_K tensor's raw blocks (``shape`` = ``[N, K]``)."""
    rows, cols = shape
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if kind == "Q4_K":
        blocks = raw.reshape(-1, 144)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = _k_scales(blocks[:, 4:16])  # [B, 8] each
        qs = blocks[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 64 values
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)  # chunk c: low → 2c, high → 2c+1
        scale = d * sc
        offset = -(dmin * mn)
        k_parts = (sc.astype(np.uint8), mn.astype(np.uint8), d, dmin)
    elif kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        blocks = raw.reshape(-1, size)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, size - 16 :]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # low nibbles first 16, high next 16
        scale = d
        offset = -8.0 * d if kind == "Q4_0" else blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    else:
        raise ValueError(f"{kind} is not an int4 GGUF type ({', '.join(INT4_TYPES)})")
    groups = cols // GROUP_SIZE
    values = Int4Values(
        torch.from_numpy(np.ascontiguousarray(q).reshape(rows, cols)),
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, groups)),
        torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32).reshape(rows, groups)),
    )
    if kind == "Q4_K":
        sc8, mn8, d32, dmin32 = k_parts
        values.k = KScales(
            torch.from_numpy(np.ascontiguousarray(sc8).reshape(rows, groups)),
            torch.from_numpy(np.ascontiguousarray(mn8).reshape(rows, groups)),
            torch.from_numpy(np.ascontiguousarray(d32, dtype=np.float32).reshape(rows, cols // 256)),
            torch.from_numpy(np.ascontiguousarray(dmin32, dtype=np.float32).reshape(rows, cols // 256)),
        )
    return values


def gguf_int6(data: np.ndarray, shape: tuple[int, int]) -> Int6Values:
    """The exact form of a Q6_K tensor's raw blocks (``shape`` = ``[N, K]``, K a multiple of 256).

    A block of 256 values is 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8
    sub-scales and an fp16 scale. Each half block of 128 values takes 64 low-nibble bytes
    ``ql`` and 32 high-bit bytes ``qh``: value ``32 j + l`` (``j`` = 0..3, ``l`` = 0..31) has
    the low nibble of ``ql[l]`` (``j`` = 0), of ``ql[l + 32]`` (1), the high nibble of ``ql[l]``
    (2) or of ``ql[l + 32]`` (3), and bits ``2 j, 2 j + 1`` of ``qh[l]`` above it.
    """
    rows, cols = shape
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, 210)
    ql = blocks[:, 0:128].reshape(-1, 2, 2, 32)  # [B, half, first/second 32 bytes, l]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)  # [B, half, 1, l]
    low = np.stack([ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
    high = np.stack([(qh[:, :, 0] >> (2 * j)) & 3 for j in range(4)], axis=2)
    q = (low | (high << 4)).reshape(-1, 256)  # [B, half, j, l] -> 128 * half + 32 * j + l
    sub = blocks[:, 192:208].copy().view(np.int8)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    return Int6Values(
        torch.from_numpy(np.ascontiguousarray(q).reshape(rows, cols)),
        torch.from_numpy(np.ascontiguousarray(sub).reshape(rows, cols // 16)),
        torch.from_numpy(np.ascontiguousarray(d).reshape(rows, cols // 256)),
    )


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Q4_K/Q5_K pack eight 6-bit scales and eight 6-bit mins into 12 bytes.
    s = packed.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), dtype=np.float32)
    mn = np.empty((s.shape[0], 8), dtype=np.float32)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn
