"""Activation codes: the one rounding rule every kernel that quantizes activations to fp8 or int8 applies
(RMSNorm, SiLU-and-mul, the row quantizer and the gated W8A8 GEMV's group tail), so that all of them
give the bits of the torch reference (`qwick.quantization.w8a8._to_codes`); and the buffers and
meta-parameters those kernels take for a `RowQuant`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qwick.layers.linear import RowQuant

_ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2^23


@triton.jit
def codes_of(x, scale, QMAX: tl.constexpr, IS_INT: tl.constexpr):
    """fp32 values -> their codes at the scalar `scale` (still fp32): x / scale as IEEE division rounds it,
    round half to even for int8 (as torch.round), saturated at +-QMAX. Shared by every kernel that
    quantizes activations.

    The quotient is x times the rounded reciprocal, corrected once (Markstein: the remainder q * scale - x
    by an fma, exact, then q - remainder / scale by another): three full-rate operations an element and
    one division a thread. `div_rn` per element compiles to a fast path, a call to a slow one and a
    divergence guard each; the one-row RMSNorm with codes took 2.74 us on 32 warps and 4.44 on 8 with it,
    2.21 and 2.25 with a bare multiplication in its place (H100, `benchmarks/norm_codes_ablation.py`,
    57th session); batch 1 gained 0.3-0.5% (int8) and 0.6% (fp8) on H100s (58th session).
    The remainder is taken as q * scale - x, not x - q * scale: for x = -0.0 the latter sums +0 and -0
    to +0 and the code comes out +0 (fp8 0x00) where division gives -0 (0x80); Triton's `-x` is 0 - x.
    Against IEEE division, over every bf16 and fp16 value x of either sign up to every bf16 and fp16
    absmax from 1e-10 (int8 and fp8 scales, ~3.8e9 pairs) and 4.2e8 random fp32 values at each qmax:
    the same codes, and the same quotient bit for bit except below 4.2e-22 in bf16, where the
    remainder underflows and every code is 0 either way (`python benchmarks/codes_reciprocal_check.py`).

    The rounding adds and takes away 1.5 * 2^23: their sum's ulp is 1, so fp32's own round-to-nearest-even
    rounds q, exactly for |q| < 2^22 (and further out, within 2 of q, which the saturation then decides).
    Two full-rate adds, where `floor` and a tie test took two `FRND`s at a quarter rate and ~6 more (the
    same bits; int8 batch 1 348.47 against 348.28 decode tok/s on an H100, 54th session)."""
    inv = tl.math.div_rn(1.0, scale)
    q0 = x * inv
    q = tl.fma(tl.fma(q0, scale, -x), -inv, q0)  # q0 - (q0 * scale - x) / scale: -0 stays -0
    if IS_INT:
        q = (q + _ROUNDER) - _ROUNDER
    return tl.minimum(tl.maximum(q, -QMAX), QMAX)


def inv_qmax(qmax: float) -> float:
    """fp32(1 / qmax) as a Python float: the factor torch's CUDA `tensor / qmax` multiplies by."""
    return float(torch.tensor(1.0, dtype=torch.float32) / qmax)


def code_buffers(x: torch.Tensor, quant: RowQuant | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Buffers for the codes [rows, N] and scales [rows, 1] (or [rows, ceil(N / group)]) of `quant` for
    the values x [rows, N] (dummies without it), and the kernels' quantization meta-parameters."""
    rows, n = x.shape
    if quant is None:
        return x, x, {"QMAX": 0.0, "INV_QMAX": 0.0, "MIN_AMAX": 0.0, "IS_INT": False}
    codes = torch.empty((rows, n), dtype=quant.dtype, device=x.device)
    groups = 1 if quant.group is None else triton.cdiv(n, quant.group)
    scales = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    meta = {
        "QMAX": quant.qmax,
        "INV_QMAX": inv_qmax(quant.qmax),
        "MIN_AMAX": quant.min_amax,
        "IS_INT": not quant.dtype.is_floating_point,
    }
    return codes, scales, meta
