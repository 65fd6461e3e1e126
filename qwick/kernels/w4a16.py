"""Matmul on integer-quantized weights (`QuantizedWeight`: int4 or int8 packed along K, per-group scales):
`y = x @ W.T + b` with bf16/fp16 activations, W dequantized tile by tile in registers. W4A16 for AWQ, GPTQ
and RTN int4; the same kernel with BITS=8 serves GGUF Q8_0 / Q5_0 / Q6_K, and mins serve Q4_K.

Decode (M <= 16) is bound by reading the weight once, and a 4-bit weight is a quarter of the bf16 bytes, so
the kernel follows `qwick.kernels.gemv`: programs stream [BLOCK_N, BLOCK_K] tiles of W (BLOCK_N rows, each
a contiguous run of BLOCK_K / 8 int32 words), with K split over SPLIT_K programs when N / BLOCK_N programs
cannot keep every SM streaming; the partials go to the shared fp32 workspace and the last program of a
tile reduces them (the same epilogue, counters self-reset, so CUDA graphs can replay it).

Unpacking without a reshape: word j of a tile holds elements 8j + i for i < 8 (sequential nibbles). A dot
product does not care in which order it visits K, so instead of interleaving the eight nibble planes back
into K order, the kernel multiplies plane i ([BLOCK_N, BLOCK_K / 8], one shift and mask of the loaded words)
by the matching strided slice of x (columns 8j + i; x is tiny and stays in L1). Eight `tl.dot`s of depth
BLOCK_K / 8 per tile; each word is loaded once (contiguous per row). Group scales depend only on j (group
sizes are multiples of 8), so one [BLOCK_N, BLOCK_K / 8] scale tile serves all eight planes.

Each dequantized value is computed in fp32 exactly as `formats.layout.dequantize` computes it and rounded
once to the activation dtype: the kernel and `formats.reference.dequant_matmul` multiply the same weights.
Prefill (M > 16) runs the same kernel over M tiles of 64 rows without split-K.

Used on GPUs for GGUF weights and for int4 groups of 64 codes at 2-16 rows; above 16 rows its 64-row M
tiles re-run the eight planes' dots with strided gathers of x, 2-20x slower than dequantize-then-cuBLAS
(H200, BENCHMARKS.md). `w4_tiled_matmul` below serves AWQ, GPTQ and RTN int4 at 2-128 rows
(`PackedLinearMethod.tiled_min_m` / `tiled_max_m`), 2.7-3.6x faster than this kernel at 2-16 rows: each
tile's codes decoded once for all its rows, in the registers the tensor cores read, with the weight as
the MMA's wide side and x permuted so its tiles copy asynchronously.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from qwick.kernels.gemv import MAX_M, GemvWorkspace, m_tile_split_k_epilogue, split_k_epilogue, split_k_for
from qwick.quantization.formats.layout import QuantizedWeight

ZERO_CONST, ZERO_TENSOR, ZERO_MINS = 0, 1, 2


@triton.jit(do_not_specialize=["M"])  # as the bf16 GEMV: a new batch size must not compile mid-serving
def _qgemv_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_ym,
    ZERO_POINT: tl.constexpr,
    ZERO_MODE: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    BLOCK_W: tl.constexpr = BLOCK_K // PER_WORD  # words per row per tile
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, BLOCK_W)
    m_ok = rm < M
    n_ok = rn < N
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    rn64 = rn.to(tl.int64)
    q_rows = qw_ptr + rn64[:, None] * stride_qn
    s_rows = s_ptr + rn64[:, None] * stride_sn
    z_rows = z_ptr + rn64[:, None] * stride_sn
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        kw = k // PER_WORD + rj  # word index of each column of the tile
        kk = kw * PER_WORD  # first element of each word
        k_ok = kk < k_end
        wn_mask = n_ok[:, None] & k_ok[None, :]
        words = tl.load(q_rows + kw[None, :], mask=wn_mask, other=0)
        group = kk // GROUP
        scale = tl.load(s_rows + group[None, :], mask=wn_mask, other=0.0).to(tl.float32)
        if ZERO_MODE == 1:
            zero = tl.load(z_rows + group[None, :], mask=wn_mask, other=0).to(tl.float32)
        elif ZERO_MODE == 2:
            mins = tl.load(z_rows + group[None, :], mask=wn_mask, other=0.0).to(tl.float32)
        xm_mask = m_ok[:, None] & k_ok[None, :]
        for i in tl.static_range(PER_WORD):
            q = ((words >> (i * BITS)) & MASK).to(tl.float32)
            if ZERO_MODE == 2:
                w = q * scale - mins
            elif ZERO_MODE == 1:
                w = (q - zero) * scale
            else:
                w = (q - ZERO_POINT) * scale
            x = tl.load(x_rows + (kk + i)[None, :], mask=xm_mask, other=0.0)
            acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
    split_k_epilogue(
        acc,
        b_ptr,
        y_ptr,
        ws_ptr,
        counter_ptr,
        rm,
        rn,
        m_ok,
        n_ok,
        pid_n,
        pid_k,
        N,
        stride_ym,
        HAS_BIAS,
        SPLIT_K,
        BLOCK_M,
        BLOCK_N,
    )


def _m_bucket(m: int) -> int:
    return triton.next_power_of_2(m) if m <= MAX_M else MAX_M + 1


@dataclass(frozen=True)
class QuantGemvConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    block_m: int = MAX_M


@functools.lru_cache(maxsize=1024)
def default_config(m: int, n: int, k: int, bits: int, num_sms: int) -> QuantGemvConfig:
    """Launch shape for an [m, k] x [n, k]^T product on a `bits`-bit weight.

    Decode: a tile row reads BLOCK_K * bits / 8 bytes (128 at int4 x 256), and K is split until there are
    about four programs per SM, as long as each split keeps at least two tiles of K to stream.
    Prefill: 64-row M tiles, no split.
    """
    if m > MAX_M:
        return QuantGemvConfig(128, 128, 1, num_warps=8, num_stages=3, block_m=64)
    block_n, block_k = 64, 256
    split = split_k_for(triton.cdiv(n, block_n), k // block_k, num_sms)
    return QuantGemvConfig(block_n, block_k, split, num_warps=4, num_stages=4)


def quant_matmul(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    ws: GemvWorkspace,
    config: QuantGemvConfig | None = None,
) -> torch.Tensor:
    """`x @ W.T + bias` for x [M, K] bf16/fp16 and a `QuantizedWeight` on the same device."""
    m, k = x.shape
    n, wk = weight.shape
    if wk != k:
        raise ValueError(f"x has K={k}, the weight {wk}")
    if weight.perm is not None:  # act-order: the weight's K is stored grouped; gather x to match
        x = x.index_select(1, weight.perm)
    if x.stride(1) != 1:
        x = x.contiguous()
    per_word = 32 // weight.bits
    if weight.group_size % per_word:
        raise ValueError(f"group size {weight.group_size} is not a multiple of {per_word}")
    for t in (weight.qweight, weight.scales, weight.zeros, weight.mins):
        if t is not None and (t.stride(1) != 1 or t.stride(0) != t.shape[1]):
            raise ValueError("quantized weight tensors must be contiguous")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or default_config(_m_bucket(m), n, k, weight.bits, ws.num_sms)
    if m > MAX_M and cfg.split_k != 1:
        raise ValueError("split-K needs M <= 16")
    tiles = triton.cdiv(n, cfg.block_n)
    ws.check(cfg.split_k, MAX_M, n, tiles, cfg)
    if weight.mins is not None:
        mode, extra = ZERO_MINS, weight.mins
    elif weight.zeros is not None:
        mode, extra = ZERO_TENSOR, weight.zeros
    else:
        mode, extra = ZERO_CONST, weight.scales
    block_m = cfg.block_m if m > MAX_M else MAX_M
    _qgemv_kernel[(tiles, cfg.split_k, triton.cdiv(m, block_m))](
        x,
        weight.qweight,
        weight.scales,
        extra,
        bias if bias is not None else weight.scales,
        y,
        ws.partials,
        ws.counters,
        m,
        n,
        k,
        x.stride(0),
        weight.qweight.stride(0),
        weight.scales.stride(0),
        y.stride(0),
        ZERO_POINT=weight.zero_point,
        ZERO_MODE=mode,
        BITS=weight.bits,
        GROUP=weight.group_size,
        HAS_BIAS=bias is not None,
        SPLIT_K=cfg.split_k,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y


@triton.jit
def _decode_nibble(words, i: tl.constexpr, z, s, dtype: tl.constexpr, HALF: tl.constexpr):
    """Nibble i of every word of [BLOCK_N, BLOCK_W] `words`, as `formats.layout.dequantize` decodes codes,
    bit for bit: (q - z) exact, times the row's scale, rounded once to `dtype`. In fp32, q through the bits
    `q | 0x4B000000` (2^23 + q); with HALF (fp16 activations and fp16 scales) in packed fp16 math, q
    through the bits `q | 0x6400` (1024 + q): the difference is exact in fp16 too, and fp16's multiply
    rounds the exact product once, as the fp32 path's final conversion does (about 20% fewer instructions
    in the sm_90 code of a 16-row tile)."""
    if HALF:
        q = (((words >> (4 * i)) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        return (q - (1024.0 + z).to(tl.float16)[:, None]) * s.to(tl.float16)[:, None]
    q = ((words >> (4 * i)) & 0xF) | 0x4B000000
    return ((q.to(tl.float32, bitcast=True) - (8388608.0 + z)[:, None]) * s[:, None]).to(dtype)


@triton.jit(do_not_specialize=["M"])
def _w4_tiles_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    M,
    N,
    KW,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_ym,
    ZERO_POINT: tl.constexpr,
    ZERO_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_W: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    NIBBLE_DOTS: tl.constexpr,
    HALF_DECODE: tl.constexpr,
):
    """y = x @ W.T (+ b) for int4 W with integer zero points, [BLOCK_M, BLOCK_N] output tiles, K in tiles
    of BLOCK_W words inside one group (one scale and zero point per row and tile). A tile's codes are
    decoded once for all BLOCK_M rows, into K order, and multiplied in one `tl.dot`. The weights are
    `formats.layout.dequantize`'s bit for bit: q + 2^23 read as fp32 from the bits `q | 0x4B000000`
    (exact, an integer op instead of a conversion), minus 2^23 + z (exact), times the scale in fp32,
    rounded once to x's dtype. Split-K as the decode kernels: each M tile has its own partials and
    counters.

    NIBBLE_DOTS (the default launch shapes): no reshape of the decoded tile into K order; instead nibbles
    p and p + 4 of each word side by side are one [BLOCK_N, 2 BLOCK_W] operand per p, 4 dots per tile,
    with the weight as the MMA's first operand (y^T = W x^T, so few rows are the MMA's narrow side).
    `tl.join` keeps the pairs in the registers the MMA reads (sm_90 code shows no shared-memory round
    trip; joining 4 or 8 nibbles did round-trip them). x comes permuted to match (inside each tile of
    BLOCK_W words, column 2 BLOCK_W p + 2r + h holds x's column 8r + p + 4h), so each dot's x is one
    contiguous slice that Triton's pipeliner copies into shared memory asynchronously (a dot per nibble on
    strided x columns gathered them with synchronous loads: up to 1.9x slower on gate/up and down, even on
    qkv and o, in the seventeenth session's sweep); and the scales and zero points load one tile ahead.

    HALF_DECODE (with NIBBLE_DOTS; fp16 activations and fp16 scales): the codes decoded in packed fp16
    math (`_decode_nibble`), the same weights bit for bit."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2).to(tl.int64)  # the epilogue's offsets grow with M * N
    rm = tl.arange(0, BLOCK_M)  # rows inside this M tile
    m_ok = pid_m * BLOCK_M + rm < M
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    w_per_split = tl.cdiv(tl.cdiv(KW, SPLIT_K), BLOCK_W) * BLOCK_W
    j_start = pid_k * w_per_split
    j_end = tl.minimum(j_start + w_per_split, KW)
    rn64 = rn.to(tl.int64)
    q_rows = qw_ptr + rn64[:, None] * stride_qn
    s_rows = s_ptr + rn64 * stride_sn
    z_rows = z_ptr + rn64 * stride_sn
    x_rows = x_ptr + (pid_m * BLOCK_M + rm).to(tl.int64)[:, None] * stride_xm
    x_cols = x_ptr + (pid_m * BLOCK_M + rm).to(tl.int64)[None, :] * stride_xm  # x^T's columns
    rj = tl.arange(0, BLOCK_W)
    rk = tl.arange(0, BLOCK_W * 8)
    rk2 = tl.arange(0, BLOCK_W * 2)
    shifts = 4 * tl.arange(0, 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if NIBBLE_DOTS:  # the first tile's scales and zero points, ahead of the loop
        first_ok = n_ok & (j_start + 0 * rn < j_end)  # a split can be empty (K tiles vs splits)
        s_next = tl.load(s_rows + j_start // GROUP_W, mask=first_ok, other=0.0)
        z_next = tl.load(z_rows + j_start // GROUP_W, mask=first_ok, other=0) if ZERO_MODE == 1 else s_next
    for j in range(j_start, j_end, BLOCK_W):
        words = tl.load(q_rows + (j + rj)[None, :], mask=n_ok[:, None], other=0)
        if NIBBLE_DOTS:  # this tile's scales were loaded an iteration ago; load the next tile's
            s = s_next.to(tl.float32)
            z = z_next.to(tl.float32) if ZERO_MODE == 1 else tl.zeros_like(s) + ZERO_POINT
            g_next = tl.minimum(j + BLOCK_W, j_end - 1) // GROUP_W
            s_next = tl.load(s_rows + g_next, mask=n_ok, other=0.0)
            if ZERO_MODE == 1:
                z_next = tl.load(z_rows + g_next, mask=n_ok, other=0)
        else:
            g = j // GROUP_W
            s = tl.load(s_rows + g, mask=n_ok, other=0.0).to(tl.float32)
            if ZERO_MODE == 1:
                z = tl.load(z_rows + g, mask=n_ok, other=0).to(tl.float32)
            else:
                z = tl.zeros_like(s) + ZERO_POINT
        if NIBBLE_DOTS:  # nibbles p and p + 4 of each word side by side in K: 4 dots
            for p in tl.static_range(4):
                lo = _decode_nibble(words, p, z, s, x_ptr.dtype.element_ty, HALF_DECODE)
                hi = _decode_nibble(words, p + 4, z, s, x_ptr.dtype.element_ty, HALF_DECODE)
                w = tl.reshape(tl.join(lo, hi), (BLOCK_N, 2 * BLOCK_W))  # column 2r + h: K 8r + p + 4h
                xt = tl.load(x_cols + (8 * j + 2 * BLOCK_W * p + rk2)[:, None], mask=m_ok[None, :], other=0.0)
                acc_t = tl.dot(w, xt, acc_t)
        else:
            q = ((words[:, :, None] >> shifts[None, None, :]) & 0xF) | 0x4B000000  # [BLOCK_N, BLOCK_W, 8]
            w = (q.to(tl.float32, bitcast=True) - (8388608.0 + z)[:, None, None]) * s[:, None, None]
            w = tl.reshape(w.to(x_ptr.dtype.element_ty), (BLOCK_N, BLOCK_W * 8))  # element 8j + i: K order
            x = tl.load(x_rows + (8 * j + rk)[None, :], mask=m_ok[:, None], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
    if NIBBLE_DOTS:
        acc = tl.trans(acc_t)
    m_tile_split_k_epilogue(
        acc,
        b_ptr,
        y_ptr,
        ws_ptr,
        counter_ptr,
        rm,
        rn,
        m_ok,
        n_ok,
        pid_m,
        pid_n,
        pid_k,
        N,
        stride_ym,
        HAS_BIAS,
        SPLIT_K,
        BLOCK_M,
        BLOCK_N,
    )


@dataclass(frozen=True)
class TiledW4Config:
    block_m: int
    block_n: int
    block_w: int  # words of K per tile (eight codes each), inside one group
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    nibble_dots: bool = False  # nibble-pair dots on x permuted first (else the reshape into K order)


# The two cases the twentieth session's 14b sweep added to `tiled_w4_config` (float("inf") turns either off).
WIDE_TILE_WAVES = 1.5
MIN_K_PER_FOUR_SPLITS = 1024


def tiled_w4_config(m: int, n: int, k: int, group_size: int, num_sms: int) -> TiledW4Config:
    """The H200 sweep's winners (`benchmarks/w4a16_mid_m.py`, timed in CUDA graphs, seventeenth session,
    7b shapes): the nibble-pair dots, 4 warps, 3 stages, on one M tile of 16 (up to 16 rows),
    32 (17-32) or 64 rows (more; one 128-row tile with 8 warps was slower). 128 outputs per tile, but 64
    at 17-64 rows unless the output tiles alone fill the SMs (gate/up) or, up to 32 rows, K is long
    (down); K split in four, or in two where the output tiles alone fill the SMs at 33+ rows (gate/up).
    The twentieth session's sweep on 14b's layers added two cases: 128 outputs wherever 128-output tiles,
    split in four, make 1.5 waves (14b's qkv, 7168 x 5120: 30.5 against 38.8 us at 64 rows), and K in four
    at 33-64 rows while each split keeps 1,024 of K (14b's gate/up, K 5120: 86.4 against 93.0 us; 7b's
    896 per split lost to two). Neither changes a 7b choice.
    The four layers of a decoder layer at their best shapes: at 2-16 rows 115-121 us against 307-431
    with `quant_matmul`; at 32 rows 143 against 196 with a dot per nibble (x gathered per nibble); at 64
    rows 184 against 261 with the reshape into K order; at 128 rows 283 against 330 with dequantize-then-
    cuBLAS (which still wins for qkv and o there: `PackedLinearMethod.tiled_min_codes_above_64`). Groups
    of 64 codes (8-word tiles: too short a dot for the nibbles) take the reshape, on 64-row tiles."""
    block_w = min(16, group_size // 8)
    if block_w < 16:
        block_m, block_n, nibble = 64, 128, False
    else:
        block_m, nibble = (16 if m <= 16 else 32 if m <= 32 else 64), True
        wide_tiles = triton.cdiv(n, 128)
        many = wide_tiles >= num_sms or wide_tiles * 4 >= WIDE_TILE_WAVES * num_sms
        wide = m <= 16 or m > 64 or (m <= 32 and k >= 8192) or many
        block_n = 128 if wide else 64
    tiles = triton.cdiv(n, block_n) * triton.cdiv(triton.next_power_of_2(m), block_m)
    long_k = nibble and m <= 64 and k // 4 >= MIN_K_PER_FOUR_SPLITS
    split = 4 if (nibble and m <= 32) or tiles < num_sms or long_k else 2
    while split > 1 and k // 8 // block_w < 2 * split:  # every split keeps two tiles of K
        split //= 2
    return TiledW4Config(block_m, block_n, block_w, split, nibble_dots=nibble)


@functools.lru_cache(maxsize=1024)
def _default_tiled_launch(
    rows: int, n: int, k: int, group_size: int, num_sms: int, partial_elems: int, max_tiles: int
) -> TiledW4Config:
    """`tiled_w4_config` for M's power-of-two bucket `rows`, with fewer K splits where the workspace
    cannot stage the bucket's partials; cached, since eager prefills call this per layer (the host's time
    per call is what short prefills wait on)."""
    cfg = tiled_w4_config(rows, n, k, group_size, num_sms)
    padded = -(-rows // cfg.block_m) * cfg.block_m
    tiles = -(-n // cfg.block_n) * padded // cfg.block_m
    while cfg.split_k > 1 and (cfg.split_k * padded * n > partial_elems or tiles > max_tiles):
        cfg = replace(cfg, split_k=cfg.split_k // 2)
    return cfg


def w4_tiled_matmul(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    ws: GemvWorkspace,
    config: TiledW4Config | None = None,
    half_decode: bool = False,
) -> torch.Tensor:
    """`x @ W.T + bias` for x [M, K] bf16/fp16 and an int4 weight with integer zero points in groups of
    64-256 (AWQ, GPTQ, RTN: `row_gemv.w4_row_supported`), through `_w4_tiles_kernel`: the 2-128 rows
    between the batch-1 GEMV and dequantize-then-cuBLAS (`PackedLinearMethod.tiled_min_m`, `tiled_max_m`).
    `half_decode`: decode in packed fp16 math where x and the scales are fp16 (nibble dots only; the same
    weights bit for bit; `PackedLinearMethod.tiled_half_decode`)."""
    m, k = x.shape
    n, wk = weight.shape
    if wk != k or weight.bits != 4 or weight.mins is not None or weight.group_size not in (64, 128, 256):
        raise ValueError(
            f"w4_tiled_matmul needs an int4 weight with zero points in groups of 64-256 and x [M, {wk}], got "
            f"{weight.bits}-bit groups of {weight.group_size} and x {tuple(x.shape)}"
        )
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"w4_tiled_matmul takes bf16/fp16 activations, not {x.dtype}")
    cfg = config
    if cfg is None:  # M's power-of-two bucket
        workspace = (ws.num_sms, ws.partials.numel(), ws.counters.numel())
        cfg = _default_tiled_launch(1 << max(m - 1, 0).bit_length(), n, k, weight.group_size, *workspace)
    group_w, kw = weight.group_size // 8, k // 8
    if group_w % cfg.block_w or kw % cfg.block_w:
        raise ValueError(f"tiles of {cfg.block_w} words must divide groups of {group_w} and rows of {kw}")
    if cfg.nibble_dots and cfg.block_w < 16:
        raise ValueError(f"nibble dots multiply K = {cfg.block_w} per dot; tl.dot needs 16 (16-word tiles)")
    if cfg.nibble_dots:  # K 8r + 4h + p to 2 BLOCK_W p + 2r + h in each tile: one copy of the small x
        tiles = (k // (8 * cfg.block_w), cfg.block_w, 2, 4)
        if weight.perm is None:
            x = x.view(m, *tiles).permute(0, 1, 4, 2, 3).reshape(m, k)
        else:  # act-order: the tile order composed with the weight's K order, so x is gathered once
            x = x.index_select(1, weight.perm.view(tiles).permute(0, 3, 1, 2).reshape(k))
    elif weight.perm is not None:  # act-order: the weight's K is stored grouped; gather x to match
        x = x.index_select(1, weight.perm)
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    n_tiles, m_tiles = -(-n // cfg.block_n), -(-m // cfg.block_m)
    ws.check(cfg.split_k, m_tiles * cfg.block_m, n, n_tiles * m_tiles, cfg)
    zeros = weight.zeros if weight.zeros is not None else weight.scales  # a dummy for constant zero points
    _w4_tiles_kernel[(n_tiles, cfg.split_k, m_tiles)](
        x,
        weight.qweight,
        weight.scales,
        zeros,
        bias if bias is not None else weight.scales,
        y,
        ws.partials,
        ws.counters,
        m,
        n,
        kw,
        x.stride(0),
        weight.qweight.stride(0),
        weight.scales.stride(0),
        y.stride(0),
        ZERO_POINT=weight.zero_point,
        ZERO_MODE=ZERO_TENSOR if weight.zeros is not None else ZERO_CONST,
        HAS_BIAS=bias is not None,
        GROUP_W=group_w,
        SPLIT_K=cfg.split_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_W=cfg.block_w,
        NIBBLE_DOTS=cfg.nibble_dots,
        HALF_DECODE=half_decode and cfg.nibble_dots and x.dtype == weight.scales.dtype == torch.float16,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y


@triton.jit
def _w4_dequant_kernel(
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    N,
    stride_qn,
    stride_sn,
    stride_on,
    ZERO_POINT: tl.constexpr,
    ZERO_MODE: tl.constexpr,
    GROUP_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """W[n, k] = (q - z) * s for one [BLOCK_N, group] tile, computed in fp32 and rounded once (as
    `formats.layout.dequantize`), written in K order: the eight nibble planes are interleaved back."""
    pid_n = tl.program_id(0)
    g = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, GROUP_W)
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    words = tl.load(qw_ptr + rn64[:, None] * stride_qn + (g * GROUP_W + rj)[None, :], mask=n_ok[:, None])
    s = tl.load(s_ptr + rn64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if ZERO_MODE == 1:
        z = tl.load(z_ptr + rn64 * stride_sn + g, mask=n_ok, other=0).to(tl.float32)[:, None]
    else:
        z = ZERO_POINT
    ty = out_ptr.dtype.element_ty
    w0 = ((((words >> 0) & 0xF).to(tl.float32) - z) * s).to(ty)
    w1 = ((((words >> 4) & 0xF).to(tl.float32) - z) * s).to(ty)
    w2 = ((((words >> 8) & 0xF).to(tl.float32) - z) * s).to(ty)
    w3 = ((((words >> 12) & 0xF).to(tl.float32) - z) * s).to(ty)
    w4 = ((((words >> 16) & 0xF).to(tl.float32) - z) * s).to(ty)
    w5 = ((((words >> 20) & 0xF).to(tl.float32) - z) * s).to(ty)
    w6 = ((((words >> 24) & 0xF).to(tl.float32) - z) * s).to(ty)
    w7 = ((((words >> 28) & 0xF).to(tl.float32) - z) * s).to(ty)
    # join adds a trailing axis, innermost last: t[n, j, a, b, c] = w[4a + 2b + c][n, j], i.e. column 8j + i
    t = tl.join(
        tl.join(tl.join(w0, w4), tl.join(w2, w6)),
        tl.join(tl.join(w1, w5), tl.join(w3, w7)),
    )
    cols = g * GROUP_W * 8 + tl.arange(0, GROUP_W * 8)
    out = out_ptr + rn64[:, None] * stride_on + cols[None, :]
    tl.store(out, tl.reshape(t, (BLOCK_N, GROUP_W * 8)), mask=n_ok[:, None])


def dequantize_int4(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype`, stored column order (act-order weights stay permuted), bit-identical to
    `formats.layout.dequantize(weight, dtype, original_order=False)`: the prefill path of int4 weights,
    where a cuBLAS GEMM on the dequantized weight beats converting every code once per 64-row M tile.
    Takes int4 weights with integer zero points (`row_gemv.w4_row_supported`)."""
    n, k = weight.shape
    group_words = weight.group_size // 8
    out = torch.empty(n, k, dtype=dtype, device=weight.qweight.device)
    block_n = max(1, 2048 // group_words)
    zeros = weight.zeros if weight.zeros is not None else weight.scales
    _w4_dequant_kernel[(triton.cdiv(n, block_n), k // weight.group_size)](
        weight.qweight,
        weight.scales,
        zeros,
        out,
        n,
        weight.qweight.stride(0),
        weight.scales.stride(0),
        out.stride(0),
        ZERO_POINT=weight.zero_point,
        ZERO_MODE=ZERO_TENSOR if weight.zeros is not None else ZERO_CONST,
        GROUP_W=group_words,
        BLOCK_N=block_n,
        num_warps=4,
    )
    return out
