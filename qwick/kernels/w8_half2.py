"""The batch-1 W8A8 GEMV on the CUDA cores in packed fp16 (f16x2): fp8 or int8 weight codes times the
activation codes that the producing kernel (RMSNorm, SiLU-and-mul) wrote, for one row.

Why: the int4 GEMV became 1.3x faster once its decoding ran in f16x2 over wide tiles
(`qwick.kernels.row_gemv_half2`), and an 8-bit code needs far less decoding than a 4-bit one. For fp8,
`cvt.rn.f16x2.e4m3x2` turns two codes into an f16x2 value in one instruction and `fma.rn.f16x2` multiplies
two of them by a pair of activations: one instruction per code, for twice the bytes of an int4 code, so
the kernel should stream at the memory's pace rather than the issue rate. The tensor-core path it would
replace (`qwick.kernels.gemv` with `x_scale`) streams the 7b gate/up at ~3.0 TB/s.

The activation codes are consecutive pairs of the same 8-bit type, converted once per quad of words per
thread and scaled by 2^-8 (exact: every fp8 / int8 value times 2^-8 is an fp16 value), so products stay
below 448 * 1.75 (fp8) or 127 * 0.5 (int8) and a sum of 16 of them well inside fp16's range; every 16
products are added into fp32. int8 codes become fp16 through the bits of 1024 + 128 + q (`prmt` with 0x64,
after flipping the sign bit), minus 1152: exact.

y = (sum_k w[n, k] x[k]) * 2^8 * w_scale[n] * x_scale (+ bias), the x scale per token or per group of
columns (`x_group`, a multiple of the tile). Weights [N, K] and x [1, K] are read as int32 words of four
codes. Under Triton's interpreter, which runs no PTX, the products are computed in fp32 (`EMULATE`).

Status: interpreter-tested; not yet run on the H200 (`W8A8LinearMethod.decode_half2` keeps it off).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qwick.kernels.gemv import GemvWorkspace
from qwick.kernels.half2 import EMULATE, split4, sum_halves_asm
from qwick.kernels.row_gemv import RowGemvConfig, _check_workspace, _row_epilogue, row_split

TILE_WORDS = 32  # 128 codes of a row per tile
X_SHIFT = 256.0  # activations enter the products times 1 / X_SHIFT
_X_SHIFT = tl.constexpr(X_SHIFT)
FP8_DTYPE = torch.float8_e4m3fn


def _to_f16x2(word: str, pair: int, out: str, int8: bool) -> list[str]:
    """PTX turning codes 2 * pair and 2 * pair + 1 of `word` into the f16x2 register `out` (exact)."""
    if int8:  # bytes beside 0x64 read as 1024 + byte; the flipped sign bit makes byte = 128 + q
        sel = "0x4140" if pair == 0 else "0x4342"
        return [f"prmt.b32 {out}, {word}, magic, {sel};", f"sub.f16x2 {out}, {out}, bias;"]
    return [f"cvt.rn.f16x2.e4m3x2 {out}, {word}_{'lo' if pair == 0 else 'hi'};"]


def _prelude(words: list[str], int8: bool) -> list[str]:
    """Declarations, and per input word its flipped sign bits (int8) or its two 16-bit halves (fp8)."""
    lines = [".reg .b32 t;"]
    if int8:
        lines += [".reg .b32 magic, bias;", "mov.b32 magic, 0x64646464;", "mov.b32 bias, 0x64806480;"]
    for w in words:
        if int8:
            lines.append(f"xor.b32 {w}, {w}, 0x80808080;")
        else:
            lines += [f".reg .b16 {w}_lo, {w}_hi;", f"mov.b32 {{{w}_lo, {w}_hi}}, {w};"]
    return lines


def _dot4_asm(int8: bool) -> str:
    """PTX: four weight words ($1-$4), the activation pairs ($5 + 2 * word + pair, already f16x2 and scaled)
    -> the fp32 sum of the 16 products ($0)."""
    words = [f"w{k}" for k in range(4)]
    lines = ["{", ".reg .b32 " + ", ".join(words) + ", d, acc;", ".reg .b16 lo, hi;", ".reg .f32 fa, fb;"]
    lines += [f"mov.b32 w{k}, ${1 + k};" for k in range(4)]
    lines += _prelude(words, int8) + ["mov.b32 acc, 0;"]
    for k in range(4):
        for pair in range(2):
            lines += _to_f16x2(f"w{k}", pair, "d", int8)
            lines.append(f"fma.rn.f16x2 acc, d, ${5 + 2 * k + pair}, acc;")
    lines += [*sum_halves_asm(), "}"]
    return "\n".join(lines)


def _xpairs_asm(int8: bool) -> str:
    """PTX: one word of activation codes ($2) -> its two f16x2 pairs times 1 / X_SHIFT ($0, $1)."""
    lines = ["{", ".reg .b32 x, scale;", "mov.b32 x, $2;", "mov.b32 scale, 0x1C001C00;"]  # (2^-8, 2^-8)
    lines += _prelude(["x"], int8)
    for pair in range(2):
        lines += _to_f16x2("x", pair, "t", int8)
        lines.append(f"mul.rn.f16x2 ${pair}, t, scale;")
    return "\n".join(lines + ["}"])


DOT4_ASM = {False: _dot4_asm(False), True: _dot4_asm(True)}
XPAIRS_ASM = {False: _xpairs_asm(False), True: _xpairs_asm(True)}


@triton.jit
def _code(words, i: tl.constexpr, INT8: tl.constexpr):
    """Code i (0-3) of each int32 word, as fp32."""
    byte = ((words >> (8 * i)) & 0xFF).to(tl.uint8)
    if INT8:
        return byte.to(tl.int8, bitcast=True).to(tl.float32)
    return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _tile_dot_emulated(words, x_ptr, cols, INT8: tl.constexpr):
    """What `_tile_dot_half2` computes, in fp32 Triton arithmetic (for the interpreter)."""
    C: tl.constexpr = cols.shape[0]
    BLOCK_N: tl.constexpr = words.shape[0]
    ws = split4(words.reshape(BLOCK_N, C, 2, 2))
    wcols = split4(cols.reshape(C, 2, 2))
    part = tl.zeros((BLOCK_N, C), tl.float32)
    for k in tl.static_range(4):
        xw = tl.load(x_ptr + wcols[k])
        for i in tl.static_range(4):
            part += _code(ws[k], i, INT8) * (_code(xw, i, INT8) / _X_SHIFT)[None, :]
    return part


@triton.jit
def _tile_dot_half2(words, x_ptr, cols, XPAIRS: tl.constexpr, DOT4: tl.constexpr):
    """[BLOCK_N, C] sums of 16 products w * x / X_SHIFT, a quad of words of a row per element."""
    C: tl.constexpr = cols.shape[0]
    BLOCK_N: tl.constexpr = words.shape[0]
    x0, x1, x2, x3 = split4(tl.load(x_ptr + cols).reshape(C, 2, 2))  # [C]: word k of each quad
    p00, p01 = tl.inline_asm_elementwise(XPAIRS, "=r,=r,r", [x0], dtype=(tl.int32,) * 2, is_pure=True, pack=1)
    p10, p11 = tl.inline_asm_elementwise(XPAIRS, "=r,=r,r", [x1], dtype=(tl.int32,) * 2, is_pure=True, pack=1)
    p20, p21 = tl.inline_asm_elementwise(XPAIRS, "=r,=r,r", [x2], dtype=(tl.int32,) * 2, is_pure=True, pack=1)
    p30, p31 = tl.inline_asm_elementwise(XPAIRS, "=r,=r,r", [x3], dtype=(tl.int32,) * 2, is_pure=True, pack=1)
    w0, w1, w2, w3 = split4(words.reshape(BLOCK_N, C, 2, 2))
    return tl.inline_asm_elementwise(
        DOT4,
        "=r" + ",r" * 12,
        [w0, w1, w2, w3,
         p00[None, :], p01[None, :], p10[None, :], p11[None, :],
         p20[None, :], p21[None, :], p30[None, :], p31[None, :]],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )  # fmt: skip


@triton.jit
def _w8_half2_kernel(
    x_ptr,
    qw_ptr,
    wscale_ptr,
    xscale_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    N,
    KW,
    stride_qn,
    X_GROUP_W: tl.constexpr,
    INT8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    XPAIRS: tl.constexpr,
    DOT4: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """y[0, n] = sum_k w[n, k] x[k] * w_scale[n] * x_scale (+ b[n]): tiles of BLOCK_W words (4 codes each)
    of BLOCK_N rows; X_GROUP_W > 0: one x scale per X_GROUP_W words (a multiple of BLOCK_W)."""
    C: tl.constexpr = BLOCK_W // 4
    pid_n, pid_k, rn, n_ok, j_start, j_end, q_rows, wscale_rows, _ = row_split(
        qw_ptr, wscale_ptr, wscale_ptr, N, KW, stride_qn, 1, SPLIT_K, BLOCK_N, BLOCK_W
    )
    quad = tl.arange(0, C) * 4
    rw = tl.arange(0, BLOCK_W)
    acc = tl.zeros((BLOCK_N, C), dtype=tl.float32)
    for j in tl.range(j_start, j_end, BLOCK_W):
        words = tl.load(q_rows + (j + rw)[None, :], mask=n_ok[:, None], other=0)
        cols = j + quad[:, None] + tl.arange(0, 4)[None, :]  # [C, 4]: the words of each quad
        if EMULATE:
            part = _tile_dot_emulated(words, x_ptr, cols, INT8)
        else:
            part = _tile_dot_half2(words, x_ptr, cols, XPAIRS, DOT4)
        if X_GROUP_W > 0:
            acc += part * tl.load(xscale_ptr + j // X_GROUP_W)
        else:
            acc += part
    scale = tl.load(wscale_rows, mask=n_ok, other=0.0) * _X_SHIFT
    if X_GROUP_W == 0:
        scale *= tl.load(xscale_ptr)
    _row_epilogue(
        acc * scale[:, None], b_ptr, y_ptr, ws_ptr, counter_ptr, rn, n_ok, pid_n, pid_k, N, HAS_BIAS,
        SPLIT_K, BLOCK_N,
    )  # fmt: skip


def default_w8_half2_config(n: int, kw: int, num_sms: int, x_group_words: int = 0) -> RowGemvConfig:
    """64 rows x 32 words (128 codes) per tile, 4 warps; K split (doubling) until about four programs per
    SM are streaming, down to one tile of K per split. A first guess, to be swept on the H200."""
    block_n = 64
    block_w = next(
        w for w in (TILE_WORDS, 16, 8, 4) if kw % w == 0 and (not x_group_words or x_group_words % w == 0)
    )
    tiles, k_tiles, split = triton.cdiv(n, block_n), kw // block_w, 1
    while tiles * split < 4 * num_sms and k_tiles >= 2 * split:
        split *= 2
    return RowGemvConfig(block_n, block_w, split)


def w8_half2_supported(weight: torch.Tensor, x_codes: torch.Tensor) -> bool:
    """fp8 e4m3 or int8 weight codes [N, K] and one row of activation codes of the same type, K % 4 == 0."""
    return (
        weight.dtype in (FP8_DTYPE, torch.int8)
        and x_codes.dtype == weight.dtype
        and x_codes.dim() == 2
        and x_codes.shape[0] == 1
        and weight.shape[1] % 4 == 0
    )


def w8_half2_gemv(
    x_codes: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    ws: GemvWorkspace,
    out_dtype: torch.dtype,
    x_group: int | None = None,
    config: RowGemvConfig | None = None,
) -> torch.Tensor:
    """`(x_codes @ weight.T) * x_scale * weight_scale + bias` for one row: x_codes [1, K] and weight
    [N, K] codes of one 8-bit type (`w8_half2_supported`), weight_scale fp32 [N], x_scale fp32 [1, 1] or,
    with `x_group`, [1, K / x_group]."""
    n, k = weight.shape
    if x_codes.shape != (1, k) or not w8_half2_supported(weight, x_codes):
        raise ValueError(
            f"w8_half2_gemv needs x [1, {k}] codes of the weight's type (fp8 e4m3 or int8, K a multiple of "
            f"4), got x {tuple(x_codes.shape)} {x_codes.dtype}, weight {weight.dtype}"
        )
    groups = 1 if x_group is None else triton.cdiv(k, x_group)
    if x_scale.shape != (1, groups) or x_scale.dtype != torch.float32 or weight_scale.numel() != n:
        raise ValueError(f"scales: x [1, {groups}] and weight [{n}] in fp32, got {tuple(x_scale.shape)}")
    if x_group is not None and x_group % 4:
        raise ValueError(f"activation groups of {x_group} columns are not whole words")
    kw = k // 4
    group_words = (x_group or 0) // 4
    cfg = config or default_w8_half2_config(n, kw, ws.num_sms, group_words)
    if kw % cfg.block_k or cfg.block_k % 4 or (group_words and group_words % cfg.block_k):
        raise ValueError(f"tiles of {cfg.block_k} words do not fit rows of {kw} (x groups of {group_words})")
    words = weight.contiguous().view(torch.int32)
    x_words = x_codes.contiguous()
    if x_words.data_ptr() % 4:
        x_words = x_words.clone()
    x_words = x_words.view(torch.int32)
    tiles = _check_workspace(ws, n, cfg)
    y = torch.empty((1, n), dtype=out_dtype, device=x_codes.device)
    int8 = weight.dtype == torch.int8
    _w8_half2_kernel[(tiles, cfg.split_k)](
        x_words,
        words,
        weight_scale,
        x_scale,
        bias if bias is not None else weight_scale,
        y,
        ws.partials,
        ws.counters,
        n,
        kw,
        words.stride(0),
        X_GROUP_W=group_words,
        INT8=int8,
        HAS_BIAS=bias is not None,
        SPLIT_K=cfg.split_k,
        BLOCK_N=cfg.block_n,
        BLOCK_W=cfg.block_k,
        XPAIRS=XPAIRS_ASM[int8],
        DOT4=DOT4_ASM[int8],
        EMULATE=EMULATE,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y
