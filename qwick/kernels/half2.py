"""Pieces shared by the code that computes in packed fp16 (f16x2) on the CUDA cores: the batch-1 int4
GEMV `qwick.kernels.row_gemv_half2` and its stage-by-stage diagnosis (`benchmarks/int4_stream_diag.py`).
Their products are PTX (`tl.inline_asm_elementwise`), which Triton's interpreter cannot run: under
TRITON_INTERPRET=1 the kernels compute the same products in fp32 instead (`EMULATE`)."""

from __future__ import annotations

import os

import triton
import triton.language as tl

EMULATE = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as Triton reads it when kernels are defined


def sum_halves_asm(acc: str = "acc", out: str = "$0") -> list[str]:
    """PTX lines adding the two fp16 halves of the f16x2 register `acc` into the fp32 output `out`
    (the registers lo, hi, fa, fb must be declared)."""
    return [f"mov.b32 {{lo, hi}}, {acc};", "cvt.f32.f16 fa, lo;", "cvt.f32.f16 fb, hi;"] + [
        f"add.f32 {out}, fa, fb;"
    ]


@triton.jit
def split4(t):
    """A [..., 2, 2] tensor -> its four [...] slices, in the order of the flattened last two indices."""
    a, b = tl.split(t)  # last index 0 (flat 0, 2) / 1 (flat 1, 3)
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1
