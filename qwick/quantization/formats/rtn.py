"""Round-to-nearest int4 quantization of a float weight, for bf16/fp16 checkpoints quantized at load.

Asymmetric, group size 128 along K, as AWQ stores it: per group of a row, the range [min, max] (widened to
include 0, as GPTQ's quantizer does, so that 0 stays exact and the zero point needs no clamping) maps onto
0..15 with

    scale = (max - min) / 15   rounded *up* to fp16 (the range still fits in 16 steps)
    zero  = round(-min / scale)                     in 0..15
    q     = clamp(round(w / scale) + zero, 0, 15)   so that |w - (q - zero) * scale| <= scale / 2

The symmetric variant (GPTQ's `sym=True`) uses scale = 2 * max|w| / 15 and zero = 8.
`quantize` returns the kernels' `QuantizedWeight`; `quantize_groups` the plain arrays the AWQ and GPTQ
packers share.
"""

from __future__ import annotations

import torch

from qwick.quantization.formats.layout import QuantizedWeight, compact_zeros, pack_along_k

DEFAULT_GROUP_SIZE = 128


def quantize_groups(
    w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, bits: int = 4, sym: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RTN-quantize w [N, K] in groups of `group_size` along K.

    Returns (q uint8 [N, K], zeros uint8 [N, K / g], scales fp16 [N, K / g]) with
    w ~= (q - zeros) * scales per group.
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
    maxq = (1 << bits) - 1
    groups = w.to(torch.float32).reshape(n, k // group_size, group_size)
    if sym:
        amax = groups.abs().amax(-1)
        scale = 2 * amax / torch.full_like(amax, maxq)
    else:
        lo = groups.amin(-1).clamp(max=0)
        hi = groups.amax(-1).clamp(min=0)
        # A tensor divisor, not a Python number: CUDA divides by a scalar as a multiplication by its
        # reciprocal (not correctly rounded), CPUs divide exactly; this way every device gets the same scale.
        scale = (hi - lo) / torch.full_like(hi, maxq)
    scales = _fp16_round_up(scale)
    s = scales.to(torch.float32)
    if sym:
        zeros = torch.full_like(s, (maxq + 1) // 2)
    else:
        zeros = torch.round(-lo / s).clamp(0, maxq)
    q = (torch.round(groups / s.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, maxq)
    return q.reshape(n, k).to(torch.uint8), zeros.to(torch.uint8), scales


def _fp16_round_up(scale: torch.Tensor) -> torch.Tensor:
    """fp16 values >= `scale`, and > 0 (an all-zero group gets the smallest subnormal; its q are all zero)."""
    tiny = torch.finfo(torch.float16).smallest_normal * 2.0**-10  # the smallest fp16 subnormal
    scale = scale.clamp(min=tiny)
    half = scale.to(torch.float16)
    up = torch.nextafter(half, torch.full_like(half, float("inf")))
    return torch.where(half.to(torch.float32) < scale, up, half)


def quantize(
    w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, bits: int = 4, sym: bool = False
) -> QuantizedWeight:
    """RTN-quantize a float weight [N, K] (bf16/fp16/fp32) straight into the kernels' layout."""
    q, zeros, scales = quantize_groups(w, group_size, bits, sym)
    zeros_t, zero_point = compact_zeros(zeros)
    return QuantizedWeight(
        qweight=pack_along_k(q, bits),
        scales=scales,
        bits=bits,
        group_size=group_size,
        zeros=zeros_t,
        zero_point=zero_point,
    )
