"""Skinny GEMM (`y = x @ W.T + b` for x with at most 16 rows): the decode-step matmul, on the GPU.

At batch 1-16 a decode step is bound by reading the weights once from HBM; cuBLAS reaches ~3.3 TB/s on the
7B layer shapes at M=1, against ~4.3 TB/s that a plain copy reaches. This kernel streams W in
[BLOCK_N, BLOCK_K] tiles with several loads in flight and multiplies by the (padded to 16) activation rows
on the tensor cores (`tl.dot`): the arithmetic is free, only the weight bytes count.

When N / BLOCK_N programs are too few to keep every SM streaming (the 3584-wide outputs of a 7B model),
K is split over SPLIT_K programs per output tile. The split partials go to an fp32 workspace and the last
program of a tile to finish (an atomic counter per tile) sums them and writes the output: one launch,
no memset and no separate reduction kernel, and the counter is reset by that program, so the kernel can be
replayed in a CUDA graph.

A launch can start before the kernel before it has ended (programmatic dependent launch,
`qwick.kernels.pdl`): with `preload` each program loads its split's first weight tile before it waits for
that kernel; with `trigger` it lets the next kernel in once each of its programs is past its loop. The
same sums either way (`W8A8LinearMethod.pdl_norm`, on: one decode row's W8A8 GEMVs on activation codes;
+6.0-6.2% at batch 1 on an H100, 39th session).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qwick.kernels.codes import code_buffers, codes_of
from qwick.kernels.half2 import _EMULATE
from qwick.kernels.pdl import pdl_supported, pdl_trigger, pdl_wait
from qwick.kernels.swiglu import silu_times
from qwick.layers.linear import QuantizedRows, RowQuant

MAX_M = 16  # rows handled by these kernels; larger batches go to cuBLAS
# The 8-bit GEMVs may read their weight scales before the wait of an early launch (or before the loop) and
# the activations' per-row scales right after the wait, instead of past the loop: in the sm_90 PTX (Triton
# 3.6, compiled offline) those loads come after the last tile, a dependent trip to memory in the tail of
# every program. The same products, but no faster: batch 1 on one H100 (43rd session, BENCHMARKS.md), fp8
# 329.3 / 329.8 / 329.3 decode tok/s with it against 330.3 / 329.6 / 329.7 without, int8 324.3 / 324.1 /
# 324.3 against 326.5 / 325.7 / 325.8 (-0.6%; gate/up's registers go 80 -> 96). It was removed in the
# 52nd session (`SCALES_FIRST`, commit 9d433fe has it).
# The down projection's activation scales (one per 512 columns) were also read a tile ahead of their use in
# the 44th session: the scale's load sat right before the FMAs that apply it in the PTX, but no gain on an
# H200 (45th session, batch 1: fp8 422.4 against 422.8 and 423.3, int8 417.4 against 416.3), so it went.


@triton.jit(do_not_specialize=["M"])  # one variant for every batch size: none compiles mid-serving
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    xs_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    amax_ptr,
    q_ptr,
    qs_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_xs,
    stride_am,
    stride_q,
    stride_qs,
    HAS_SCALE: tl.constexpr,
    X_CODES: tl.constexpr,
    X_GROUP: tl.constexpr,
    INT_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr = False,
    PRELOAD: tl.constexpr = False,
    TRIGGER: tl.constexpr = False,
    TRIGGER_START: tl.constexpr = False,
    CODES_GROUP: tl.constexpr = 0,
    QMAX: tl.constexpr = 0.0,
    INV_QMAX: tl.constexpr = 0.0,
    MIN_AMAX: tl.constexpr = 0.0,
    IS_INT: tl.constexpr = False,
):
    """GATED (one split): W is a [gate | up] weight of N rows, each tile's first half gate rows and its
    second half the up rows of the same outputs, and y [M, N / 2] is silu(gate) * up (`gated_store`).
    PRELOAD (launched early, `qwick.kernels.pdl`): the split's first weight tile is loaded before
    `pdl_wait`, and its product is the loop's first; TRIGGER: `pdl_trigger` once past the loop, or with
    TRIGGER_START at the program's start. CODES_GROUP (GATED): each tile also writes the absmax of its
    BLOCK_N / 2 outputs of every row (`amax_ptr`, scratch [M, N / BLOCK_N]), and the last tile of each
    CODES_GROUP outputs to finish writes their codes (`q_ptr`) and scales (`qs_ptr`; `_group_codes_tail`)."""
    if TRIGGER_START and not _EMULATE:
        pdl_trigger()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    if GATED:
        rn, n_ok = gated_rows(pid_n, N, BLOCK_N)
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if INT_DOT and X_GROUP == 0 else tl.float32)
    k_loop = k_start
    # PRELOAD: the weights (and their scales) before the wait; the activations (and theirs) after it. (The
    # preloaded tile's products added past the loop, so that the pipeline's first loads issue right after
    # the wait, lost 8-10% of fp8 batch 1 on an H100 (45th session): its registers, held through the loop.)
    if PRELOAD:
        w = load_w_tile(w_rows, k_start + rk, k_end, n_ok, EVEN_K)
    if PRELOAD and not _EMULATE:
        pdl_wait()
    xs_rows = xs_ptr + rm * stride_xs  # each row's activation scales
    if PRELOAD:
        x = load_x_tile(x_rows, k_start + rk, k_end, m_ok, EVEN_K)
        acc = _accumulate(acc, x, w, xs_rows, m_ok, k_start, X_CODES, X_GROUP, INT_DOT)
        k_loop = k_start + BLOCK_K
    for k in range(k_loop, k_end, BLOCK_K):
        w, x = load_k_tiles(w_rows, x_rows, k + rk, k_end, n_ok, m_ok, EVEN_K)
        acc = _accumulate(acc, x, w, xs_rows, m_ok, k, X_CODES, X_GROUP, INT_DOT)
    if TRIGGER and not TRIGGER_START and not _EMULATE:  # the next kernel may launch once every program
        pdl_trigger()  # is past its loop
    acc = acc.to(tl.float32)
    if HAS_SCALE:  # per-output-channel scales of 8-bit weights
        acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if X_CODES and X_GROUP == 0:  # per-row scales of the activation codes
        acc *= tl.load(xs_ptr + rm * stride_xs, mask=m_ok, other=0.0)[:, None]
    if GATED:
        act = gated_store(
            acc, b_ptr, y_ptr, rm, rn, m_ok, n_ok, pid_n, N, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N
        )  # fmt: skip
        if CODES_GROUP > 0:
            outs = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            act = tl.where((outs < N // 2)[None, :], tl.abs(act.to(tl.float32)), 0.0)
            tl.store(amax_ptr + rm * stride_am + pid_n, tl.max(act, axis=1), mask=m_ok)
            _group_codes_tail(
                y_ptr, amax_ptr, q_ptr, qs_ptr, counter_ptr, M, pid_n, N // 2, stride_ym, stride_am,
                stride_q, stride_qs, BLOCK_N // 2, CODES_GROUP, QMAX, INV_QMAX, MIN_AMAX, IS_INT,
            )  # fmt: skip
    else:
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


@triton.jit
def gated_rows(pid_n, N, BLOCK_N: tl.constexpr):
    """Tile pid_n's rows of a [gate | up] weight of N rows, and which are in range: BLOCK_N / 2 gate rows,
    then the up rows of the same outputs (N / 2 further on)."""
    r = tl.arange(0, BLOCK_N)
    outs = pid_n * (BLOCK_N // 2) + r % (BLOCK_N // 2)  # the output each row feeds
    return outs + (r // (BLOCK_N // 2)) * (N // 2), outs < N // 2


@triton.jit
def gated_store(
    acc,
    b_ptr,
    y_ptr,
    rm,
    rn,
    m_ok,
    n_ok,
    pid_n,
    N,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A whole-K tile of `gated_rows` (acc [BLOCK_M, BLOCK_N]): its gate and up sums (+ bias) rounded to
    y's dtype, as the plain epilogue stores them, then silu(gate) * up of its BLOCK_N / 2 outputs as
    `silu_and_mul` computes it, stored and returned ([BLOCK_M, BLOCK_N / 2])."""
    HALF: tl.constexpr = BLOCK_N // 2
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    gate, up = tl.split(tl.permute(tl.reshape(y, (BLOCK_M, 2, HALF)), (0, 2, 1)))  # columns r, HALF + r
    act = silu_times(gate, up)
    outs = pid_n * HALF + tl.arange(0, HALF)
    mask = m_ok[:, None] & (outs < N // 2)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + outs[None, :], act, mask=mask)
    return act


@triton.jit
def _group_codes_tail(
    y_ptr,
    amax_ptr,
    q_ptr,
    qs_ptr,
    counter_ptr,
    M,
    pid_n,
    N_OUT,
    stride_ym,
    stride_am,
    stride_q,
    stride_qs,
    HALF: tl.constexpr,
    GROUP: tl.constexpr,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    IS_INT: tl.constexpr,
):
    """The gated tile pid_n (HALF outputs, its absmax written) counts itself in its group of GROUP outputs;
    the group's last tile to arrive reads the group's absmax and outputs back and writes their codes and
    scale, as `silu_and_mul_quant` with groups does (the same bits), then resets the group's counter."""
    TILES: tl.constexpr = GROUP // HALF
    g = pid_n // TILES
    all_tiles = tl.cdiv(N_OUT, HALF)
    tl.debug_barrier()  # every thread's outputs and absmax are written before the release below
    done = tl.atomic_add(counter_ptr + g, 1, sem="acq_rel", scope="gpu")
    if done == tl.minimum(TILES, all_tiles - g * TILES) - 1:  # row by row: few registers held for it
        t = g * TILES + tl.arange(0, TILES)
        cols = g * GROUP + tl.arange(0, GROUP)
        for r in range(0, M):
            amax = tl.load(amax_ptr + r * stride_am + t, mask=t < all_tiles, other=0.0, cache_modifier=".cg")
            scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) * INV_QMAX
            ok = cols < N_OUT
            h = tl.load(y_ptr + r * stride_ym + cols, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(qs_ptr + r * stride_qs + g, scale)
            codes = codes_of(h.to(tl.float32), scale, QMAX, IS_INT)
            tl.store(q_ptr + r * stride_q + cols, codes.to(q_ptr.dtype.element_ty), mask=ok)
        tl.atomic_xchg(counter_ptr + g, 0, sem="relaxed", scope="gpu")


@triton.jit
def _accumulate(
    acc,
    x,
    w,
    xs_rows,
    m_ok,
    k,
    X_CODES: tl.constexpr,
    X_GROUP: tl.constexpr,
    INT_DOT: tl.constexpr,
):
    """`acc` plus the products of the activation tile x and the weight tile w at column k (`xs_rows`: each
    row's activation scales, with X_GROUP one per X_GROUP columns)."""
    if X_CODES and X_GROUP > 0:  # W8A8 with a scale per X_GROUP columns: scale each tile's sums
        part = tl.dot(x, tl.trans(w), out_dtype=tl.int32 if INT_DOT else tl.float32)
        xs = tl.load(xs_rows + k // X_GROUP, mask=m_ok, other=0.0)
        acc += part.to(tl.float32) * xs[:, None]
    elif X_CODES:  # W8A8: both operands are codes of one 8-bit type, multiplied as they are
        acc = tl.dot(x, tl.trans(w), acc, out_dtype=acc.dtype)
    else:
        # 8-bit codes are converted to x's dtype in registers (exact). Measured on the H200: this order
        # beats y^T = W x^T (codes as the register operand) by 20-30% at fp8 and ties at int8.
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    return acc


@triton.jit
def load_w_tile(w_rows, kk, k_end, n_ok, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at columns `kk` of the rows `w_rows` points at (K masked only
    where the split's end may cut a tile)."""
    mask = n_ok[:, None]
    if not EVEN_K:
        mask = mask & (kk < k_end)[None, :]
    return tl.load(w_rows + kk[None, :], mask=mask, other=0.0)


@triton.jit
def load_x_tile(x_rows, kk, k_end, m_ok, EVEN_K: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] activation tile at columns `kk`, masked as `load_w_tile`."""
    mask = m_ok[:, None]
    if not EVEN_K:
        mask = mask & (kk < k_end)[None, :]
    return tl.load(x_rows + kk[None, :], mask=mask, other=0.0)


@triton.jit
def load_k_tiles(w_rows, x_rows, kk, k_end, n_ok, m_ok, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile and [BLOCK_M, BLOCK_K] activation tile at columns `kk` of the
    rows `w_rows` / `x_rows` point at (K masked only where the split's end may cut a tile)."""
    return load_w_tile(w_rows, kk, k_end, n_ok, EVEN_K), load_x_tile(x_rows, kk, k_end, m_ok, EVEN_K)


@triton.jit
def split_k_epilogue(
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
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Write the tile (+ bias); with split-K, stage the partial and let the tile's last program reduce."""
    out_mask = m_ok[:, None] & n_ok[None, :]
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        # workspace layout: [SPLIT_K, BLOCK_M, N] fp32
        ws_tile = ws_ptr + rm[:, None] * N + rn[None, :]
        tl.store(ws_tile + pid_k * BLOCK_M * N, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:  # the last split of this tile: reduce and publish
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(ws_tile + s * BLOCK_M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def m_tile_split_k_epilogue(
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
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """`split_k_epilogue` for M tile `pid_m` of a grid with M tiles on axis 2 and output tiles on axis 0:
    each M tile has its own partials ([SPLIT_K, BLOCK_M, N]) and counters; `rm` are the rows inside it."""
    split_k_epilogue(
        acc,
        b_ptr,
        y_ptr + pid_m * BLOCK_M * stride_ym,
        ws_ptr + pid_m * (SPLIT_K * BLOCK_M * N),
        counter_ptr + pid_m * tl.num_programs(0),
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


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def default_config(m: int, n: int, k: int, num_sms: int, w_bytes: int = 2, codes: bool = False) -> GemvConfig:
    """The launch shape for an [m, k] x [n, k]^T product, from a sweep on the H200 (benchmarks/gemv_sweep.py).

    The landscape is flat (the best of 48 shapes within 1-3% of these picks, on every qwen2.5-7b and -14b
    layer shape at M = 1..16): wide outputs stream 32-64 rows per program over the whole K; narrow outputs
    (a 3584-5120 hidden size) with a long K split it 4 ways so that enough programs stream at once.
    1-byte (fp8 / int8) weights against 16-bit activations: in CUDA graphs the LM head streams 4.06 TB/s
    in int8 and 3.29 in fp8 at the same launch shape (benchmarks/b1_gemv_graph_sweep.py), so fp8's
    conversion to bf16 (through fp16) does cost there. A CUDA-core variant without tensor cores or
    shared memory, `qwick.kernels.row_gemv_w8`, takes fp8's one-row o projection instead (7.6 against 8.8
    us in CUDA graphs; `W8A8LinearMethod.row_gemv_max_n`, BENCHMARKS.md).
    """
    if codes:  # 8-bit codes times 8-bit activation codes (benchmarks/w8a8_gemv_sweep.py, M = 1): 64 x 256
        # tiles, three stages, within 2% of the best of 12-36 launch shapes on every 7b layer (fp8 and int8).
        # 41st session, H100, graph-timed (`CONFIGS=... benchmarks/b1_gemv_graph_sweep.py`): splits that
        # are not powers of two (down 5-7, 10, 12; qkv 3, 5, 7) gained nothing, and gate/up's 0.7-1.5% with
        # four stages alone turned into -0.5% (int8) and -1.1% (fp8) of batch-1 decode in the engine.
        return GemvConfig(64, 256, 1 if n >= 16384 else (8 if k >= 12288 else 4), num_stages=3)
    if w_bytes == 1:  # fp8 / int8 codes against 16-bit activations (the o projection and LM head at batch 1)
        # Timed in CUDA graphs over L2-overflowing weight copies (benchmarks/b1_gemv_graph_sweep.py, H200,
        # fp8, 7b shapes): the LM head in 64 x 128 tiles 165.3 us against 175.0 in 32 x 256; o split 8 ways
        # in 32 x 128 tiles 8.9 against 9.6 split 4 in 32 x 256 (BENCHMARKS.md, twenty-fourth session).
        if n >= 16384:
            return GemvConfig(64, 128, 1, num_stages=4)
        if k >= 12288:
            return GemvConfig(32, 256, 8, num_stages=3)
        return GemvConfig(32, 128, 8, num_stages=4)
    if n >= 65536:  # LM heads
        return GemvConfig(64, 256, 1, num_stages=3)
    if n >= 16384:  # gate/up projections
        return GemvConfig(32, 128, 1, num_stages=3)
    if k >= 12288 and triton.cdiv(n, 64) < 2 * num_sms:  # down projections
        return GemvConfig(64, 128, 4, num_stages=3)
    return GemvConfig(64, 256, 1, num_stages=4)


def gated_config(ws: GemvWorkspace, m: int, n: int, k: int) -> GemvConfig | None:
    """The launch of a gated bf16/fp16 GEMV (`gemv(..., gated=True)`) on a [gate | up] weight of n rows:
    the plain one (the same grid: each tile half gate rows, half up rows), when it has one split (every
    gate/up projection of at least 16,384 rows); None otherwise."""
    cfg = ws.config_for(m, n, k)
    return cfg if cfg.split_k == 1 else None


def split_k_for(tiles: int, k_tiles: int, num_sms: int) -> int:
    """K splits for a skinny matmul of `tiles` output tiles over `k_tiles` tiles of K: double until about
    four programs per SM are streaming, as long as every split keeps at least two tiles of K."""
    split = 1
    while tiles * split < 4 * num_sms and k_tiles // (split * 2) >= 2:
        split *= 2
    return split


class GemvWorkspace:
    """The split-K scratch shared by every skinny matmul of a model (calls on one stream never overlap).

    Counters start at zero and each tile's last program resets its own, so the buffers are allocated once
    (before CUDA-graph capture) and reused forever.
    """

    def __init__(self, device: torch.device, max_elems: int = 1 << 23, max_tiles: int = 1 << 16) -> None:
        self.partials = torch.empty(max_elems, dtype=torch.float32, device=device)
        self.counters = torch.zeros(max_tiles, dtype=torch.int32, device=device)
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.configs: dict[tuple[int, int, int, int, bool], GemvConfig] = {}

    def fits(self, split_k: int, rows: int, n: int, tiles: int) -> bool:
        """Whether a launch with `split_k` splits can stage its partials here: `rows` partial rows of width
        `n` per split, and one counter for each of `tiles` output tiles (the last counter is
        `tail_counter`'s). One split stages nothing."""
        if split_k == 1:
            return True
        return split_k * rows * n <= self.partials.numel() and tiles < self.counters.numel()

    @property
    def tail_counter(self) -> torch.Tensor:
        """The arrival counter of a launch's last-program tail (`qwick.kernels.elementwise.rms_norm_tail`):
        the last of `counters`, which no output tile's counter reaches (`fits`); reset by its user."""
        return self.counters[-1:]

    def check(self, split_k: int, rows: int, n: int, tiles: int, what: object) -> None:
        """`fits`, or a ValueError naming the launch `what`."""
        if not self.fits(split_k, rows, n, tiles):
            raise ValueError(f"split-K workspace too small for {what} at N={n}")

    def config_for(self, m: int, n: int, k: int, w_bytes: int = 2, codes: bool = False) -> GemvConfig:
        key = (triton.next_power_of_2(m), n, k, w_bytes, codes)
        cfg = self.configs.get(key)
        if cfg is None:
            cfg = self.configs[key] = default_config(key[0], n, k, self.num_sms, w_bytes, codes)
        return cfg


_SHARED_WORKSPACES: dict[torch.device, GemvWorkspace] = {}


def shared_workspace(device: torch.device) -> GemvWorkspace:
    """The one split-K scratch of a GPU, shared by every skinny matmul on it (bf16, W8A8, W4A16): calls on
    one stream never overlap, and the self-resetting counters need no per-user state. Made when weights are
    processed, before CUDA-graph capture, never inside it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device(device.type, index)
    if device not in _SHARED_WORKSPACES:
        _SHARED_WORKSPACES[device] = GemvWorkspace(device)
    return _SHARED_WORKSPACES[device]


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ws: GemvWorkspace,
    config: GemvConfig | None = None,
    weight_scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    x_group: int | None = None,
    gated: bool = False,
    preload: bool = False,
    trigger: bool = False,
    trigger_at_start: bool = False,
    out_quant: RowQuant | None = None,
) -> torch.Tensor | QuantizedRows:
    """`x @ weight.T + bias` for x [M <= 16, K] (unit stride along K), weight [N, K] contiguous.

    `gated`: weight is a [gate | up] pair of N / 2 rows each (the packed gate/up projection), and the
    result [M, N / 2] is silu(gate) * up, bit for bit `silu_and_mul` of the plain result, from the
    GEMV's own epilogue (one split, tiles of whole K: `gated_config`).

    `weight_scale` (fp32, one per output channel): `weight` holds fp8 / int8 codes, and the result is
    `(x @ codes.T) * weight_scale.T + bias`. This is W8A16: at decode sizes reading the 8-bit weights is
    the whole cost, and leaving the activations unquantized saves a quantization launch per layer.

    `x_scale` (fp32 [M, 1]): x holds codes of the weight's 8-bit type too (W8A8), the result is
    `(codes_x @ codes.T) * x_scale * weight_scale.T + bias` in `out_dtype`, with int8 sums exact in int32.
    With `x_group`, x_scale is [M, ceil(K / x_group)], one scale per group of columns (a multiple of the
    launch's tile depth), applied to each tile's sums.

    `preload`: each split's first weight tile is loaded before the kernel waits for the one before it,
    launched early where the device has programmatic dependent launch (`qwick.kernels.pdl`); `trigger`:
    the next kernel may launch once this one's programs are past their loops (with `trigger_at_start`,
    once they have started: for a next kernel of a few programs that loads before it waits, as decode
    attention with `DECODE_PRELOAD`). The same sums either way.

    `out_quant` (gated, with a `group` that the tiles' block_n / 2 outputs divide): the result comes with
    its codes and scales per group (`QuantizedRows`), the bits `silu_and_mul_quant` writes; the last tile
    of each group to finish writes them, so no launch of its own is needed."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_M and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    if x_scale is None:
        assert (weight_scale is None) == (weight.dtype == x.dtype), "8-bit weights need their scales"
        out_dtype = x.dtype
    else:
        groups = 1 if x_group is None else triton.cdiv(k, x_group)
        assert weight_scale is not None and x.dtype == weight.dtype and x_scale.shape == (m, groups)
        assert x_scale.dtype == torch.float32 and (groups == 1 or x_scale.stride(1) == 1)
        assert out_dtype is not None, "W8A8 needs the output dtype"
    assert weight_scale is None or weight_scale.numel() == n
    y = torch.empty((m, n // 2 if gated else n), dtype=out_dtype, device=x.device)
    if m == 0:
        return y if out_quant is None else QuantizedRows(y, *code_buffers(y, out_quant)[:2], out_quant.group)
    cfg = config or ws.config_for(m, n, k, weight.element_size(), x_scale is not None)
    if gated and (cfg.split_k != 1 or cfg.block_n % 2 or n % 2):
        raise ValueError(f"a gated GEMV needs one split and an even [gate | up] weight: {cfg}, N={n}")
    if x_group is not None and x_group % cfg.block_k:
        raise ValueError(f"activation scale groups of {x_group} columns need tiles that divide them: {cfg}")
    tiles = triton.cdiv(n, cfg.block_n)
    ws.check(cfg.split_k, MAX_M, n, tiles, cfg)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    preload = preload and (cfg.split_k - 1) * k_per_split < k  # every split has a first tile
    codes, scales, meta = y, y, {}
    amax = None
    if out_quant is not None:  # the output's codes and scales per group too (`_group_codes_tail`)
        group, half = out_quant.group, cfg.block_n // 2
        if not gated:
            raise ValueError("only a gated GEMV writes its output's codes (out_quant)")
        if group is None or group % half or group & (group - 1):
            raise ValueError(
                f"a gated GEMV's codes in groups of {group}: its tiles of {half} outputs must divide them"
            )
        if triton.cdiv(n // 2, group) > ws.counters.numel():
            raise ValueError(f"too few split-K counters for {n // 2} outputs in groups of {group}")
        codes, scales, meta = code_buffers(y, out_quant)
        amax = torch.empty((m, tiles), dtype=torch.float32, device=x.device)  # scratch: each tile's absmax
    _gemv_kernel[(tiles, cfg.split_k)](
        x,
        weight,
        weight_scale if weight_scale is not None else weight,
        x_scale if x_scale is not None else weight,
        bias if bias is not None else weight,
        y,
        ws.partials,
        ws.counters,
        amax if amax is not None else weight,
        codes,
        scales,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        x_scale.stride(0) if x_scale is not None else 0,
        amax.stride(0) if amax is not None else 0,
        codes.stride(0),
        scales.stride(0),
        HAS_SCALE=weight_scale is not None,
        X_CODES=x_scale is not None,
        X_GROUP=x_group or 0,
        INT_DOT=x_scale is not None and x.dtype == torch.int8,
        HAS_BIAS=bias is not None,
        SPLIT_K=cfg.split_k,
        BLOCK_M=MAX_M,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_K=k % k_per_split == 0 and k_per_split % cfg.block_k == 0,
        GATED=gated,
        PRELOAD=preload,
        TRIGGER=trigger and pdl_supported(x.device),
        TRIGGER_START=trigger and trigger_at_start and pdl_supported(x.device),
        CODES_GROUP=out_quant.group if out_quant is not None else 0,
        **meta,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"launch_pdl": True} if preload and pdl_supported(x.device) else {}),
    )
    return y if out_quant is None else QuantizedRows(y, codes, scales, out_quant.group)
