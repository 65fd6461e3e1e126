"""The batch-1 int4 GEMV in packed fp16 arithmetic (f16x2): an experiment, off by default.

`qwick.kernels.row_gemv` decodes every code to fp32 and spends three instructions per code; Nsight Compute
has it bound by issuing instructions on the H200. Here two codes become one f16x2 value in one `lop3`:
`(w >> 4p) & 0x000F000F | 0x64006400` reads as (1024 + q_p, 1024 + q_{p+4}), so for the four shifts p of a
word, `sub.f16x2` removes (1024 + z) exactly (small integers), and `fma.rn.f16x2` multiplies by the matching
pair of activations and accumulates: 15 instructions per word of eight codes instead of ~25. Four words (32
products) are summed in fp16, then once in fp32, and scaled by the group's scale in fp32. The sm_90 SASS of a
64 x 16 tile has 272 instructions for the whole kernel against the row GEMV's 464.

The activations come as fp16 pairs in the nibbles' order (`half2_pairs`, one small launch per call),
divided by 64 (`X_DIV`): 32 products of up to 15 |x| / 64 stay below fp16's 65504 for |x| up to ~8,700, and
an fp16 sum of 32 products carries ~1e-3 relative error (measured 4.3e-4 against float64 in an emulation).

`PackedLinearMethod.decode_half2` routes batch-1 int4 decode here once the H200 has measured it
(`bash benchmarks/gpu_session.sh int4h2`). Under Triton's interpreter, which runs no PTX, the kernel computes
the same products in fp32 (`EMULATE`), so the CPU tests check everything but the PTX itself.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qwick.kernels.gemv import GemvWorkspace
from qwick.kernels.row_gemv import (
    RowGemvConfig,
    _check_workspace,
    _row_epilogue,
    default_w4_config,
    group_scale_and_zero,
    row_split,
    w4_row_supported,
    weight_args,
)
from qwick.quantization.formats.layout import QuantizedWeight

X_DIV = 64.0
# The interpreter runs no PTX: there the kernel computes the same products in fp32 (read once, as Triton
# itself reads the variable when the kernels are defined).
_EMULATE = os.environ.get("TRITON_INTERPRET") == "1"
_X_DIV = tl.constexpr(X_DIV)


def _dot4_asm() -> str:
    """PTX for one call: four words ($1-$4), their 16 activation pairs ($5 + 4 * word + shift), the row's
    f16x2 (1024 + z, 1024 + z) ($21) -> the fp32 sum of the 32 products ($0)."""
    lines = ["{", ".reg .b32 t, v, d, acc;", ".reg .b16 lo, hi;", ".reg .f32 fa, fb;", "mov.b32 acc, 0;"]
    for k in range(4):
        for p in range(4):
            src = f"${1 + k}"
            if p:
                lines.append(f"shr.u32 t, {src}, {4 * p};")
                src = "t"
            lines.append(f"lop3.b32 v, {src}, 0x000F000F, 0x64006400, 0xEA;")  # (a & b) | c
            lines.append("sub.f16x2 d, v, $21;")
            lines.append(f"fma.rn.f16x2 acc, d, ${5 + 4 * k + p}, acc;")
    lines += [
        "mov.b32 {lo, hi}, acc;",
        "cvt.f32.f16 fa, lo;",
        "cvt.f32.f16 fb, hi;",
        "add.f32 $0, fa, fb;",
        "}",
    ]
    return "\n".join(lines)


DOT4_ASM = _dot4_asm()


@triton.jit
def _f16_bits(v):
    """fp32 values rounded to fp16, their bits in the low half of an int32."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _half2_pairs_kernel(x_ptr, out_ptr, KW, BLOCK: tl.constexpr):
    """x [1, 8 * KW] -> int32 [KW, 4]: word w's pairs (x[8w + p], x[8w + p + 4]) / X_DIV in fp16, p = 0..3."""
    w = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = w < KW
    xs = tl.load(x_ptr + w[:, None] * 8 + tl.arange(0, 8)[None, :], mask=ok[:, None], other=0.0)
    xs = xs.to(tl.float32) * (1.0 / _X_DIV)
    lo, hi = tl.split(tl.permute(xs.reshape(BLOCK, 2, 4), (0, 2, 1)))  # [BLOCK, 4]: x[8w + p], x[8w + p + 4]
    bits = _f16_bits(lo) | (_f16_bits(hi) << 16)
    tl.store(out_ptr + w[:, None] * 4 + tl.arange(0, 4)[None, :], bits, mask=ok[:, None])


@triton.jit
def _split4(t):
    """A [..., 2, 2] tensor -> its four [...] slices, in the order of the flattened last two indices."""
    a, b = tl.split(t)  # last index 0 (flat 0, 2) / 1 (flat 1, 3)
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _half(bits):
    """The fp16 in the low 16 bits of int32 `bits`, as fp32."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dot4_emulated(ws, xs, z):
    """What DOT4_ASM computes, in fp32 Triton arithmetic (for the interpreter)."""
    part = tl.zeros(ws[0].shape, tl.float32)
    for k in tl.static_range(4):
        for p in tl.static_range(4):
            lo = ((ws[k] >> (4 * p)) & 0xF).to(tl.float32) - z[:, None]
            hi = ((ws[k] >> (4 * p + 16)) & 0xF).to(tl.float32) - z[:, None]
            part += lo * _half(xs[4 * k + p]) + hi * _half(xs[4 * k + p] >> 16)
    return part


@triton.jit
def _load_tile(qw_ptr, xp_ptr, q_rows, s_rows, z_rows, j, j_end, n_ok, ZERO_POINT, ZERO_MODE, BLOCK_W):
    """The tile of words j .. j + BLOCK_W (one group), split the way `_tile_dot` takes it: the codes as four
    [BLOCK_N, C] words (word k of each quad), the activation pairs as 16 [1, C] (word k, shift p at 4k + p),
    the group's scales and zero points; all zeros past j_end (a prefetch beyond the split). Splitting here,
    before a prefetched tile is carried into the next iteration, lets the loads produce the layouts the
    arithmetic uses (carrying the [C, 4, 4] pairs cost four shared-memory round trips per iteration)."""
    C: tl.constexpr = BLOCK_W // 4
    BLOCK_N: tl.constexpr = n_ok.shape[0]
    r4 = tl.arange(0, 4)
    cols = j + tl.arange(0, C)[:, None] * 4 + r4[None, :]  # [C, 4]: words 4c .. 4c + 3 of the tile
    col_ok = cols < j_end
    words = tl.load(q_rows + cols[None, :, :], mask=n_ok[:, None, None] & col_ok[None, :, :], other=0)
    xs = tl.load(xp_ptr + cols[:, :, None] * 4 + r4[None, None, :], mask=col_ok[:, :, None], other=0)
    s, z = group_scale_and_zero(
        s_rows,
        z_rows,
        j // BLOCK_W,
        n_ok & (tl.zeros(n_ok.shape, tl.int32) + j < j_end),
        ZERO_POINT,
        ZERO_MODE,
    )
    pa, pb, pc, pd = _split4(xs.reshape(C, 4, 2, 2))  # [C, word] per shift
    xa0, xa1, xa2, xa3 = _split4(pa.reshape(C, 2, 2))
    xb0, xb1, xb2, xb3 = _split4(pb.reshape(C, 2, 2))
    xc0, xc1, xc2, xc3 = _split4(pc.reshape(C, 2, 2))
    xd0, xd1, xd2, xd3 = _split4(pd.reshape(C, 2, 2))
    pairs = (
        xa0[None, :], xb0[None, :], xc0[None, :], xd0[None, :],
        xa1[None, :], xb1[None, :], xc1[None, :], xd1[None, :],
        xa2[None, :], xb2[None, :], xc2[None, :], xd2[None, :],
        xa3[None, :], xb3[None, :], xc3[None, :], xd3[None, :],
    )  # fmt: skip
    return _split4(words.reshape(BLOCK_N, C, 2, 2)), pairs, s, z


@triton.jit
def _tile_dot(ws, xs, z, ASM: tl.constexpr, EMULATE: tl.constexpr):
    """[BLOCK_N, C] sums of 32 products (q - z) * x / X_DIV (four words `ws` of a row per element, their
    pairs `xs`, as `_load_tile` splits them)."""
    if EMULATE:  # the interpreter runs no PTX
        return _dot4_emulated(ws, xs, z)
    zh = _f16_bits(z + 1024.0)
    return tl.inline_asm_elementwise(
        ASM,
        "=r" + ",r" * 21,
        [ws[0], ws[1], ws[2], ws[3],
         xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7],
         xs[8], xs[9], xs[10], xs[11], xs[12], xs[13], xs[14], xs[15],
         (zh | (zh << 16))[:, None]],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )  # fmt: skip


@triton.jit
def _w4_half2_kernel(
    xp_ptr,
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
    ZERO_POINT: tl.constexpr,
    ZERO_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ASM: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """y[0, n] = sum_k (q[n, k] - z[n, g]) * s[n, g] * x[0, k] (+ b[n]); x as `half2_pairs`, one group
    per tile of K, handled four words (one DOT4_ASM call) at a time."""
    pid_n, pid_k, rn, n_ok, j_start, j_end = row_split(N, KW, SPLIT_K, BLOCK_N, BLOCK_W)
    C: tl.constexpr = BLOCK_W // 4
    rn64 = rn.to(tl.int64)
    q_rows = qw_ptr + rn64[:, None, None] * stride_qn
    s_rows = s_ptr + rn64 * stride_sn
    z_rows = z_ptr + rn64 * stride_sn
    acc = tl.zeros((BLOCK_N, C), dtype=tl.float32)
    if PREFETCH:
        # Two tiles in flight at every wait: tile B is loaded before A is used, and A's next load is issued
        # before B is used. (A carried prefetch, loaded at the top and used in the next iteration, is sunk
        # by ptxas to the end of the loop, where the carried registers are free, so it overlaps nothing.)
        ta = _load_tile(
            qw_ptr, xp_ptr, q_rows, s_rows, z_rows, j_start, j_end, n_ok, ZERO_POINT, ZERO_MODE, BLOCK_W
        )
        for j in tl.range(j_start, j_end, 2 * BLOCK_W):
            tb = _load_tile(
                qw_ptr,
                xp_ptr,
                q_rows,
                s_rows,
                z_rows,
                j + BLOCK_W,
                j_end,
                n_ok,
                ZERO_POINT,
                ZERO_MODE,
                BLOCK_W,
            )
            acc += ta[2][:, None] * _tile_dot(ta[0], ta[1], ta[3], ASM, EMULATE)
            ta = _load_tile(
                qw_ptr,
                xp_ptr,
                q_rows,
                s_rows,
                z_rows,
                j + 2 * BLOCK_W,
                j_end,
                n_ok,
                ZERO_POINT,
                ZERO_MODE,
                BLOCK_W,
            )
            acc += tb[2][:, None] * _tile_dot(tb[0], tb[1], tb[3], ASM, EMULATE)
    else:
        for j in tl.range(j_start, j_end, BLOCK_W, num_stages=LOOP_STAGES):
            words, xs, s, z = _load_tile(
                qw_ptr, xp_ptr, q_rows, s_rows, z_rows, j, j_end, n_ok, ZERO_POINT, ZERO_MODE, BLOCK_W
            )
            acc += s[:, None] * _tile_dot(words, xs, z, ASM, EMULATE)
    acc *= _X_DIV
    _row_epilogue(
        acc, b_ptr, y_ptr, ws_ptr, counter_ptr, rn, n_ok, pid_n, pid_k, N, HAS_BIAS, SPLIT_K, BLOCK_N
    )


def half2_pairs(x: torch.Tensor) -> torch.Tensor:
    """x [1, K] (K a multiple of 8, unit stride) -> int32 [K / 8, 4], the activations `_w4_half2_kernel`
    reads: per word of codes, fp16 pairs (x[8w + p] / X_DIV, x[8w + p + 4] / X_DIV)."""
    kw = x.shape[1] // 8
    out = torch.empty((kw, 4), dtype=torch.int32, device=x.device)
    block = 128
    _half2_pairs_kernel[(triton.cdiv(kw, block),)](x, out, kw, BLOCK=block, num_warps=4)
    return out


def w4_half2_gemv(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    ws: GemvWorkspace,
    config: RowGemvConfig | None = None,
) -> torch.Tensor:
    """`x @ W.T + bias` for one row x [1, K] of 16-bit activations and an int4 `QuantizedWeight`, in f16x2
    arithmetic (see the module docstring)."""
    n, k = weight.shape
    if x.shape != (1, k) or not w4_row_supported(weight):
        raise ValueError(f"w4_half2_gemv needs x [1, {k}] and int4 groups of 64-256, got {weight.group_size}")
    if weight.perm is not None:  # act-order: the weight's K is stored grouped; gather x to match
        x = x.index_select(1, weight.perm)
    group_words = weight.group_size // 8
    kw = k // 8
    cfg = config or default_w4_config(n, kw, group_words, ws.num_sms)
    if cfg.block_k != group_words:
        raise ValueError(f"the tile must be one group deep ({group_words} words), got {cfg.block_k}")
    tiles = _check_workspace(ws, n, cfg)
    pairs = half2_pairs(x.contiguous())
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    args, meta = weight_args(weight, bias, y, ws)
    _w4_half2_kernel[(tiles, cfg.split_k)](
        pairs,
        *args,
        **meta,
        SPLIT_K=cfg.split_k,
        PREFETCH=cfg.prefetch,
        LOOP_STAGES=cfg.loop_stages,
        BLOCK_N=cfg.block_n,
        BLOCK_W=group_words,
        ASM=DOT4_ASM,
        EMULATE=_EMULATE,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y
