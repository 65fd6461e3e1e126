"""One-row GEMV on 8-bit and 4-bit weight codes, on the CUDA cores: the batch-1 decode matmul.

At batch 1 every weight is used once, so a decode step costs the weight bytes plus whatever it takes to
turn each code into a number. The tensor-core kernels (`qwick.kernels.gemv` on 8-bit codes,
`qwick.kernels.w4a16`) convert every code to bf16 with Triton's conversions (`I2F` / `F2F`, quarter-rate
on Hopper) and stage it through shared memory for `tl.dot`: on the H200 that holds 8-bit codes to
2.2-2.7 TB/s and int4 far lower. Here a program streams [BLOCK_N, BLOCK_W] int32 words, decodes the codes
with integer bit operations on the packed words (the trick Marlin and FasterTransformer use: put the
code's bits into the mantissa of a float with a fixed exponent, then one fused multiply-add removes the
offset) and multiplies them by x with fp32 FMAs, in registers, with no shared memory and no layout change.

- int8 (per-output-channel scales): the word is XORed with 0x80808080 (two's complement to offset
  binary, u = code + 128), byte i is moved to the top of the mantissa of 1.0 (`(u >> 8i) << 15`): the float
  is 1 + u/256, so code = 256 * f - 384 exactly. The kernel accumulates f * x and subtracts 384 * sum(x).
- fp8 e4m3: its bits go to the sign and the exponent/mantissa top of a float32 (bit 7 -> 31, bits 0-6 ->
  20-26), which is the code's value times 2^-120 for normal and subnormal codes alike; the product with
  2^120 is exact.
- int4 (group-wise scales and zero points, one group per tile: BLOCK_W * 8 == group size): nibble i of a
  word is masked in place and ORed into the mantissa of 2^23, giving 2^23 + q * 16^p; one FMA
  (`f * 16^-p - (2^(23 - 4p) + z)`) gives q - z exactly. Nibbles 0-2 are taken from the word, 3-7 from the
  word shifted right by 12: one shift and eight mask-ors per eight codes.

Split-K and its reduction are `qwick.kernels.gemv`'s epilogue (with BLOCK_M = 1), so these kernels replay
in CUDA graphs the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qwick.kernels.gemv import GemvWorkspace, _gemv_epilogue
from qwick.quantization.formats.layout import QuantizedWeight

FP8_E4M3, INT8 = 0, 1
ZERO_CONST, ZERO_TENSOR = 0, 1


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
    _gemv_epilogue(
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
def _w8_row_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    N,
    KW,
    stride_wn,
    CODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """y[0, n] = s[n] * sum_k code(w[n, k]) * x[0, k] (+ b[n]); w is read as int32 words of 4 codes."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, BLOCK_W)
    n_ok = rn < N
    w_per_split = tl.cdiv(tl.cdiv(KW, SPLIT_K), BLOCK_W) * BLOCK_W
    j_start = pid_k * w_per_split
    j_end = tl.minimum(j_start + w_per_split, KW)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    xsum = tl.zeros((BLOCK_W,), dtype=tl.float32)
    for j in range(j_start, j_end, BLOCK_W):
        cols = j + rj
        c_ok = cols < j_end
        words = tl.load(w_rows + cols[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0)
        x0 = tl.load(x_ptr + 4 * cols, mask=c_ok, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + 4 * cols + 1, mask=c_ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + 4 * cols + 2, mask=c_ok, other=0.0).to(tl.float32)
        x3 = tl.load(x_ptr + 4 * cols + 3, mask=c_ok, other=0.0).to(tl.float32)
        if CODE == 1:  # int8: 1 + u/256 with u = code + 128 in the top 8 mantissa bits
            u = words ^ -0x7F7F7F80  # 0x80808080 as an int32
            f0 = (((u << 15) & 0x7F8000) | 0x3F800000).to(tl.float32, bitcast=True)
            f1 = (((u << 7) & 0x7F8000) | 0x3F800000).to(tl.float32, bitcast=True)
            f2 = (((u >> 1) & 0x7F8000) | 0x3F800000).to(tl.float32, bitcast=True)
            f3 = (((u >> 9) & 0x7F8000) | 0x3F800000).to(tl.float32, bitcast=True)
            xsum += x0 + x1 + x2 + x3
        else:  # fp8 e4m3: sign to bit 31, exponent and mantissa to bits 20-26 (the value times 2^-120)
            f0 = (((words << 24) & -0x80000000) | ((words << 20) & 0x7F00000)).to(tl.float32, bitcast=True)
            f1 = (((words << 16) & -0x80000000) | ((words << 12) & 0x7F00000)).to(tl.float32, bitcast=True)
            f2 = (((words << 8) & -0x80000000) | ((words << 4) & 0x7F00000)).to(tl.float32, bitcast=True)
            f3 = ((words & -0x80000000) | ((words >> 4) & 0x7F00000)).to(tl.float32, bitcast=True)
            f0 *= 1.329227995784916e36  # 2^120: exact, subnormal codes included
            f1 *= 1.329227995784916e36
            f2 *= 1.329227995784916e36
            f3 *= 1.329227995784916e36
        acc += f0 * x0[None, :]
        acc += f1 * x1[None, :]
        acc += f2 * x2[None, :]
        acc += f3 * x3[None, :]
    if CODE == 1:  # code = 256 f - 384: sum f*x scaled by 256, minus 384 * sum(x) per row
        acc = acc * 256.0 - 384.0 * xsum[None, :]
    acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[:, None]
    _row_epilogue(
        acc, b_ptr, y_ptr, ws_ptr, counter_ptr, rn, n_ok, pid_n, pid_k, N, HAS_BIAS, SPLIT_K, BLOCK_N
    )


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
    ZERO_POINT: tl.constexpr,
    ZERO_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """y[0, n] = sum_k (q[n, k] - z[n, g]) * s[n, g] * x[0, k] (+ b[n]), one group g per tile of K.

    z is an integer (a zero-point tensor or constant), so every `f * 16^-p - (2^(23 - 4p) + z)` is exact."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, BLOCK_W)
    n_ok = rn < N
    w_per_split = tl.cdiv(tl.cdiv(KW, SPLIT_K), BLOCK_W) * BLOCK_W
    j_start = pid_k * w_per_split
    j_end = tl.minimum(j_start + w_per_split, KW)
    rn64 = rn.to(tl.int64)
    q_rows = qw_ptr + rn64[:, None] * stride_qn
    s_rows = s_ptr + rn64 * stride_sn
    z_rows = z_ptr + rn64 * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    for j in range(j_start, j_end, BLOCK_W):
        g = j // BLOCK_W  # the tile is one group
        cols = j + rj
        words = tl.load(q_rows + cols[None, :], mask=n_ok[:, None], other=0)
        s = tl.load(s_rows + g, mask=n_ok, other=0.0).to(tl.float32)
        if ZERO_MODE == 1:
            z = tl.load(z_rows + g, mask=n_ok, other=0).to(tl.float32)
        else:
            z = tl.zeros((BLOCK_N,), dtype=tl.float32) + ZERO_POINT
        # q - z = f * 16^-p - (2^(23 - 4p) + z) for the nibble at position p of its (shifted) word
        z0 = (z + 8388608.0)[:, None]
        z1 = (z + 524288.0)[:, None]
        z2 = (z + 32768.0)[:, None]
        z3 = (z + 2048.0)[:, None]
        z4 = (z + 128.0)[:, None]
        hi = words >> 12
        xp = x_ptr + 8 * cols
        part = ((words & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - z0
        part = part * tl.load(xp).to(tl.float32)[None, :]
        d = ((words & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) * 0.0625 - z1
        part += d * tl.load(xp + 1).to(tl.float32)[None, :]
        d = ((words & 0xF00) | 0x4B000000).to(tl.float32, bitcast=True) * 0.00390625 - z2
        part += d * tl.load(xp + 2).to(tl.float32)[None, :]
        d = ((hi & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - z0
        part += d * tl.load(xp + 3).to(tl.float32)[None, :]
        d = ((hi & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) * 0.0625 - z1
        part += d * tl.load(xp + 4).to(tl.float32)[None, :]
        d = ((hi & 0xF00) | 0x4B000000).to(tl.float32, bitcast=True) * 0.00390625 - z2
        part += d * tl.load(xp + 5).to(tl.float32)[None, :]
        d = ((hi & 0xF000) | 0x4B000000).to(tl.float32, bitcast=True) * 0.000244140625 - z3
        part += d * tl.load(xp + 6).to(tl.float32)[None, :]
        d = ((hi & 0xF0000) | 0x4B000000).to(tl.float32, bitcast=True) * 0.0000152587890625 - z4
        part += d * tl.load(xp + 7).to(tl.float32)[None, :]
        acc += s[:, None] * part
    _row_epilogue(
        acc, b_ptr, y_ptr, ws_ptr, counter_ptr, rn, n_ok, pid_n, pid_k, N, HAS_BIAS, SPLIT_K, BLOCK_N
    )


@dataclass(frozen=True)
class RowGemvConfig:
    block_n: int
    block_w: int  # int32 words per row per tile (4 codes each at 8 bits, 8 at 4 bits)
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def default_w8_config(n: int, kw: int, num_sms: int) -> RowGemvConfig:
    """Launch shape for 8-bit codes: split K until about four programs per SM are streaming."""
    block_n, block_w = 32, 64
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split < 4 * num_sms and kw // (block_w * split * 2) >= 2:
        split *= 2
    return RowGemvConfig(block_n, block_w, split)


def default_w4_config(n: int, kw: int, group_words: int, num_sms: int) -> RowGemvConfig:
    """Launch shape for int4: the tile is one group deep; split K as for 8-bit codes."""
    block_n = 64
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split < 4 * num_sms and kw // (group_words * split * 2) >= 2:
        split *= 2
    return RowGemvConfig(block_n, group_words, split)


def _check_workspace(ws: GemvWorkspace, n: int, cfg: RowGemvConfig) -> int:
    tiles = triton.cdiv(n, cfg.block_n)
    if cfg.split_k > 1 and (cfg.split_k * n > ws.partials.numel() or tiles > ws.counters.numel()):
        raise ValueError(f"split-K workspace too small for {cfg} at N={n}")
    return tiles


def w8_row_gemv(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    ws: GemvWorkspace,
    config: RowGemvConfig | None = None,
) -> torch.Tensor:
    """`(x @ codes.T) * scale + bias` for one row x [1, K] and 8-bit codes [N, K] (int8 or fp8 e4m3),
    `scale` fp32 [N] per output channel. K must be a multiple of 4 (whole int32 words)."""
    n, k = codes.shape
    if x.shape != (1, k) or k % 4 or not codes.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"w8_row_gemv needs x [1, {k}] and contiguous codes with K % 4 == 0")
    code = INT8 if codes.dtype == torch.int8 else FP8_E4M3
    if code == FP8_E4M3 and codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"8-bit codes must be int8 or float8_e4m3fn, got {codes.dtype}")
    kw = k // 4
    words = codes.view(torch.int32)
    cfg = config or default_w8_config(n, kw, ws.num_sms)
    tiles = _check_workspace(ws, n, cfg)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _w8_row_kernel[(tiles, cfg.split_k)](
        x,
        words,
        scale,
        bias if bias is not None else scale,
        y,
        ws.partials,
        ws.counters,
        n,
        kw,
        words.stride(0),
        CODE=code,
        HAS_BIAS=bias is not None,
        SPLIT_K=cfg.split_k,
        BLOCK_N=cfg.block_n,
        BLOCK_W=cfg.block_w,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y


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
    if weight.perm is not None:  # act-order: the weight's K is stored grouped; gather x to match
        x = x.index_select(1, weight.perm)
    x = x.contiguous()
    group_words = weight.group_size // 8
    kw = k // 8
    cfg = config or default_w4_config(n, kw, group_words, ws.num_sms)
    if cfg.block_w != group_words:
        raise ValueError(f"the tile must be one group deep ({group_words} words), got {cfg.block_w}")
    tiles = _check_workspace(ws, n, cfg)
    if weight.zeros is not None:
        mode, extra = ZERO_TENSOR, weight.zeros
    else:
        mode, extra = ZERO_CONST, weight.scales
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _w4_row_kernel[(tiles, cfg.split_k)](
        x,
        weight.qweight,
        weight.scales,
        extra,
        bias if bias is not None else weight.scales,
        y,
        ws.partials,
        ws.counters,
        n,
        kw,
        weight.qweight.stride(0),
        weight.scales.stride(0),
        ZERO_POINT=weight.zero_point,
        ZERO_MODE=mode,
        HAS_BIAS=bias is not None,
        SPLIT_K=cfg.split_k,
        BLOCK_N=cfg.block_n,
        BLOCK_W=cfg.block_w,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y
