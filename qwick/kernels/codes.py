"""Activation codes: the one rounding rule every kernel that quantizes activations to fp8 or int8 applies
(RMSNorm, SiLU-and-mul, the row quantizer and the GEMV that quantizes its own tiles), so that all of them
give the bits of the torch reference (`qwick.quantization.w8a8._to_codes`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def codes_of(x, scale, QMAX: tl.constexpr, IS_INT: tl.constexpr):
    """fp32 values -> their codes at `scale` (still fp32): IEEE division, round half to even for int8 (as
    torch.round), saturated at +-QMAX. Shared by every kernel that quantizes activations."""
    q = tl.math.div_rn(x, scale)
    if IS_INT:
        r = tl.floor(q + 0.5)
        tie_to_odd = ((r - q) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0)
        q = tl.where(tie_to_odd, r - 1.0, r)
    return tl.minimum(tl.maximum(q, -QMAX), QMAX)
