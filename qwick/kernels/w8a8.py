"""W8A8 kernels on the GPU, in Triton (the reference is `W8A8LinearMethod.apply_reference`).

Block-scaled FP8 GEMM (the DeepSeek / Qwen3-FP8 recipe):

    y[m, n] = sum over K blocks kb of (xq[m, kb] . wq[n, kb]) * xs[m, kb] * ws[n // bn, kb]

x is quantized per token and `block_k`-wide group (scales xs [M, K/bk]); W per [bn, bk] block (ws
[N/bn, K/bk]). Each program owns a [BLOCK_M, BLOCK_N] output tile and walks K one scale group at a time:
an fp8 tensor-core dot in fp32, scaled by the two groups' scales, added to the accumulator.
torch's own block-scaled `scaled_mm` (cuBLAS, Hopper) wants scale layouts this does not need to match.

Activation quantization: one launch per matmul (instead of ~8 elementwise torch ops), bit-identical to
`qwick.quantization.w8a8.quantize_per_token` / `quantize_per_token_group` (scale = absmax * fp32(1 / qmax),
IEEE division by it, round half to even, saturate, round-to-nearest casts), so every path quantizes
activations the same way.

Decode-sized matmuls (M <= 16) with per-channel scales do not come here: `qwick.kernels.gemv` streams the
8-bit codes against the unquantized activations (W8A16).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from qwick.kernels.codes import codes_of, inv_qmax
from qwick.kernels.gemv import GemvWorkspace, load_k_tiles, m_tile_split_k_epilogue


@triton.jit
def _block_scaled_mm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    xs_ptr,
    ws_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_xsm,
    stride_wsn,
    GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # == the scale groups' width
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N] of W^T
    xs_ptrs = xs_ptr + rm * stride_xsm
    ws_ptrs = ws_ptr + (rn // GROUP_N) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = rk < K - kb * BLOCK_K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        xs = tl.load(xs_ptrs + kb, mask=m_ok, other=0.0)
        ws = tl.load(ws_ptrs + kb, mask=n_ok, other=0.0)
        # max_num_imprecise_acc=0: Hopper's fp8 tensor-core accumulation is otherwise reduced-precision
        # (Triton's sm_90 default), off by up to ~5% on single elements at these depths.
        acc += tl.dot(x, w, max_num_imprecise_acc=0) * xs[:, None] * ws[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_scaled_mm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """xq [M, K] fp8, xs [M, K/bk] fp32, wq [N, K] fp8, ws [N/bn, K/bk] fp32 -> y [M, N] in `out_dtype`."""
    m, k = xq.shape
    n = wq.shape[0]
    bn, bk = block
    assert wq.shape[1] == k and xq.stride(1) == 1 and wq.stride(1) == 1
    assert xs.shape == (m, triton.cdiv(k, bk)) and ws.shape == (triton.cdiv(n, bn), triton.cdiv(k, bk))
    xs = xs.contiguous()
    ws = ws.contiguous()
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 128 if n >= 128 else 64
    num_warps = 4 if block_m <= 32 else 8
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_scaled_mm_kernel[grid](
        xq,
        wq,
        y,
        xs,
        ws,
        m,
        n,
        k,
        xq.stride(0),
        wq.stride(0),
        y.stride(0),
        xs.stride(0),
        ws.stride(0),
        GROUP_N=bn,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=bk,
        num_warps=num_warps,
        num_stages=3,
    )
    return y


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    GROUP,
    stride_xm,
    stride_qm,
    stride_sm,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    IS_INT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per (row, group of GROUP columns): scale = absmax * (1 / QMAX), codes = x / scale."""
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * GROUP
    end = tl.minimum(start + GROUP, K)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(start, end, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) * INV_QMAX  # as torch's `amax / qmax` on CUDA
    tl.store(s_ptr + row * stride_sm + tl.program_id(1), scale)
    for k in range(start, end, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        ok = offs < end
        x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(q_row + offs, codes_of(x, scale, QMAX, IS_INT).to(q_ptr.dtype.element_ty), mask=ok)


def quantize_rows(
    x: torch.Tensor,
    qdtype: torch.dtype,
    qmax: float,
    min_amax: float,
    group: int | None = None,
    block: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> codes [M, K] and fp32 scales [M, 1] (per token) or [M, ceil(K / group)]. `block` and
    `num_warps` set the launch shape: steps of up to 1024 columns, on 8 warps per token (4 per group). At
    3584 columns on the H200, 2.7 / 3.1 us at 64 / 256 rows against 3.9 / 4.2 on 4 warps, and a tie at
    2048-8192 rows (benchmarks/row_quant_launch.py)."""
    m, k = x.shape
    assert x.stride(1) == 1
    groups = 1 if group is None else triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=qdtype, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    _quantize_rows_kernel[(m, groups)](
        x,
        q,
        s,
        k,
        k if group is None else group,
        x.stride(0),
        q.stride(0),
        s.stride(0),
        QMAX=qmax,
        INV_QMAX=inv_qmax(qmax),
        MIN_AMAX=min_amax,
        IS_INT=qdtype == torch.int8,
        BLOCK=block or min(1024, triton.next_power_of_2(k if group is None else group)),
        num_warps=num_warps or (8 if group is None else 4),
    )
    return q, s


@triton.jit(do_not_specialize=["M"])  # M is no constant; SPLIT_K gives 2 variants per layer
def _rowwise_fp8_mm_kernel(
    x_src,
    w_src,
    xs_ptr,
    wscale_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PROMOTE_K: tl.constexpr,
    TMA: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of (xq @ wq^T) * xs * ws (+ b), K split over SPLIT_K programs whose
    partials `m_tile_split_k_epilogue` reduces (each row tile with its own partials and counters). x_src
    and w_src are the codes' pointers, or with TMA their tensor descriptors (Hopper's bulk copies into
    shared memory: no address arithmetic per element, and zeros past the last row and column)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2).to(tl.int64)  # offsets below: M * N may pass 2^31
    rm = tl.arange(0, BLOCK_M)  # rows within the tile
    rows = pid_m * BLOCK_M + rm
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rows < M
    n_ok = rn < N
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        row0 = (pid_m * BLOCK_M).to(tl.int32)
        col0 = pid_n * BLOCK_N
    else:
        w_rows = w_src + rn.to(tl.int64)[:, None] * stride_wn
        x_rows = x_src + rows.to(tl.int64)[:, None] * stride_xm
    for k in range(k_start, k_end, BLOCK_K):
        if TMA:  # a split's steps never cross its end but at K, where the copy fills zeros
            x = x_src.load([row0, k])
            w = w_src.load([col0, k])
        else:
            w, x = load_k_tiles(w_rows, x_rows, k + rk, k_end, n_ok, m_ok, EVEN_K)
        # Hopper's fp8 tensor cores accumulate below fp32 precision: promote into the fp32 accumulator every
        # PROMOTE_K products of K. 0 (promote always) would also be exact, but Triton then gives up wgmma and
        # upcasts to fp16 mma.sync (seen in the sm_90 PTX), which defeats the point of this kernel. 128 agrees
        # with cuBLAS's exact accumulation to 2e-5 (32: 7e-4, its bf16 rounding), and was as fast or faster
        # on 7b's down projection: 31.1 / 33.1 / 42.5 us at 17 / 64 / 128 rows against 35.5 / 33.0 / 43.9.
        if PROMOTE_K == 0:  # never (fast accumulation): only to measure what promoting costs
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE_K)
    xs = tl.load(xs_ptr + rows, mask=m_ok, other=0.0)
    wscale = tl.load(wscale_ptr + rn, mask=n_ok, other=0.0)
    acc = acc * xs[:, None] * wscale[None, :]
    m_tile_split_k_epilogue(
        acc,
        b_ptr,
        y_ptr,
        part_ptr,
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
class RowwiseConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    promote_k: int = 128  # products of K summed in the tensor cores' own precision before each fp32 add
    # (at most block_k; 0: never)
    tma: bool = False  # load the tiles through tensor descriptors (TMA)


def rowwise_config(m: int, n: int, k: int, workspace: GemvWorkspace) -> RowwiseConfig:
    """Up to 64 rows, 64 x 64 output tiles over K in 256-wide steps, three stages (the best of 40-112
    launch shapes on the H200 at qwen2.5-7b's down projection for M = 32 and 64). Beyond, 64 x 128 tiles
    over K in 128-wide steps, four stages, loaded through tensor descriptors (TMA) where K allows, K split
    4 / 3 / 2 ways up to 128 / 192 / 256 rows: in CUDA graphs 32.4 / 41.4 / 47.5 us at 128 / 192 / 256
    rows against cuBLAS's 47.2 / 47.5 / 49.2 and plain loads' 35.8 / 44.3 / 53.4
    (`benchmarks/rowwise_launch_diag.py`; an eager call costs the host 40-115 us, more with descriptors,
    so eager timings such as `benchmarks/fp8_mid_m_sweep.py`'s measure the host). Each split shrinks until
    the shared split-K workspace holds the partials."""
    if m <= 64:
        block_m, block_n, block_k, stages, split, tma = 64, 64, 256, 3, 4, False
    else:
        block_m, block_n, block_k, stages, tma = 64, 128, 128, 4, k % 16 == 0
        split = 4 if m <= 128 else 3 if m <= 192 else 2
    tiles_m = triton.cdiv(m, block_m)
    tiles = tiles_m * triton.cdiv(n, block_n)
    while split > 1 and not workspace.fits(split, tiles_m * block_m, n, tiles):
        split -= 1
    return RowwiseConfig(block_m, block_n, block_k, split, 4, stages, tma=tma)


def rowwise_fp8_mm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    wscale: torch.Tensor,
    bias: torch.Tensor | None,
    workspace: GemvWorkspace,
    out_dtype: torch.dtype,
    config: RowwiseConfig | None = None,
) -> torch.Tensor:
    """(xq [M, K] @ wq [N, K]^T) * xs [M, 1] * wscale [N, 1] (+ bias), fp8 codes on both sides, fp32 sums.

    For row counts between the skinny GEMV's 16 and a few hundred: cuBLAS's `_scaled_mm` tiles such a
    product 128 x 128 without splitting K, which leaves most SMs idle on the narrow layers (a 3584-wide
    output at M = 256 is 56 tiles for 132 SMs); here K is split so that every SM streams."""
    m, k = xq.shape
    n = wq.shape[0]
    assert wq.shape[1] == k and xq.stride(1) == 1 and wq.stride(1) == 1
    assert xs.numel() == m and wscale.numel() == n
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    tma_ok = not any(v % 16 for v in (k, xq.stride(0), wq.stride(0), xq.data_ptr(), wq.data_ptr()))
    cfg = config or rowwise_config(m, n, k, workspace)
    if config is None and cfg.tma and not tma_ok:  # e.g. codes viewed out of a wider buffer: plain loads
        cfg = replace(cfg, tma=False)
    tiles_m, tiles_n = triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n)
    workspace.check(cfg.split_k, tiles_m * cfg.block_m, n, tiles_m * tiles_n, f"{cfg} (M={m})")
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    x_src, w_src = xq, wq
    if cfg.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if not tma_ok:
            raise ValueError(f"TMA loads need 16-byte aligned rows of whole 16-byte units, not K={k}")

        x_src = TensorDescriptor.from_tensor(xq, [cfg.block_m, cfg.block_k])
        w_src = TensorDescriptor.from_tensor(wq, [cfg.block_n, cfg.block_k])
    _rowwise_fp8_mm_kernel[(tiles_n, cfg.split_k, tiles_m)](
        x_src,
        w_src,
        xs,
        wscale,
        bias if bias is not None else wscale,
        y,
        workspace.partials,
        workspace.counters,
        m,
        n,
        k,
        xq.stride(0),
        wq.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        SPLIT_K=cfg.split_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_K=k % k_per_split == 0 and k_per_split % cfg.block_k == 0,
        PROMOTE_K=cfg.promote_k,
        TMA=cfg.tma,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y
