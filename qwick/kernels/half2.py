"""Pieces shared by the code that computes in packed fp16 (f16x2) through PTX: the batch-1 int4 GEMV
`qwick.kernels.row_gemv_half2` and its stage-by-stage diagnosis (`benchmarks/int4_stream_diag.py`), and
the fp8-KV attention kernels' query conversion (`quarter_byte_f16`). PTX
(`tl.inline_asm_elementwise`) is what Triton's interpreter cannot run: under TRITON_INTERPRET=1 the
kernels compute the same in plain Triton instead (`EMULATE`)."""

from __future__ import annotations

import os

import triton
import triton.language as tl

EMULATE = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as Triton reads it when kernels are defined
_EMULATE = tl.constexpr(EMULATE)


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


# The PTX of `quarter_byte_f16`: a pair of 16-bit floats in $1 -> the fp16 pair of their quarters of a
# byte in $0; `up` widens one to fp32.


def quarter_byte_asm(up: str) -> str:
    return (
        "{ .reg .b16 a, b; .reg .f32 fa, fb; mov.b32 {a, b}, $1; "
        f"{up} fa, a; {up} fb, b; mul.rn.f32 fa, fa, 0f3B800000; mul.rn.f32 fb, fb, 0f3B800000; "
        "cvt.rn.f16x2.f32 $0, fb, fa; }"
    )


_QUARTER_BF16_ASM = tl.constexpr(quarter_byte_asm("cvt.f32.bf16"))
_QUARTER_F16_ASM = tl.constexpr(quarter_byte_asm("cvt.f32.f16"))


@triton.jit
def quarter_byte_f16(x):
    """bf16 or fp16 x / 256 in fp16: finite for any |x| below 2^24, where fp16 itself ends at 65504. PTX,
    for two reasons. Written in Triton, the compiler turns `(x * 2^-8).to(float16)` into
    `x.to(float16) * 2^-8`, which overflows from 65520 on (seen in the sm_90 PTX of Triton 3.6). And,
    marked impure, the conversion stays where x was loaded: an activation tile feeding a dot is otherwise
    converted after its change to the dot's operand layout, where every warp holds the whole tile (4x the
    conversions with 4 warps). Under the interpreter, plain Triton (`EMULATE`)."""
    if _EMULATE:
        return (x.to(tl.float32) * 0.00390625).to(tl.float16)
    if x.dtype == tl.bfloat16:
        asm: tl.constexpr = _QUARTER_BF16_ASM
    else:
        asm: tl.constexpr = _QUARTER_F16_ASM
    return tl.inline_asm_elementwise(
        asm,
        "=r,r",
        [x],
        dtype=tl.float16,
        is_pure=False,
        pack=2,
    )
