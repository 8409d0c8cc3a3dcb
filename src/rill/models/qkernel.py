"""rill's own CPU kernels for x86 CPUs with AVX-512 VNNI: the quantized matmul
(``kernels/qgemm.c``), one decode step of attention (``kernels/attention.c``), and a whole
decode step through every layer of a Llama-family model built of both (``kernels/layers.c``).

torch's CPU kernels for int4 and int8 weights (``aten._weight_int4pack_mm_for_cpu``,
``aten._weight_int8pack_mm``) read a one-row product's weights at about 18 GB/s where the
machine reads 28-33, and their cost grows with every row (an 8960x1536 int4 product: 0.39 ms
at one row, 5.75 ms at 32, 1.47 s for an 8,190-token prefill). This kernel rounds the
activations to int8 per group of 32 and multiplies them with the weights' bytes by VPDPBUSD,
sixteen output rows at a time and up to four activation rows per weight load, so a step
reads each weight once whatever its batch.

The C source is compiled once per machine with the system's C compiler into rill's cache
(``~/.cache/rill/kernels``, keyed by the source's hash) and loaded with ``ctypes``; it uses
the OpenMP runtime torch has already loaded, so its threads are torch's. Where the CPU lacks
AVX-512 VNNI, no compiler is found or the build fails, ``available()`` is False (with the
reason in ``unavailable_reason()``) and rill uses torch's kernels.

``BlockedWeight`` holds a weight in the kernel's layout (documented in the C file): 4-bit
values with fp16 scales and offsets cost 0.625 bytes a weight, 8-bit values 1.125, and a
GGUF Q6_K tensor's own 6-bit values 0.82 (what the file holds), where int8 took 1.125.

Imports torch, ``rill.models.quant`` (``QuantWeight``) and ``rill.models.quant_values``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rill.models.quant import QuantWeight
from rill.models.quant_values import GROUP_SIZE, Int4Values, Int6Values, Int8Values

log = logging.getLogger("rill.models")

KERNELS = Path(__file__).with_name("kernels")
SOURCES = (KERNELS / "qgemm.c", KERNELS / "attention.c", KERNELS / "layers.c")
HEADERS = (KERNELS / "simd.h",)
CFLAGS = (
    "-O3",
    "-fPIC",
    "-shared",
    "-fopenmp",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512vnni",
    "-mf16c",
    "-mfma",
    "-fno-math-errno",
    "-ffp-contract=off",
)
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")
"""/proc/cpuinfo flags the kernel needs."""

_C_TYPES = {"i": ctypes.c_int, "l": ctypes.c_int64, "p": ctypes.c_void_p, "f": ctypes.c_float}
_SIGNATURES = {  # each C function's arguments, a letter each (``_C_TYPES``); all return int
    "rill_linear": "ipppllpilpipf",  # bits, w, s, z, N, K, x, x_bf16, M, y, pre, norm, eps
    "rill_decode_attention": "pillllppppppllfp",  # see kernels/attention.c
    "rill_decode_layers": "plplllllfpppppplf",  # see kernels/layers.c
    "rill_set_schedule": "i",  # dynamic (see kernels/qgemm.c)
}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_reason: str | None = None


def cache_dir() -> Path:
    """Where compiled kernels are kept (``<cache root>/kernels``, ``rill.cache``)."""
    from rill.cache import cache_root

    return cache_root() / "kernels"


def available() -> bool:
    """Whether the kernel runs here (compiling it on the first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why the kernel does not run here (None when it does)."""
    _load()
    return _reason


def share_cores(shared: bool = True) -> None:
    """Tell this process's products whether the engine shares its cores with other busy
    processes (an engine replica beside Ray's daemons and the server process). When it does,
    a product of many rows hands its weight blocks out to whichever thread is free, so that
    a thread preempted by another process does not hold up the step; otherwise each thread
    takes a fixed half, which streams the weights best. A no-op where the kernel does not run."""
    library = _load()
    if library is not None:
        library.rill_set_schedule(int(shared))


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _load() -> ctypes.CDLL | None:
    global _library, _reason
    with _lock:
        if _library is not None or _reason is not None:
            return _library
        if os.environ.get("RILL_QKERNEL", "1") == "0":
            _reason = "turned off by RILL_QKERNEL=0"
            return None
        missing = [flag for flag in REQUIRED_FLAGS if flag not in _cpu_flags()]
        if missing:
            _reason = f"the CPU lacks {', '.join(missing)}"
            return None
        try:
            path = _build()
            library = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            _reason = f"the kernel could not be built: {exc}"
            log.warning("quantized kernel: %s; using torch's kernels", _reason)
            return None
        for name, letters in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes = tuple(_C_TYPES[letter] for letter in letters)
            function.restype = ctypes.c_int
        _library = library
        return library


def _build() -> Path:
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(source + " ".join(CFLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / f"qgemm-{digest}.so"
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *CFLAGS, *map(str, SOURCES), "-o", str(built), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            raise RuntimeError(result.stderr.strip()[-500:] or f"{compiler} exited {result.returncode}")
        os.replace(built, target)  # atomic: a concurrent start sees the whole file or none
    log.info("quantized kernel compiled into %s", target)
    return target


_PRE_NONE, _PRE_RMS, _PRE_SWIGLU = 0, 1, 2
"""What the kernel does to activations before rounding them (``PRE_*`` in the C file)."""


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


_KINDS = {4: "int4", 5: "int4", 6: "int6", 8: "int8"}
"""Kernel layout (``bits`` in the C file) -> kind; 5 is 4-bit values with Q4_K's own scales."""


class BlockedWeight(QuantWeight):
    """A weight in the VNNI kernel's layout (documented in ``kernels/qgemm.c``): 4-bit
    (``int4``) or 8-bit (``int8``) values with fp16 scales and offsets per 16 rows and 32
    inputs, or a Q6_K tensor's own 6-bit values (``int6``) with its int8 sub-scales per 16
    inputs and fp16 scales per 256."""

    _norm_f32: tuple[torch.Tensor, torch.Tensor] | None = None
    """The norm weight ``linear_rms`` last applied and its float32 copy (a tuple, not a
    tensor attribute: ``nn.Module`` would register a ``Parameter`` as this module's own)."""

    def __init__(self, values: Int4Values | Int6Values | Int8Values, dtype: torch.dtype) -> None:
        super().__init__(tuple(values.shape))  # type: ignore[arg-type]
        cols = values.shape[1]
        if cols % GROUP_SIZE or (isinstance(values, Int6Values) and cols % 256):
            raise ValueError(
                f"the quantized kernel needs an input width that is a multiple of {GROUP_SIZE} "
                f"(256 for 6-bit values), not {cols}"
            )
        self._dtype = dtype
        if isinstance(values, Int6Values):
            self.bits, (packed, scales, offsets) = 6, _q6k_layout(values)
        elif isinstance(values, Int4Values) and values.k is not None and cols % 256 == 0:
            # The file's 6-bit sub-scales and mins: 4.625 bits a weight, not 5.
            self.bits, (packed, scales, offsets) = 5, _q4k_layout(values)
        else:
            self.bits = 4 if isinstance(values, Int4Values) else 8
            packed, scales, offsets = _grouped_layout(values, self.bits)
        self.kind = _KINDS[self.bits]
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of the model around it (activations in and out)."""
        return self._dtype

    def cache_attrs(self) -> dict[str, Any]:
        """Bits and compute dtype (the buffers hold the rest)."""
        return {"bits": self.bits, "dtype": str(self._dtype).removeprefix("torch.")}

    def _restore(self, attrs: dict[str, Any]) -> None:
        self.bits = int(attrs["bits"])
        self.kind = _KINDS[self.bits]
        self._dtype = getattr(torch, attrs["dtype"])

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K] @ w.T`` → ``[..., N]`` in ``x``'s dtype."""
        return self._call(x, self.shape[1], _PRE_NONE)

    def linear_rms(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``(norm_weight * rms_norm(x, eps)) @ w.T`` in one call: the norm is applied to the
        activations as the kernel rounds them, so the normalised rows are never written out
        (in float32, where the module path rounds them to the model dtype twice)."""
        cached = self._norm_f32
        if cached is None or cached[0] is not norm_weight or cached[1].shape != norm_weight.shape:
            # Once per weight (each projection always follows the same norm): a step makes no conversion.
            cached = self._norm_f32 = (norm_weight, norm_weight.detach().to(torch.float32).contiguous())
        return self._call(x, self.shape[1], _PRE_RMS, cached[1], eps)

    def linear_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``(silu(gate) * up) @ w.T`` for ``gate_up [..., 2K]`` (gate first), in one call."""
        return self._call(gate_up, 2 * self.shape[1], _PRE_SWIGLU)

    def kernel_args(self) -> tuple[int, int, int, int, int, int]:
        """The weight as the C functions take it: bits, the addresses of its packed values,
        scales and offsets, its rows and its columns."""
        rows, cols = self.shape
        return (
            self.bits,
            _ptr(self.packed),  # type: ignore[arg-type]
            _ptr(self.scales),  # type: ignore[arg-type]
            _ptr(self.offsets),  # type: ignore[arg-type]
            rows,
            cols,
        )

    def _call(
        self, x: torch.Tensor, width: int, pre: int, norm: torch.Tensor | None = None, eps: float = 0.0
    ) -> torch.Tensor:
        library = _load()
        assert library is not None, "BlockedWeight is built only where the kernel runs"
        rows, cols = self.shape
        flat = x.reshape(-1, width)
        if flat.dtype not in (torch.bfloat16, torch.float32) or not flat.is_contiguous():
            flat = flat.to(torch.float32).contiguous()
        m = flat.shape[0]
        y = torch.empty((m, rows), dtype=flat.dtype)
        if m == 0:  # malloc(0) may give NULL: nothing to compute anyway
            return y.view(*x.shape[:-1], rows).to(x.dtype)
        # One call per product (~40 us of Python per call was ~10 % of a 1.5B decode step).
        status = library.rill_linear(
            *self.kernel_args(),
            _ptr(flat),
            int(flat.dtype == torch.bfloat16),
            m,
            _ptr(y),
            pre,
            None if norm is None else _ptr(norm),
            eps,
        )
        if status != 0:
            raise MemoryError(f"the quantized kernel could not allocate scratch for {m} x {cols} activations")
        out = y.view(*x.shape[:-1], rows)
        return out if out.dtype == x.dtype else out.to(x.dtype)


Layout = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""A weight in the kernel's layout: its packed values, scales and offsets (``kernels/qgemm.c``)."""


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to a multiple of 16 (the kernel's blocks)."""
    return torch.nn.functional.pad(t, (0, 0, 0, -rows % 16))


def _per_block(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Per-row values ``[rows, G]`` as fp16 ``[block, G, lane]`` (16 lanes a block)."""
    return _pad_rows(t.float(), rows).view(-(-rows // 16), 16, -1).permute(0, 2, 1).to(torch.float16).contiguous()


def _nibbles(u: torch.Tensor, blocks: int, cols: int) -> torch.Tensor:
    # [block, lane, chunk, half, byte] -> [block, chunk, lane, byte], halves as nibbles.
    v = u.view(blocks, 16, cols // 8, 2, 4)
    return (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).permute(0, 2, 1, 3)


def _q6k_layout(values: Int6Values) -> Layout:
    """A Q6_K tensor's own 6-bit values: low nibbles, then the high bit pairs of each group;
    int8 sub-scales per 16 inputs; fp16 scales per 256."""
    rows, cols = values.shape
    blocks, groups = -(-rows // 16), cols // GROUP_SIZE
    u = _pad_rows(values.q.to(torch.uint8), rows)
    nibbles = _nibbles(u & 0x0F, blocks, cols).reshape(blocks, groups, 4 * 64)
    # [block, lane, group, vector k, pair j, byte i]: operand 4k + j of a group.
    pairs = (u >> 4).view(blocks, 16, groups, 2, 4, 4)
    high = (
        pairs[:, :, :, :, 0] | (pairs[:, :, :, :, 1] << 2) | (pairs[:, :, :, :, 2] << 4) | (pairs[:, :, :, :, 3] << 6)
    )
    high = high.permute(0, 2, 3, 1, 4).reshape(blocks, groups, 2 * 64)  # [block, group, k, lane, i]
    subs = _pad_rows(values.sub, rows).view(blocks, 16, groups, 2).permute(0, 2, 3, 1)
    return torch.cat((nibbles, high), dim=2).contiguous().view(-1), subs.contiguous(), _per_block(values.d, rows)


def _q4k_layout(values: Int4Values) -> Layout:
    """A Q4_K tensor's 4-bit values with the file's own 6-bit sub-scales and mins per 32
    inputs and fp16 scales per 256."""
    rows, cols = values.shape
    blocks, groups = -(-rows // 16), cols // GROUP_SIZE
    assert values.k is not None
    packed = _nibbles(_pad_rows(values.q.to(torch.uint8), rows), blocks, cols).contiguous().view(-1)
    k = values.k
    subs = torch.stack([_pad_rows(t, rows).view(blocks, 16, groups).permute(0, 2, 1) for t in (k.sc, k.mn)], dim=2)
    offsets = torch.stack([_per_block(k.d, rows), _per_block(-k.dmin, rows)], dim=2).contiguous()
    return packed, subs.contiguous(), offsets  # scales: [block, group, sc/mn, lane]


def _grouped_layout(values: Int4Values | Int8Values, bits: int) -> Layout:
    """4-bit or 8-bit values with an fp16 scale and offset per 16 rows and 32 inputs.

    Raises:
        ValueError: int8 values with other than one scale per 32 inputs.
    """
    rows, cols = values.shape
    blocks, groups = -(-rows // 16), cols // GROUP_SIZE
    if isinstance(values, Int4Values):
        u = values.q.to(torch.uint8)
        scale, offset = values.scale, values.offset
    else:
        u = (values.q.to(torch.int16) + 128).to(torch.uint8)  # unsigned bytes for VPDPBUSD
        scale = values.scale.expand(rows, groups) if values.scale.shape[1] == 1 else values.scale
        if values.scale.shape[1] != groups:
            raise ValueError("int8 weights for the quantized kernel need one scale per 32 inputs")
        offset = -128.0 * scale
    u = _pad_rows(u, rows)
    packed = _nibbles(u, blocks, cols) if bits == 4 else u.view(blocks, 16, cols // 4, 4).permute(0, 2, 1, 3)
    return packed.contiguous().view(-1), _per_block(scale, rows), _per_block(offset, rows)


def _attention_fits(
    x: torch.Tensor, caches: Sequence[torch.Tensor], num_heads: int, cache_rows: torch.Tensor | None
) -> bool:
    """Whether ``kernels/attention.c`` takes the tokens ``x`` over ``caches`` (each
    ``[rows, KVH, max_len, D]``, all one shape, contiguous, in ``x``'s dtype, on the CPU)."""
    first = caches[0]
    rows, kv_heads, _, head_dim = first.shape
    return not (
        head_dim % 32
        or head_dim > 256
        or num_heads % kv_heads
        or x.device.type != "cpu"
        or not x.is_contiguous()
        or (cache_rows is None and x.shape[0] > rows)
        or not all(
            t.dtype == x.dtype and t.is_contiguous() and t.shape == first.shape and t.device.type == "cpu"
            for t in caches
        )
    )


def _token_rows(
    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, cache_rows: torch.Tensor | None, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each token's RoPE rows ``[B, D]``, position and cache row as the C kernels read them."""
    batch = positions.shape[0]
    return (
        cos.reshape(batch, head_dim).contiguous(),
        sin.reshape(batch, head_dim).contiguous(),
        positions.to(torch.int64).contiguous(),
        None if cache_rows is None else cache_rows.to(torch.int64).contiguous(),
    )


def decode_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    window: int | None,
    scale: float | None = None,
    cache_rows: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Attention of tokens that each attend from their own position, in one call
    (``kernels/attention.c``): RoPE on the query and key heads of ``qkv [B, (H + 2 KVH) * D]``,
    the keys and values written at ``positions [B]`` of the caches ``[rows, KVH, max_len, D]``,
    and attention over each token's row up to its position (the last ``window`` keys with a
    sliding window).

    Token ``b`` goes to cache row ``b`` (decode rows ``0..B-1``), or to ``cache_rows[b]``: then
    several tokens may be consecutive positions of one row (a speculative draft), every key is
    written before any token attends, and each token's result is bit for bit what a one-token
    step at its position gives.

    Returns ``[B, H * D]`` in ``qkv``'s dtype, or None where the kernel does not apply (no
    kernel here, another dtype or layout, a head size that is not a multiple of 32): the
    caller then takes the torch path, which computes the same thing.
    """
    library = _load()
    _, kv_heads, max_len, head_dim = k_cache.shape
    batch = qkv.shape[0]
    if (
        library is None
        or qkv.dtype not in (torch.bfloat16, torch.float32)
        or not _attention_fits(qkv, (k_cache, v_cache), num_heads, cache_rows)
        or qkv.shape[1] != (num_heads + 2 * kv_heads) * head_dim
    ):
        return None
    cos, sin, positions, cache_rows = _token_rows(cos, sin, positions, cache_rows, head_dim)
    out = torch.empty((batch, num_heads * head_dim), dtype=qkv.dtype)
    status = library.rill_decode_attention(
        _ptr(qkv),
        int(qkv.dtype == torch.bfloat16),
        batch,
        num_heads,
        kv_heads,
        head_dim,
        _ptr(cos),
        _ptr(sin),
        _ptr(positions),
        None if cache_rows is None else _ptr(cache_rows),
        _ptr(k_cache),
        _ptr(v_cache),
        max_len,
        window or 0,
        head_dim**-0.5 if scale is None else scale,
        _ptr(out),
    )
    return out if status == 0 else None


class _Product(ctypes.Structure):
    _fields_ = (
        ("bits", ctypes.c_int64),
        ("packed", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
    )


class _Layer(ctypes.Structure):
    _fields_ = (
        ("qkv", _Product),
        ("o", _Product),
        ("gate_up", _Product),
        ("down", _Product),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("window", ctypes.c_int64),
    )


@dataclass(frozen=True)
class LayerWeights:
    """One Llama-family decoder layer as ``DecodeLayers`` takes it: its four products (each a
    weight and an optional bias), its two RMS norms' weights and its attention window."""

    qkv: tuple[object, torch.Tensor | None]
    o: tuple[object, torch.Tensor | None]
    gate_up: tuple[object, torch.Tensor | None]
    down: tuple[object, torch.Tensor | None]
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    window: int | None


class DecodeLayers:
    """Every layer of a model in ``kernels/layers.c``'s terms, so that a decode step (or a
    step of speculative drafts) runs all of them in one call: per layer the fused q/k/v
    product after the input norm, RoPE, cache write and attention, the output product and
    residual, the gate/up product after the post-attention norm, SwiGLU, the down product and
    residual, each rounded to bfloat16 where the model's Python path rounds it, so the step's
    result is that path's bit for bit. Build it with ``build``; it keeps every tensor it
    points at alive.
    """

    def __init__(self, layers: list[_Layer], keep: list[torch.Tensor], hidden: int) -> None:
        self._layers = (_Layer * len(layers))(*layers)
        self._keep = keep
        self.num_layers = len(layers)
        self.hidden = hidden

    @classmethod
    def build(cls, layers: Sequence[LayerWeights]) -> DecodeLayers | None:
        """The layers in the kernel's terms, or None where it does not apply: no kernel here,
        a product that is not a ``BlockedWeight`` with bfloat16 activations, a bias that is
        not a bfloat16 vector, or a norm of another width."""
        if _load() is None or not layers:
            return None
        keep: list[torch.Tensor] = []

        def product(pair: tuple[object, torch.Tensor | None]) -> _Product | None:
            weight, bias = pair
            if not isinstance(weight, BlockedWeight) or weight.dtype != torch.bfloat16:
                return None
            if bias is not None:
                if bias.dtype != torch.bfloat16 or bias.device.type != "cpu" or bias.shape != (weight.shape[0],):
                    return None
                bias = bias.detach().contiguous()
                keep.append(bias)
            keep.extend((weight.packed, weight.scales, weight.offsets))  # type: ignore[arg-type]
            return _Product(*weight.kernel_args(), None if bias is None else _ptr(bias))

        built = []
        hidden = layers[0].input_norm.shape[0]
        for layer in layers:
            products = [product(pair) for pair in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(p is None for p in products):
                return None
            qkv, o, gate_up, down = products
            assert qkv and o and gate_up and down
            if not (qkv.cols == gate_up.cols == o.rows == down.rows == hidden and down.cols * 2 == gate_up.rows):
                return None
            norms = []
            for norm in (layer.input_norm, layer.post_norm):
                if norm.shape != (hidden,):
                    return None
                # As BlockedWeight.linear_rms takes it: the norm's weight in float32.
                norms.append(norm.detach().to(device="cpu", dtype=torch.float32).contiguous())
            keep.extend(norms)
            built.append(_Layer(qkv, o, gate_up, down, _ptr(norms[0]), _ptr(norms[1]), layer.window or 0))
        return cls(built, keep, hidden)

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        num_heads: int,
        eps: float,
        cache_rows: torch.Tensor | None = None,
    ) -> bool:
        """Every layer on ``x [B, hidden]`` (bfloat16, updated in place), each token attending
        from ``positions[b]`` of cache row ``b`` or ``cache_rows[b]``, as ``decode_attention``
        takes them (``k_caches[l]``, ``v_caches[l]`` for layer ``l``).

        Returns False, with nothing touched, where the kernel does not apply (another dtype,
        device or layout of ``x`` or the caches); the caller then runs the layers one by one.

        Raises:
            MemoryError: the kernel's scratch could not be had (``x`` and the caches are then
                partly updated: the step is lost).
        """
        library = _load()
        batch = x.shape[0]
        _, kv_heads, max_len, head_dim = k_caches[0].shape
        if (
            library is None
            or x.dtype != torch.bfloat16
            or cos.dtype != torch.bfloat16
            or sin.dtype != torch.bfloat16
            or x.shape[1] != self.hidden
            or len(k_caches) != self.num_layers
            or len(v_caches) != self.num_layers
            or not _attention_fits(x, (*k_caches, *v_caches), num_heads, cache_rows)
        ):
            return False
        cos, sin, positions, cache_rows = _token_rows(cos, sin, positions, cache_rows, head_dim)
        pointers = ctypes.c_void_p * self.num_layers
        status = library.rill_decode_layers(
            self._layers,
            self.num_layers,
            _ptr(x),
            batch,
            self.hidden,
            num_heads,
            kv_heads,
            head_dim,
            eps,
            _ptr(cos),
            _ptr(sin),
            _ptr(positions),
            None if cache_rows is None else _ptr(cache_rows),
            pointers(*(_ptr(t) for t in k_caches)),
            pointers(*(_ptr(t) for t in v_caches)),
            max_len,
            head_dim**-0.5,
        )
        if status != 0:
            raise MemoryError(f"the decode kernel could not allocate scratch for {batch} tokens")
        return True
