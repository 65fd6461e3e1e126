"""The batch-1 int4 GEMV in packed fp16 arithmetic (f16x2): half the instructions of `qwick.kernels.row_gemv`.

At batch 1 the fp32 row GEMV spends ~5 instructions per code and keeps too few warps resident to hide
their latency: Nsight Compute has it issue-bound at ~40 us on the qwen2.5-7b gate/up (1.7 TB/s of codes).
Here two codes become one f16x2 value in one `lop3`: `w & 0x000F000F | 0x64006400` reads as the pair
(1024 + q_0, 1024 + q_4), and `sub.f16x2` removes (1024 + z) exactly (small integers); the odd nibbles are
read in place, `w & 0x00F000F0 | 0x64006400` = (1024 + 16 q_1, 1024 + 16 q_5), and one `fma` by 1/16 with
-(64 + z) gives q - z; the word shifted by 8 gives q_2, q_6 and q_3, q_7 the same way. Each pair is then
multiplied by the matching pair of activations and accumulated (`fma.rn.f16x2`): 13 instructions per word
of eight codes (15 with three shifts, one per nibble pair: 412.2 against 417.2 tok/s of batch-1 int4
decode on the H200, ninth session of 12-01). Four words (32 products) are summed in fp16, then in fp32,
and scaled by their group's scale in fp32.

Tiles are 32 words (256 codes) of each of 32 rows, several groups wide: per-iteration costs (scale loads,
loop control) halve against one-group tiles, and that is most of the gain (the f16x2 decoding alone, at
one-group tiles, measured no faster). On the H200 at the qwen2.5-7b shapes this kernel took 57.2 us per
layer against the fp32 kernel's 74.3 (gate/up 27.6 against 37.4) in 64-row tiles, and batch-1 int4 decode
ran 403-405 tok/s against 338 (`benchmarks/int4_half2_sweep.py`; seventh session of 12-01 in
BENCHMARKS.md). 32-row tiles (31st session) hold 53 registers a thread against 96, so about twice as many
warps stay resident (achieved occupancy 50% against 26% at gate/up): 48.1-48.6 us per layer against 51.6,
and batch-1 int4 decode 500.2-500.4 tok/s against 473.2-473.3.

The activations are read as they are (bf16 or fp16) and turned into the pairs the `fma`s need in registers,
once per quad of words per thread (`XPAIRS_*`: unpack, scale by 1/64, `cvt.rn.f16x2.f32`), so the GEMV
needs no preparatory launch. The 1/64 (`X_DIV`) keeps 32 products of up to 15 |x| / 64 below fp16's 65504
for |x| up to ~8,700; an fp16 sum of 32 products carries ~1e-3 relative error (measured: the same error
against float64 as the fp32 kernel, 1.7e-3, dominated by rounding the output to bf16).

Two variants fold the next small kernel into the launch (33rd session; on in the engine at batch 1 since
the 35th and 36th):
`w4_half2_gated` writes silu(gate) * up of the packed gate/up projection from each tile's epilogue (a tile
holds gate rows and the matching up rows), and `w4_half2_normed` ends with the residual add + RMSNorm of
the output, run by the launch's last program to finish (`elementwise.rms_norm_tail`).

A launch can start before the kernel before it has ended (programmatic dependent launch,
`qwick.kernels.pdl`): with `preload` its programs load their split's first tiles (all of them where a split
holds at most two, `preload_fits`: the 7b QKV and o projections) before they wait for that kernel; with
`trigger` it lets the next kernel in once each of its programs is past its loop, with only the epilogues,
the split-K sums and a norm tail left. In the engine the QKV and o GEMVs preload after the one-program
RMSNorm and decode attention (+2.1% and +1.8% at batch-1 int4 on an H100 in the 36th and 37th sessions),
and the QKV and down GEMVs trigger (`PackedLinearMethod.pdl_norm`: +2.0-2.2% on H100s, 38th). In the MLP
chain (`PackedLinearMethod.pdl_mlp` and `pdl_down`) o lets gate/up in and gate/up lets down in: with
triggers at the launch's start it lost 5-6% on an H100 (37th); with them after the loops it gained 1.8%
on an H200 and lost 7-11% on H100s (38th, 41st), then gained 2.5-2.7% on an H100 on top of the later
defaults (47th, on since).

Under Triton's interpreter, which runs no PTX, the kernel computes the same products in fp32 (`EMULATE`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qwick.kernels.elementwise import rms_norm_tail, store_half_pairs
from qwick.kernels.gemv import GemvWorkspace, gated_store
from qwick.kernels.half2 import EMULATE, split4, sum_halves_asm
from qwick.kernels.pdl import pdl_supported, pdl_trigger, pdl_wait
from qwick.kernels.row_gemv import (
    RowGemvConfig,
    _check_workspace,
    _row_epilogue,
    row_input,
    row_split,
    w4_row_supported,
    weight_args,
)
from qwick.layers.linear import HalfPairs, NormAfter, PairedRows
from qwick.quantization.formats.layout import QuantizedWeight

X_DIV = 64.0
_X_DIV = tl.constexpr(X_DIV)
TILE_WORDS = 32  # 256 codes of a row per tile


def _dot4_asm() -> str:
    """PTX: four words ($1-$4), their 16 activation pairs ($5 + 4 * word + p), the row's f16x2
    (1024 + z, 1024 + z) ($21) and -(64 + z, 64 + z) ($22) -> the fp32 sum of the 32 products ($0).
    Pair p of a word is nibbles (p, p + 4): p even from the low nibble of a byte, p odd from the high one
    (kept in place, scaled by 1/16), p >= 2 from the word shifted by 8."""
    lines = ["{", ".reg .b32 t, v, d, acc, s16;", ".reg .b16 lo, hi;", ".reg .f32 fa, fb;", "mov.b32 acc, 0;"]
    lines.append("mov.b32 s16, 0x2C002C00;")  # (1/16, 1/16) in fp16
    for k in range(4):
        for p in range(4):
            src = f"${1 + k}"
            if p == 2:
                lines.append(f"shr.u32 t, {src}, 8;")
            src = "t" if p >= 2 else src
            mask = "0x00F000F0" if p % 2 else "0x000F000F"
            lines.append(f"lop3.b32 v, {src}, {mask}, 0x64006400, 0xEA;")  # (a & b) | c
            if p % 2:
                lines.append("fma.rn.f16x2 d, v, s16, $22;")  # (1024 + 16 q) / 16 - (64 + z) = q - z
            else:
                lines.append("sub.f16x2 d, v, $21;")
            lines.append(f"fma.rn.f16x2 acc, d, ${5 + 4 * k + p}, acc;")
    lines += [*sum_halves_asm(), "}"]
    return "\n".join(lines)


def _xpairs_bf16_asm() -> str:
    """PTX: the eight bf16 activations of one word of codes, two per input ($4-$7: x0x1, x2x3, x4x5, x6x7)
    -> the four f16x2 pairs (x_p, x_{p+4}) / X_DIV ($0-$3, x_p in the low half)."""
    lines = ["{", ".reg .b32 v<8>;"]
    for i in range(4):
        lines.append(f"shl.b32 v{2 * i}, ${4 + i}, 16;")
        lines.append(f"and.b32 v{2 * i + 1}, ${4 + i}, 0xFFFF0000;")
    for i in range(8):
        lines.append(f"mul.f32 v{i}, v{i}, 0f3C800000;")  # 1 / 64
    for p in range(4):
        lines.append(f"cvt.rn.f16x2.f32 ${p}, v{p + 4}, v{p};")  # (high, low)
    lines.append("}")
    return "\n".join(lines)


def _xpairs_f16_asm() -> str:
    """PTX: as `_xpairs_bf16_asm` for fp16 activations: bytes permuted into pairs, then one f16x2 multiply."""
    lines = ["{", ".reg .b32 t, scale;", "mov.b32 scale, 0x24002400;"]  # (1/64, 1/64)
    for p in range(4):
        lo, hi = f"${4 + p // 2}", f"${6 + p // 2}"  # x_p and x_{p+4}: the same half of words 0/1 and 2/3
        lines.append(f"prmt.b32 t, {lo}, {hi}, {'0x5410' if p % 2 == 0 else '0x7632'};")
        lines.append(f"mul.rn.f16x2 ${p}, t, scale;")
    lines.append("}")
    return "\n".join(lines)


DOT4_ASM = _dot4_asm()
XPAIRS_BF16_ASM = _xpairs_bf16_asm()
XPAIRS_F16_ASM = _xpairs_f16_asm()
PAIRED = tl.constexpr("paired")  # XPAIRS when x is already the pairs (`HalfPairs`), not 16-bit values


@triton.jit
def _words_pairs(d):
    """[C, 4] pairs of one shift (one per word of each quad) -> four [1, C] (word 0..3)."""
    C: tl.constexpr = d.shape[0]
    w0, w1, w2, w3 = split4(d.reshape(C, 2, 2))
    return w0[None, :], w1[None, :], w2[None, :], w3[None, :]


@triton.jit
def _f16_bits(v):
    """fp32 values rounded to fp16, their bits in the low half of an int32."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _tile_dot_half2(words, x_ptr, cols, z, XPAIRS: tl.constexpr, DOT4: tl.constexpr):
    """[BLOCK_N, C] sums of 32 products (q - z) * x / X_DIV, four words of a row (a quad) per element.
    words [BLOCK_N, 4 * C], cols [C, 4] their word indices, z [BLOCK_N, C] the zero points; x_ptr the
    16-bit activations, which XPAIRS turns into the f16x2 pairs (x_p, x_{p+4}) / X_DIV of each word."""
    C: tl.constexpr = cols.shape[0]
    xw = x_ptr.to(tl.pointer_type(tl.int32)) + 4 * cols  # two activations per int32, four int32 per word
    xs = tl.load(xw[:, :, None] + tl.arange(0, 4)[None, None, :])  # [C, word, 4]
    a0, a1, a2, a3 = split4(xs.reshape(C, 4, 2, 2))  # [C, word]: x0x1, x2x3, x4x5, x6x7 (or the pairs)
    if XPAIRS == PAIRED:  # x_ptr holds the `HalfPairs` operand: the words' pairs, made by x's producer
        d0, d1, d2, d3 = a0, a1, a2, a3
    else:
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            XPAIRS, "=r,=r,=r,=r,r,r,r,r", [a0, a1, a2, a3], dtype=(tl.int32,) * 4, is_pure=True, pack=1
        )  # [C, word] per shift
    x00, x10, x20, x30 = _words_pairs(d0)  # x{word}{shift}
    x01, x11, x21, x31 = _words_pairs(d1)
    x02, x12, x22, x32 = _words_pairs(d2)
    x03, x13, x23, x33 = _words_pairs(d3)
    BLOCK_N: tl.constexpr = words.shape[0]
    w0, w1, w2, w3 = split4(words.reshape(BLOCK_N, C, 2, 2))
    zh = _f16_bits(z + 1024.0)
    nz = _f16_bits(-(z + 64.0))
    return tl.inline_asm_elementwise(
        DOT4,
        "=r" + ",r" * 22,
        [w0, w1, w2, w3,
         x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33,
         zh | (zh << 16), nz | (nz << 16)],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )  # fmt: skip


@triton.jit
def _tile_dot_emulated(words, x_ptr, cols, z, IS_PAIRED: tl.constexpr):
    """What `_tile_dot_half2` computes, in fp32 Triton arithmetic (for the interpreter)."""
    C: tl.constexpr = cols.shape[0]
    BLOCK_N: tl.constexpr = words.shape[0]
    ws = split4(words.reshape(BLOCK_N, C, 2, 2))
    wcols = split4(cols.reshape(C, 2, 2))
    part = tl.zeros((BLOCK_N, C), tl.float32)
    for k in tl.static_range(4):
        for p in tl.static_range(8):
            if IS_PAIRED:  # x_p / X_DIV in fp16: half p // 4 of int32 4 * word + p % 4
                pair = tl.load(x_ptr + 4 * wcols[k] + p % 4)
                half = ((pair >> (16 * (p // 4))) & 0xFFFF).to(tl.int16)
                x = half.to(tl.float16, bitcast=True).to(tl.float32)
            else:
                x = tl.load(x_ptr + 8 * wcols[k] + p).to(tl.float32) / _X_DIV
            q = ((ws[k] >> (4 * p)) & 0xF).to(tl.float32) - z
            part += q * x[None, :]
    return part


@triton.jit
def _tile_part(words, x_ptr, j, quad, z, XPAIRS: tl.constexpr, DOT4: tl.constexpr, EMULATE: tl.constexpr):
    """[BLOCK_N, C] unscaled sums of the tile at word j: `_tile_dot_half2`, or its emulation."""
    cols = j + quad[:, None] + tl.arange(0, 4)[None, :]  # [C, 4]: the words of each quad
    if EMULATE:
        part = _tile_dot_emulated(words, x_ptr, cols, z, XPAIRS == PAIRED)
    else:
        part = _tile_dot_half2(words, x_ptr, cols, z, XPAIRS, DOT4)
    return part


@triton.jit
def _tile_scales(
    s_rows, z_rows, j, n_ok, quad, ZERO_POINT, ZERO_MODE, GROUP_W: tl.constexpr, BLOCK_W: tl.constexpr
):
    """[BLOCK_N, C] scale and zero point of each row and quad of the tile at word j, loaded one group at a
    time as [BLOCK_N] vectors (a [BLOCK_N, C] gather would set the layout of the whole tile)."""
    QUADS: tl.constexpr = GROUP_W // 4 if GROUP_W < BLOCK_W else BLOCK_W // 4  # quads per group in the tile
    s = tl.zeros((n_ok.shape[0], quad.shape[0]), dtype=tl.float32)
    z = tl.zeros((n_ok.shape[0], quad.shape[0]), dtype=tl.float32) + ZERO_POINT
    for i in tl.static_range(BLOCK_W // 4 // QUADS):
        g = (j + 4 * QUADS * i) // GROUP_W
        here = (quad // (4 * QUADS) == i)[None, :]
        s = tl.where(here, tl.load(s_rows + g, mask=n_ok, other=0.0).to(tl.float32)[:, None], s)
        if ZERO_MODE == 1:
            z = tl.where(here, tl.load(z_rows + g, mask=n_ok, other=0).to(tl.float32)[:, None], z)
    return s, z


@triton.jit
def _w4_half2_kernel(
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
    p_ptr,
    res_ptr,
    nw_ptr,
    nout_ptr,
    tail_ptr,
    eps,
    ZERO_POINT: tl.constexpr,
    ZERO_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    XPAIRS: tl.constexpr,
    DOT4: tl.constexpr,
    EMULATE: tl.constexpr,
    PREFETCH: tl.constexpr,
    GATED: tl.constexpr,
    OUT_PAIRS: tl.constexpr,
    OUT_INV_DIV: tl.constexpr,
    NORM_TAIL: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    PRELOAD: tl.constexpr,
    PRELOAD_ALL: tl.constexpr,
    TRIGGER: tl.constexpr,
    TRIGGER_START: tl.constexpr,
):
    """y[0, n] = sum_k (q[n, k] - z[n, g]) * s[n, g] * x[0, k] (+ b[n]); tiles of BLOCK_W words of
    BLOCK_N rows, handled a quad of words (32 codes, inside one group) at a time. KW is a multiple of
    BLOCK_W, so only rows are masked (and the loads stay 16 bytes wide). GATED: y [1, N / 2] is
    silu(gate) * up of a [gate | up] weight instead (`_gated_epilogue`; one split), and with OUT_PAIRS
    also its `HalfPairs` at p_ptr. NORM_TAIL: then the residual add + RMSNorm of y (`rms_norm_tail`:
    res_ptr updated, the normalized row to nout_ptr and with OUT_PAIRS its `HalfPairs` to p_ptr)."""
    if TRIGGER_START and not EMULATE:  # (TRIGGER at the program's start: `w4_half2_gemv`)
        pdl_trigger()
    C: tl.constexpr = BLOCK_W // 4
    pid_n, pid_k, rn, n_ok, j_start, j_end, q_rows, s_rows, z_rows = row_split(
        qw_ptr, s_ptr, z_ptr, N, KW, stride_qn, stride_sn, SPLIT_K, BLOCK_N, BLOCK_W, GATED
    )
    quad = tl.arange(0, C) * 4
    rw = tl.arange(0, BLOCK_W)
    acc = tl.zeros((BLOCK_N, C), dtype=tl.float32)
    if PREFETCH:
        # Two tiles in flight, A and B alternating: each is loaded (codes, scales, zero points) before the
        # other's arithmetic. (A single carried prefetch is sunk by ptxas to the loop's end, where it
        # overlaps nothing.) Past the split's end B is the last tile again, with its scales zeroed.
        # PRELOAD: the first A tile is loaded before `pdl_wait`.
        work = n_ok & (rn * 0 + j_start < j_end)  # no load for a split without tiles
        last = j_end - BLOCK_W
        words_a = tl.load(q_rows + (j_start + rw)[None, :], mask=work[:, None], other=0)
        s_a, z_a = _tile_scales(s_rows, z_rows, j_start, work, quad, ZERO_POINT, ZERO_MODE, GROUP_W, BLOCK_W)
        if PRELOAD and not EMULATE:
            pdl_wait()
        for j in tl.range(j_start, j_end, 2 * BLOCK_W):
            jb = tl.minimum(j + BLOCK_W, last)
            words_b = tl.load(q_rows + (jb + rw)[None, :], mask=n_ok[:, None], other=0)
            s_b, z_b = _tile_scales(s_rows, z_rows, jb, n_ok, quad, ZERO_POINT, ZERO_MODE, GROUP_W, BLOCK_W)
            s_b = tl.where(j + BLOCK_W < j_end, s_b, 0.0)
            acc += s_a * _tile_part(words_a, x_ptr, j, quad, z_a, XPAIRS, DOT4, EMULATE)
            ja = tl.minimum(j + 2 * BLOCK_W, last)
            words_a = tl.load(q_rows + (ja + rw)[None, :], mask=n_ok[:, None], other=0)
            s_a, z_a = _tile_scales(s_rows, z_rows, ja, n_ok, quad, ZERO_POINT, ZERO_MODE, GROUP_W, BLOCK_W)
            acc += s_b * _tile_part(words_b, x_ptr, jb, quad, z_b, XPAIRS, DOT4, EMULATE)
    else:
        j_loop = j_start
        if PRELOAD:
            # Launched early (`qwick.kernels.pdl`): the split's first two tiles and their scales are loaded
            # while the kernel before still runs, then `pdl_wait`; x and every buffer after it, and the
            # loop for the rest. A tile past the split's end (or both, for a split without tiles) reads
            # the last tile's x with its scales zeroed, so the sums are the loop's, in its order.
            last = KW - BLOCK_W
            ok_a = n_ok & (rn * 0 + j_start < j_end)
            ok_b = n_ok & (rn * 0 + j_start + BLOCK_W < j_end)
            ja = tl.minimum(j_start, last)
            jb = tl.minimum(j_start + BLOCK_W, last)
            words_a = tl.load(q_rows + (ja + rw)[None, :], mask=ok_a[:, None], other=0)
            s_a, z_a = _tile_scales(s_rows, z_rows, ja, ok_a, quad, ZERO_POINT, ZERO_MODE, GROUP_W, BLOCK_W)
            words_b = tl.load(q_rows + (jb + rw)[None, :], mask=ok_b[:, None], other=0)
            s_b, z_b = _tile_scales(s_rows, z_rows, jb, ok_b, quad, ZERO_POINT, ZERO_MODE, GROUP_W, BLOCK_W)
            if not EMULATE:
                pdl_wait()
            acc += s_a * _tile_part(words_a, x_ptr, ja, quad, z_a, XPAIRS, DOT4, EMULATE)
            acc += s_b * _tile_part(words_b, x_ptr, jb, quad, z_b, XPAIRS, DOT4, EMULATE)
            j_loop = j_start + 2 * BLOCK_W
        if not PRELOAD_ALL:
            # PRELOAD_ALL (`preload_fits`: no split holds more than the two preloaded tiles) emits no loop:
            # an empty one after the preload ran 1.5% slower at batch-1 int4 on an H100 (37th session).
            for j in tl.range(j_loop, j_end, BLOCK_W):
                words = tl.load(q_rows + (j + rw)[None, :], mask=n_ok[:, None], other=0)
                s, z = _tile_scales(s_rows, z_rows, j, n_ok, quad, ZERO_POINT, ZERO_MODE, GROUP_W, BLOCK_W)
                acc += s * _tile_part(words, x_ptr, j, quad, z, XPAIRS, DOT4, EMULATE)
    if TRIGGER and not TRIGGER_START and not EMULATE:  # the next kernel may launch once every program is
        pdl_trigger()  # past its loop
    acc *= _X_DIV
    if GATED:
        _gated_epilogue(
            acc, b_ptr, y_ptr, p_ptr, rn, n_ok, pid_n, N, HAS_BIAS, OUT_PAIRS, OUT_INV_DIV, BLOCK_N
        )
    else:
        _row_epilogue(
            acc, b_ptr, y_ptr, ws_ptr, counter_ptr, rn, n_ok, pid_n, pid_k, N, HAS_BIAS, SPLIT_K, BLOCK_N
        )
        if NORM_TAIL:
            rms_norm_tail(
                y_ptr, res_ptr, nw_ptr, nout_ptr, p_ptr, tail_ptr, N, eps, OUT_PAIRS, OUT_INV_DIV, NORM_BLOCK
            )


@triton.jit
def _gated_epilogue(
    acc2d,
    b_ptr,
    y_ptr,
    p_ptr,
    rn,
    n_ok,
    pid_n,
    N,
    HAS_BIAS: tl.constexpr,
    OUT_PAIRS: tl.constexpr,
    OUT_INV_DIV: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A whole-K tile of `gated_rows`: `gemv.gated_store` of its one row (silu(gate) * up as
    `silu_and_mul` computes it, bit for bit), and with OUT_PAIRS the outputs' `HalfPairs`."""
    rm = tl.arange(0, 1)
    y = tl.sum(acc2d, axis=1)[None, :]
    act = gated_store(y, b_ptr, y_ptr, rm, rn, rm < 1, n_ok, pid_n, N, 0, HAS_BIAS, 1, BLOCK_N)
    if OUT_PAIRS:
        HALF: tl.constexpr = BLOCK_N // 2
        store_half_pairs(tl.reshape(act, (HALF,)), p_ptr, pid_n * (HALF // 8), N // 16, OUT_INV_DIV, HALF)


def half_pairs(x: torch.Tensor) -> torch.Tensor:
    """x [1, K] -> its `HalfPairs` operand, int32 [1, K / 2], in torch: per word w the fp16 pairs
    (x[8w + p], x[8w + p + 4]) / X_DIV, p = 0-3 (x_p in the low half), as RMSNorm and SiLU-and-mul write it
    in decode. For benchmarks and tests that feed `w4_half2_gemv(..., pairs=)` without a producer."""
    h = (x.float() / X_DIV).to(torch.float16).view(-1, 2, 4)  # [word, half, p]
    return h.transpose(1, 2).contiguous().view(torch.int32).view(1, -1)


def w4_half2_supported(weight: QuantizedWeight, x: torch.Tensor) -> bool:
    """Whether `w4_half2_gemv` takes this product: `w4_row_supported` weights and 16-bit activations."""
    return w4_row_supported(weight) and x.dtype in (torch.bfloat16, torch.float16)


def tile_words_for(kw: int) -> int:
    """The widest tile (32, 16 or 8 words) that divides a row: then no column needs a mask."""
    return next(w for w in (TILE_WORDS, 16, 8) if kw % w == 0)


def default_half2_config(n: int, kw: int, num_sms: int) -> RowGemvConfig:
    """32 rows x 32 words per tile, 4 warps; K split (doubling) while the doubled grid stays within 12
    programs per SM, down to one tile of K per split. From the H200 sweep with the producer's pairs
    (`TILE_WORDS=32 python benchmarks/int4_half2_sweep.py`, 31st session in BENCHMARKS.md) at the
    qwen2.5-7b shapes: split 1 for gate/up (22.7-23.3 us against 23.9-24.0 at 64-row tiles), 8 for qkv (5.9
    against 6.0; 6.7 at split 4), o (5.4 against 5.7) and down (14.1 against 15.9; 15.0 at split 16).

    Two shapes launch differently, from the same sweep (32nd session: batch-1 int4 505.1 and 504.8 tok/s
    against 502.1 and 502.6): a long K (past 8192, the down projection) in 2 warps with the two-tile
    prefetch (13.7 us against 14.1), and an output no wider than K (the o projection) in 64-row tiles of 8
    warps (5.3 against 5.5), each keeping the split above. Both were measured at the 7b shapes only; other
    models' o and down projections take them by the same shape rule."""
    block_n, block_w = 32, tile_words_for(kw)
    tiles, k_tiles, split = triton.cdiv(n, block_n), kw // block_w, 1
    while tiles * split * 2 <= 12 * num_sms and k_tiles >= 2 * split:
        split *= 2
    if 8 * kw > 8192:
        return RowGemvConfig(block_n, block_w, split, num_warps=2, prefetch=True)
    if n <= 8 * kw:
        return RowGemvConfig(64, block_w, split, num_warps=8)
    return RowGemvConfig(block_n, block_w, split)


def w4_half2_gemv(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    ws: GemvWorkspace,
    config: RowGemvConfig | None = None,
    pairs: torch.Tensor | None = None,
    preload: bool = False,
    trigger: bool = False,
    trigger_at_start: bool = False,
) -> torch.Tensor:
    """`x @ W.T + bias` for one row x [1, K] of bf16/fp16 activations and an int4 `QuantizedWeight`
    (`w4_half2_supported`), in f16x2 arithmetic (see the module docstring). `pairs`: x's `HalfPairs`
    operand (int32 [1, K / 2], `X_DIV`), read instead of x (weights without an act-order permutation).
    `preload`: its programs load their split's first two tiles (one with the prefetch) before they wait
    for the kernel before, and the launch is a programmatic dependent one where the device has it
    (`qwick.kernels.pdl`); `trigger`: the next kernel may launch once this one's programs are past their
    loops (with `trigger_at_start`, once they have started). The same sums either way."""
    return _launch(
        x, weight, bias, ws, config, pairs, gated=False, out_pairs=None, preload=preload, trigger=trigger,
        trigger_at_start=trigger_at_start,
    )  # fmt: skip


def normed_half2_config(n: int, kw: int, num_sms: int) -> RowGemvConfig | None:
    """The launch of `w4_half2_normed`: `default_half2_config`'s, when its last program normalizes the row
    (`rms_norm_tail`) in at most 16 values a thread; None otherwise. The kernel holds up to 64 (compiled
    for sm_90 no more registers than the plain GEMV, `benchmarks/ptx_counts.py half2`), but the tail runs
    alone after every other program: on an H100 at 7b shapes, int4 batch 1 (gated gate/up) made 444.3
    and 444.6 tok/s with the o projection's norm in its tail (8 warps, 16 values) against 442.0 and
    441.8 without, and 438.1-438.5 with the down projection's too (2 warps, 64 values). After the fix of
    the tail's pairs (a barrier, then the pairs from the stored row): 442.95 and 442.56 against 442.02 and
    442.07 (36th session)."""
    cfg = default_half2_config(n, kw, num_sms)
    return cfg if cfg.num_warps * 32 * 16 >= triton.next_power_of_2(n) else None


def w4_half2_normed(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    ws: GemvWorkspace,
    norm: NormAfter,
    config: RowGemvConfig | None = None,
    pairs: torch.Tensor | None = None,
    preload: bool = False,
    trigger: bool = False,
) -> torch.Tensor | PairedRows:
    """`norm` (residual add + RMSNorm, `NormAfter`) of `x @ W.T + bias` in the GEMV's own launch: its last
    program to finish normalizes the row (`rms_norm_tail`), so the norm needs no launch of its own.
    `norm.residual` [1, N] is updated in place; the result is the normalized row, with its `HalfPairs` (a
    `PairedRows`) if `norm.quant` asks for them (codes are not written here). The same values as
    `rms_norm(w4_half2_gemv(...), ...)` up to the order of the row's sum of squares. `config` (default
    `normed_half2_config`), `pairs`, `preload` and `trigger` as in `w4_half2_gemv`."""
    n = weight.shape[0]
    cfg = config or normed_half2_config(n, weight.shape[1] // 8, ws.num_sms)
    if cfg is None or norm.residual.shape != (1, n) or not norm.residual.is_contiguous():
        raise ValueError(
            f"w4_half2_normed needs a contiguous [1, {n}] residual and a launch for it, got {cfg}"
        )
    if norm.quant is not None and not isinstance(norm.quant, HalfPairs):
        raise ValueError(f"the norm tail writes HalfPairs or nothing, not {norm.quant}")
    return _launch(
        x, weight, bias, ws, cfg, pairs, False, norm.quant, norm=norm, preload=preload, trigger=trigger
    )


def preload_fits(cfg: RowGemvConfig, kw: int) -> bool:
    """Whether `cfg`'s splits of a row of kw words hold at most two tiles each, and it neither prefetches
    nor pipelines: then `preload` loads all of its weights before the wait."""
    per_split = triton.cdiv(triton.cdiv(kw, cfg.split_k), cfg.block_k)
    return per_split <= 2 and not cfg.prefetch and cfg.loop_stages == 1


def gated_half2_config(n: int, kw: int, num_sms: int) -> RowGemvConfig | None:
    """The launch of `w4_half2_gated` for a [gate | up] weight of n rows: `default_half2_config`'s (the
    same grid: each tile is half gate rows, half up rows), when that has a single split, which the gated
    epilogue needs (the qwen2.5-7b and 14b gate/up projections); None otherwise."""
    cfg = default_half2_config(n, kw, num_sms)
    return cfg if cfg.split_k == 1 and n % 16 == 0 else None


def w4_half2_gated(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    ws: GemvWorkspace,
    config: RowGemvConfig | None = None,
    pairs: torch.Tensor | None = None,
    out_pairs: HalfPairs | None = None,
    preload: bool = False,
    trigger: bool = False,
) -> torch.Tensor | PairedRows:
    """silu(gate) * up for one row x [1, K] and a [gate | up] int4 weight [2I, K] (the packed gate/up
    projection), in the GEMV's own launch: each tile holds gate rows and the up rows of the same outputs,
    so SiLU-and-mul needs no launch of its own. The same bits as `silu_and_mul(w4_half2_gemv(...))`.
    `config` (one split; default `gated_half2_config`), `pairs`, `preload` and `trigger` as in
    `w4_half2_gemv`; `out_pairs`: the output's `HalfPairs` too (a `PairedRows`), as `silu_and_mul` writes
    them for the down projection."""
    n, k = weight.shape
    cfg = config or gated_half2_config(n, k // 8, ws.num_sms)
    if cfg is None or cfg.split_k != 1 or cfg.block_n % 16 or n % 16:
        raise ValueError(
            f"w4_half2_gated needs one split, tiles of 16k rows and an even [gate | up] weight of 16k rows, "
            f"got {cfg} for N={n}"
        )
    return _launch(x, weight, bias, ws, cfg, pairs, True, out_pairs, preload=preload, trigger=trigger)


def _launch(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    ws: GemvWorkspace,
    config: RowGemvConfig | None,
    pairs: torch.Tensor | None,
    gated: bool,
    out_pairs: HalfPairs | None,
    norm: NormAfter | None = None,
    preload: bool = False,
    trigger: bool = False,
    trigger_at_start: bool = False,
) -> torch.Tensor | PairedRows:
    n, k = weight.shape
    if x.shape != (1, k) or not w4_half2_supported(weight, x):
        raise ValueError(
            f"w4_half2_gemv needs x [1, {k}] in bf16/fp16 and int4 groups of 64-256, got x {tuple(x.shape)} "
            f"{x.dtype}, group {weight.group_size}"
        )
    if pairs is not None:
        if pairs.shape != (1, k // 2) or pairs.dtype != torch.int32 or weight.perm is not None:
            raise ValueError(f"pairs must be int32 [1, {k // 2}] for a weight without act-order")
        x_dtype, x = x.dtype, pairs.contiguous()
        x = x.clone() if x.data_ptr() % 16 else x
    else:
        x_dtype, x = x.dtype, row_input(x, weight, 16)  # read four int32 at a time
    kw = k // 8
    group_words = weight.group_size // 8
    cfg = config or default_half2_config(n, kw, ws.num_sms)
    if kw % cfg.block_k or cfg.block_k % 4 or (cfg.block_k % group_words and group_words % cfg.block_k):
        raise ValueError(f"tiles of {cfg.block_k} words do not fit rows of {kw} in groups of {group_words}")
    tiles = _check_workspace(ws, n, cfg)
    y = torch.empty((1, n // 2 if gated else n), dtype=x_dtype, device=x.device)
    p = torch.empty((1, y.shape[1] // 2), dtype=torch.int32, device=x.device) if out_pairs is not None else y
    out = torch.empty_like(y) if norm is not None else y  # the normalized row (y is its input then)
    tail = (
        (norm.residual, norm.weight, out, ws.tail_counter, norm.eps)
        if norm is not None
        else (y, y, y, y, 0.0)
    )
    args, meta = weight_args(weight, bias, y, ws)
    if pairs is not None:
        xpairs = PAIRED
    else:
        xpairs = XPAIRS_BF16_ASM if x_dtype == torch.bfloat16 else XPAIRS_F16_ASM
    _w4_half2_kernel[(tiles, cfg.split_k)](
        x,
        *args,
        p,
        *tail,
        **meta,
        SPLIT_K=cfg.split_k,
        GROUP_W=group_words,
        BLOCK_N=cfg.block_n,
        BLOCK_W=cfg.block_k,
        XPAIRS=xpairs,
        DOT4=DOT4_ASM,
        EMULATE=EMULATE,
        PREFETCH=cfg.prefetch,
        GATED=gated,
        OUT_PAIRS=out_pairs is not None,
        OUT_INV_DIV=1.0 / out_pairs.x_div if out_pairs is not None else 1.0,
        NORM_TAIL=norm is not None,
        NORM_BLOCK=triton.next_power_of_2(n) if norm is not None else 1,
        PRELOAD=preload,
        PRELOAD_ALL=preload and preload_fits(cfg, kw),
        TRIGGER=trigger and pdl_supported(x.device),
        TRIGGER_START=trigger and trigger_at_start and pdl_supported(x.device),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
        **({"launch_pdl": True} if preload and pdl_supported(x.device) else {}),
    )
    return PairedRows(out, p) if out_pairs is not None else out
