"""One-row GEMV on int4 weights, on the CUDA cores: the batch-1 decode matmul of W4A16 models.

At batch 1 every weight is used once, so a decode step costs the weight bytes plus whatever it takes to
turn each code into a number. The tensor-core W4A16 kernel (`qwick.kernels.w4a16`) converts every code with
Triton's integer-to-float conversions and stages it through shared memory for eight shallow `tl.dot`s per
tile: on the H200 it streams int4 at only 0.24-0.43 TB/s. Here a program streams [BLOCK_N, BLOCK_W] int32
words and decodes them with integer bit operations on the packed words (the trick of Marlin and
FasterTransformer: put the code's bits into the mantissa of a float with a fixed exponent, then one fused
multiply-add removes the offset), and multiplies by x with fp32 FMAs, in registers: 3-3.4x faster at the
qwen2.5-7b shapes (benchmarks/row_gemv_sweep.py).

Decoding (one group per tile: BLOCK_W * 8 == group size, so each row's scale and zero point are scalars of
the tile): nibble i of a word is masked in place and ORed into the mantissa of 2^23, giving
2^23 + q * 16^p; one FMA (`f * 16^-p - (2^(23 - 4p) + z)`) gives q - z exactly. Nibbles 0-2 are taken from
the word, 3-7 from the word shifted right by 12: one shift and eight mask-ors per eight codes.

The exponent bits (0x4B000000) come in as a kernel argument, not a literal: a 32-bit logic instruction
(LOP3) takes one immediate, so with both the mask and the exponent as literals ptxas spends two per code;
with the exponent in a register, one. That is 13% of the loop's instructions (425 -> 368 per iteration at
the gate/up launch shape, SASS of the sm_90 build). With 16-bit activations, batch-1 decode now goes
through `qwick.kernels.row_gemv_half2` instead: the same decoding in packed fp16 (half the instructions)
over 32-word tiles, 60 against 74 us per 7b layer on the H200. This kernel stays the path for fp32
activations and the reference the f16x2 one is compared with.

The same approach for 8-bit codes (Triton's own int8/fp8 conversion on the CUDA cores, or the bit tricks)
measured no faster than the tensor-core `qwick.kernels.gemv` on 8-bit codes in per-launch timings. Timed
in CUDA graphs (31st session) it is faster at fp8's o projection, which it now serves
(`qwick.kernels.row_gemv_w8`). A packed-fp16 GEMV for 8-bit codes (as
`row_gemv_half2` does for int4: fp8 by `cvt.rn.f16x2.e4m3x2`, int8 by `prmt` into 1024 + q) was measured
too and removed: 71.6 against 70.5 us per 7b layer at its best launch shapes (BENCHMARKS.md, eighth
session of 12-01; the code is in commit `e944eb0`).

Split-K and its reduction are `qwick.kernels.gemv`'s epilogue (with BLOCK_M = 1), so the kernel replays in
CUDA graphs the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qwick.kernels.gemv import GemvWorkspace, gated_rows, split_k_epilogue, split_k_for
from qwick.kernels.w4a16 import ZERO_CONST, ZERO_TENSOR
from qwick.quantization.formats.layout import QuantizedWeight

FLOAT_2_23_BITS = 0x4B000000  # the bits of 2.0**23: a code ORed into its mantissa reads 2^23 + code


@triton.jit
def _half_to_f32(bits, x_ptr):
    """16-bit values of x_ptr's dtype, held in the low halves of int32 `bits`, as fp32."""
    if x_ptr.dtype.element_ty == tl.bfloat16:
        return (bits << 16).to(tl.float32, bitcast=True)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _x_of_words(x_ptr, cols):
    """x[8 * cols + p] for p = 0..7, in fp32: the activations the eight codes of words `cols` multiply.
    16-bit activations are read two per 32-bit load (34 -> 18 loads per iteration at 64 x 16 tiles)."""
    if x_ptr.dtype.element_ty.primitive_bitwidth == 16:
        xw = x_ptr.to(tl.pointer_type(tl.int32)) + 4 * cols
        x01 = tl.load(xw)
        x23 = tl.load(xw + 1)
        x45 = tl.load(xw + 2)
        x67 = tl.load(xw + 3)
        return (
            _half_to_f32(x01, x_ptr),
            _half_to_f32(x01 >> 16, x_ptr),
            _half_to_f32(x23, x_ptr),
            _half_to_f32(x23 >> 16, x_ptr),
            _half_to_f32(x45, x_ptr),
            _half_to_f32(x45 >> 16, x_ptr),
            _half_to_f32(x67, x_ptr),
            _half_to_f32(x67 >> 16, x_ptr),
        )
    xp = x_ptr + 8 * cols
    return (
        tl.load(xp).to(tl.float32),
        tl.load(xp + 1).to(tl.float32),
        tl.load(xp + 2).to(tl.float32),
        tl.load(xp + 3).to(tl.float32),
        tl.load(xp + 4).to(tl.float32),
        tl.load(xp + 5).to(tl.float32),
        tl.load(xp + 6).to(tl.float32),
        tl.load(xp + 7).to(tl.float32),
    )


@triton.jit
def _row_epilogue(
    acc2d,
    b_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    rn,
    n_ok,
    pid_n,
    pid_k,
    N,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BN: tl.constexpr,
):
    """Sum the [BLOCK_N, BLOCK_W] accumulator over its words and hand the row to the GEMV epilogue."""
    rm = tl.arange(0, 1)
    split_k_epilogue(
        tl.sum(acc2d, axis=1)[None, :],
        b_ptr,
        y_ptr,
        ws_ptr,
        counter_ptr,
        rm,
        rn,
        rm < 1,
        n_ok,
        pid_n,
        pid_k,
        N,
        0,
        HAS_BIAS,
        SPLIT_K,
        1,
        BN,
    )


@triton.jit
def group_scale_and_zero(s_rows, z_rows, g, n_ok, ZERO_POINT: tl.constexpr, ZERO_MODE: tl.constexpr):
    """Group g's scale and zero point of each row, in fp32 (the zero point a tensor's or a constant)."""
    s = tl.load(s_rows + g, mask=n_ok, other=0.0).to(tl.float32)
    if ZERO_MODE == 1:
        z = tl.load(z_rows + g, mask=n_ok, other=0).to(tl.float32)
    else:
        z = tl.zeros(s.shape, dtype=tl.float32) + ZERO_POINT
    return s, z


@triton.jit
def decode_tile_dot(words, xs, z, exponent):
    """[BLOCK_N, BLOCK_W] sums over the eight codes of each word of (q - z) * x, in fp32: `xs` the eight
    activations of each word (`_x_of_words`), z the rows' zero points, `exponent` FLOAT_2_23_BITS.

    q - z = f * 16^-p - (2^(23 - 4p) + z) for the nibble at position p of its (shifted) word, exactly."""
    z0 = (z + 8388608.0)[:, None]
    z1 = (z + 524288.0)[:, None]
    z2 = (z + 32768.0)[:, None]
    z3 = (z + 2048.0)[:, None]
    z4 = (z + 128.0)[:, None]
    hi = words >> 12
    x0, x1, x2, x3, x4, x5, x6, x7 = xs
    part = (((words & 0xF) | exponent).to(tl.float32, bitcast=True) - z0) * x0[None, :]
    d = ((words & 0xF0) | exponent).to(tl.float32, bitcast=True) * 0.0625 - z1
    part += d * x1[None, :]
    d = ((words & 0xF00) | exponent).to(tl.float32, bitcast=True) * 0.00390625 - z2
    part += d * x2[None, :]
    d = ((hi & 0xF) | exponent).to(tl.float32, bitcast=True) - z0
    part += d * x3[None, :]
    d = ((hi & 0xF0) | exponent).to(tl.float32, bitcast=True) * 0.0625 - z1
    part += d * x4[None, :]
    d = ((hi & 0xF00) | exponent).to(tl.float32, bitcast=True) * 0.00390625 - z2
    part += d * x5[None, :]
    d = ((hi & 0xF000) | exponent).to(tl.float32, bitcast=True) * 0.000244140625 - z3
    part += d * x6[None, :]
    d = ((hi & 0xF0000) | exponent).to(tl.float32, bitcast=True) * 0.0000152587890625 - z4
    return part + d * x7[None, :]


@triton.jit
def row_split(
    qw_ptr,
    s_ptr,
    z_ptr,
    N,
    KW,
    stride_qn,
    stride_sn,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W,
    GATED: tl.constexpr = False,
):
    """A program's rows and its range of K words [j_start, j_end) (splits of whole tiles), and the row
    pointers of the codes ([BLOCK_N, 1]), scales and zero points ([BLOCK_N]). GATED (a [gate | up] weight
    of N rows): the tile's first half are gate rows, its second half the up rows of the same outputs."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if GATED:
        rn, n_ok = gated_rows(pid_n, N, BLOCK_N)
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
    w_per_split = tl.cdiv(tl.cdiv(KW, SPLIT_K), BLOCK_W) * BLOCK_W
    j_start = pid_k * w_per_split
    j_end = tl.minimum(j_start + w_per_split, KW)
    rn64 = rn.to(tl.int64)
    q_rows = qw_ptr + rn64[:, None] * stride_qn
    s_rows = s_ptr + rn64 * stride_sn
    return pid_n, pid_k, rn, n_ok, j_start, j_end, q_rows, s_rows, z_ptr + rn64 * stride_sn


@triton.jit
def _w4_row_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    N,
    KW,
    stride_qn,
    stride_sn,
    exponent,
    ZERO_POINT: tl.constexpr,
    ZERO_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """y[0, n] = sum_k (q[n, k] - z[n, g]) * s[n, g] * x[0, k] (+ b[n]), one group g per tile of K.

    z is an integer (a zero-point tensor or constant), so every `f * 16^-p - (2^(23 - 4p) + z)` is exact."""
    pid_n, pid_k, rn, n_ok, j_start, j_end, q_rows, s_rows, z_rows = row_split(
        qw_ptr, s_ptr, z_ptr, N, KW, stride_qn, stride_sn, SPLIT_K, BLOCK_N, BLOCK_W
    )
    rj = tl.arange(0, BLOCK_W)
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    if PREFETCH:  # the next tile's load is issued before this tile's arithmetic: twice the bytes in flight
        words = tl.load(
            q_rows + (j_start + rj)[None, :], mask=n_ok[:, None] & (j_start + rj < j_end)[None, :], other=0
        )
    for j in tl.range(j_start, j_end, BLOCK_W, num_stages=LOOP_STAGES):
        g = j // BLOCK_W  # the tile is one group
        cols = j + rj
        if PREFETCH:
            nxt = j + BLOCK_W
            w_next = tl.load(
                q_rows + (nxt + rj)[None, :], mask=n_ok[:, None] & (nxt + rj < j_end)[None, :], other=0
            )
        else:
            words = tl.load(q_rows + cols[None, :], mask=n_ok[:, None], other=0)
        s, z = group_scale_and_zero(s_rows, z_rows, g, n_ok, ZERO_POINT, ZERO_MODE)
        part = decode_tile_dot(words, _x_of_words(x_ptr, cols), z, exponent)
        acc += s[:, None] * part
        if PREFETCH:
            words = w_next
    _row_epilogue(
        acc, b_ptr, y_ptr, ws_ptr, counter_ptr, rn, n_ok, pid_n, pid_k, N, HAS_BIAS, SPLIT_K, BLOCK_N
    )


@dataclass(frozen=True)
class RowGemvConfig:
    block_n: int
    block_k: int  # int32 words per row per tile: one group (16 words at group size 128)
    split_k: int
    num_warps: int = 4
    num_stages: int = 1  # the kernel option: pipelines only loads that feed a tl.dot, so none here
    prefetch: bool = False
    # >1: Triton software-pipelines the loop's loads through shared memory (cp.async), this many
    # iterations deep; 1 keeps plain loads (and `prefetch`'s register double buffer).
    loop_stages: int = 1
    # ptxas's register cap per thread (Triton's `maxnreg`), or None for its own choice: fewer registers
    # let more programs be resident, at the risk of spills (the f16x2 kernel only).
    max_registers: int | None = None


def default_w4_config(n: int, kw: int, group_words: int, num_sms: int) -> RowGemvConfig:
    """Launch shape for int4, from the H200 sweeps (CUDA-graph replays over L2-overflowing weight copies):
    64-row tiles one group deep; wide outputs (gate/up) split K in two, each half through a 3-deep
    software pipeline (37.7 us at the 7b gate/up against 39.1 for the whole K in one program; batch 1 338.9
    against 335.5 tok/s); narrow ones split K until about four programs per SM are streaming (16-way for a
    7b down projection)."""
    block_n = 64
    if n >= 16384:
        return RowGemvConfig(block_n, group_words, 2, loop_stages=3)
    split = split_k_for(triton.cdiv(n, block_n), kw // group_words, num_sms)
    return RowGemvConfig(block_n, group_words, split)


def _check_workspace(ws: GemvWorkspace, n: int, cfg: RowGemvConfig) -> int:
    tiles = triton.cdiv(n, cfg.block_n)
    ws.check(cfg.split_k, 1, n, tiles, cfg)
    return tiles


def row_input(x: torch.Tensor, weight: QuantizedWeight, align: int) -> torch.Tensor:
    """The row x [1, K] as the int4 row GEMVs read it: in the weight's stored K order (act-order weights
    gather it), contiguous, its start aligned to `align` bytes."""
    if weight.perm is not None:  # act-order: the weight's K is stored grouped; gather x to match
        x = x.index_select(1, weight.perm)
    x = x.contiguous()
    return x.clone() if x.data_ptr() % align else x


def weight_args(
    weight: QuantizedWeight, bias: torch.Tensor | None, y: torch.Tensor, ws: GemvWorkspace
) -> tuple[tuple, dict]:
    """The launch arguments the int4 row GEMV kernels share after x: codes, scales, zero points and bias
    (the scales stand in for absent ones), y, the split-K workspace, N, words per row and the two row
    strides; and the zero-point and bias constexprs."""
    n, k = weight.shape
    args = (
        weight.qweight,
        weight.scales,
        weight.zeros if weight.zeros is not None else weight.scales,  # a dummy for constant zero points
        bias if bias is not None else weight.scales,
        y,
        ws.partials,
        ws.counters,
        n,
        k // 8,
        weight.qweight.stride(0),
        weight.scales.stride(0),
    )
    meta = dict(
        ZERO_POINT=weight.zero_point,
        ZERO_MODE=ZERO_TENSOR if weight.zeros is not None else ZERO_CONST,
        HAS_BIAS=bias is not None,
    )
    return args, meta


def w4_row_supported(weight: QuantizedWeight) -> bool:
    """Whether `w4_row_gemv` takes this weight: int4 with integer zero points in groups of 64-256 (AWQ,
    GPTQ, RTN int4). GGUF's Q4_K (mins, 32-element groups) stays on `qwick.kernels.w4a16`."""
    return weight.bits == 4 and weight.group_size in (64, 128, 256) and weight.mins is None


def w4_row_gemv(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    ws: GemvWorkspace,
    config: RowGemvConfig | None = None,
) -> torch.Tensor:
    """`x @ W.T + bias` for one row x [1, K] and an int4 `QuantizedWeight` (see `w4_row_supported`)."""
    n, k = weight.shape
    if x.shape != (1, k) or not w4_row_supported(weight):
        raise ValueError(f"w4_row_gemv needs x [1, {k}] and int4 groups of 64-256, got {weight.group_size}")
    x = row_input(x, weight, 4)  # 16-bit activations are read two per 32-bit load
    group_words = weight.group_size // 8
    cfg = config or default_w4_config(n, k // 8, group_words, ws.num_sms)
    if cfg.block_k != group_words:
        raise ValueError(f"the tile must be one group deep ({group_words} words), got {cfg.block_k}")
    tiles = _check_workspace(ws, n, cfg)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    args, meta = weight_args(weight, bias, y, ws)
    _w4_row_kernel[(tiles, cfg.split_k)](
        x,
        *args,
        FLOAT_2_23_BITS,
        **meta,
        SPLIT_K=cfg.split_k,
        PREFETCH=cfg.prefetch,
        LOOP_STAGES=cfg.loop_stages,
        BLOCK_N=cfg.block_n,
        BLOCK_W=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y
