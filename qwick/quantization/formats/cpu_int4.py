"""4-bit weights on the CPU at decode sizes: torch's int4 GEMM for CPUs (`torch._weight_int4pack_mm_for_cpu`).

The reference path (`reference.dequant_matmul`) dequantizes W for every call. For one row of bf16
activations on this project's 2-core Xeon that made `quantization="int4"` 6x slower than bf16 weights (368
ms per demo-model step against 64). torch's int4 kernel reads the codes as they are: qwen2.5-0.5b-shaped
decoder layers take 15.8 ms per token against 45.9 through oneDNN's bf16 GEMM (all 24 layers, weights out of
cache). The kernel's time grows with the rows (16 rows cost 6x one), and it is 20-40x slower with fp32 or
fp16 activations, so it serves bf16 inputs of at most `MAX_ROWS` rows; the rest keeps the reference path.

The kernel's weight is W = (q - 8) * scale + zero per group of K, scale and zero in the activations' dtype,
N a multiple of 16, groups of 32-256. `QuantizedWeight`'s three forms map onto it exactly in float32:
(q - z) * s  ->  zero = (8 - z) * s;  q * s - m  ->  zero = 8 * s - m. In bf16 the scale and zero are
rounded once (8 mantissa bits, like a bf16 weight), so results match the reference to bf16 rounding, not
bit for bit. The layer keeps this copy of the codes beside its `QuantizedWeight` (half a byte per weight
more), made at its first decode-sized call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from qwick.quantization.formats.layout import QuantizedWeight, unpack_along_k

MAX_ROWS = 16
GROUP_SIZES = (32, 64, 128, 256)
# fp16 inputs are 20-40x slower in this kernel than bf16 (slower than dequantizing), and so is everything
# on CPUs without AVX2 (torch's "default" kernels): those keep the reference path.
DTYPES = (torch.bfloat16,)
FAST_CPUS = ("AVX2", "AVX512")


@dataclass(frozen=True)
class Int4Pack:
    """A `QuantizedWeight` in the kernel's layout: codes uint8 [N, K / 2], scales_zeros [K / group, N, 2]."""

    codes: torch.Tensor
    scales_zeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None


@functools.cache
def available() -> bool:
    """torch has the kernel, and this CPU runs its vectorized build (asked once: `supports` runs per call)."""
    kernels = ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")
    return all(hasattr(torch, name) for name in kernels) and fast_cpu()


@functools.cache
def fast_cpu() -> bool:
    """Whether torch's CPU kernels run vectorized here (its weight-only int4 and int8 GEMMs are slower than
    dequantizing without AVX2)."""
    return torch.backends.cpu.get_cpu_capability() in FAST_CPUS


def supports(weight: QuantizedWeight, x: torch.Tensor) -> bool:
    """Whether `matmul` can take x [rows, K] times this weight."""
    return (
        x.device.type == "cpu"
        and weight.qweight.device.type == "cpu"
        and x.dtype in DTYPES
        and 0 < x.shape[0] <= MAX_ROWS
        and weight.bits == 4
        and weight.group_size in GROUP_SIZES
        and weight.shape[0] % 16 == 0
        and available()
    )


def pack(weight: QuantizedWeight, dtype: torch.dtype) -> Int4Pack:
    """Convert once (the layer caches it): unpack the codes, let torch repack them, fold zeros or mins."""
    codes = torch._convert_weight_to_int4pack_for_cpu(unpack_along_k(weight.qweight, 4).to(torch.int32), 1)
    scale = weight.scales.float()
    if weight.zeros is not None:
        zero = (8 - weight.zeros.float()) * scale
    elif weight.mins is not None:
        zero = 8 * scale - weight.mins.float()
    else:
        zero = (8 - weight.zero_point) * scale
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return Int4Pack(codes, scales_zeros, weight.group_size, weight.perm)


def matmul(x: torch.Tensor, packed: Int4Pack, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` for x [rows, K]; act-order weights gather x into stored order first."""
    if packed.perm is not None:
        x = x.index_select(1, packed.perm)
    y = torch._weight_int4pack_mm_for_cpu(
        x.contiguous(), packed.codes, packed.group_size, packed.scales_zeros
    )
    return y if bias is None else y + bias.to(y.dtype)
