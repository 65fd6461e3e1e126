"""Batch-1 skinny GEMMs that make their own input: RMSNorm (with the residual add) before QKV and gate/up,
SiLU-and-mul before the down projection, each inside the GEMV that reads it.

At one row those elementwise kernels move a few kilobytes but cost 2-4 us each inside the decode graph
(launch, ramp and drain; 225 us of a 2.7 ms fp8 step at qwen2.5-7b shapes, BENCHMARKS.md). Fused, each
GEMV program computes the part of the input its K tiles need, from the few kilobytes the previous kernel
left in the L2, beside its weight tiles, with nothing before its loop:

- `norm_gemv`: norm(h) @ W^T = rstd * ((h * g) @ W^T) for h = x + residual and the norm weight g, so the
  loop multiplies h * g and sums h^2 over the program's K range; rstd, from every split's sum, scales the
  result where the splits are reduced. The programs of the first output tile also store h, the next
  residual, in a new buffer (the others are still reading the old one).
- `silu_gemv`: SiLU-and-mul per K tile.

With activation codes (W8A8), each K tile's activations become codes at one scale (the tile's absmax over
qmax) and the tile's sums are scaled by it, as the down projection's grouped codes are (groups of BLOCK_K
here, of 512 columns there); the RMSNorm kernel's codes have one scale per row instead.

One row only (M = 1): the activation tile is a vector, broadcast into the 16-row operand of `tl.dot`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qwick.kernels.elementwise import _silu_mul
from qwick.kernels.gemv import MAX_M, GemvConfig, GemvWorkspace, split_k_epilogue
from qwick.kernels.w8a8 import codes_of, inv_qmax
from qwick.layers.linear import RowQuant


@triton.jit
def _residual_sum(x_ptr, res_ptr, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """x (+ residual) at `cols`, rounded to x's dtype as `x + residual` is."""
    h = tl.load(x_ptr + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
    return h


@triton.jit
def _row_operand(v, BLOCK_M: tl.constexpr, dtype: tl.constexpr):
    """The vector v [BLOCK_K] as every row of a [BLOCK_M, BLOCK_K] `tl.dot` operand of `dtype`: only the
    first row of the product is stored, and equal rows cost no selects."""
    return tl.broadcast_to(v.to(dtype)[None, :], (BLOCK_M, v.shape[0]))


@triton.jit
def _tile_dot(
    v,
    w,
    acc,
    BLOCK_M: tl.constexpr,
    CODES: tl.constexpr,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    IS_INT: tl.constexpr,
    x_dtype: tl.constexpr,
):
    """acc + v . w^T for the fp32 activations v [BLOCK_K] of one K tile and its weight tile w [BLOCK_N,
    BLOCK_K]: in x's dtype against 16-bit or (converted) 8-bit weights, or with CODES as codes at one
    scale for the tile (its absmax over QMAX), codes times codes, the sums scaled by it."""
    if CODES:
        tile_scale = tl.maximum(tl.max(tl.abs(v), axis=0), MIN_AMAX) * INV_QMAX
        a = _row_operand(codes_of(v, tile_scale, QMAX, IS_INT), BLOCK_M, w.dtype)
        part = tl.dot(a, tl.trans(w), out_dtype=tl.int32 if IS_INT else tl.float32)
        return acc + part.to(tl.float32) * tile_scale
    a = _row_operand(v, BLOCK_M, x_dtype)
    return tl.dot(a, tl.trans(w.to(x_dtype)), acc)


@triton.jit(do_not_specialize=["eps"])
def _norm_gemv_kernel(
    x_ptr,
    res_ptr,
    g_ptr,
    res_out_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    N,
    K,
    stride_wn,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    CODES: tl.constexpr,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    IS_INT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
):
    """norm(h) @ W^T = rstd * ((h * g) @ W^T): the loop multiplies h * g and sums h^2 over the program's
    K range; the row's rstd, from every split's sum, scales the result where the splits are reduced."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        kk = k + rk
        k_ok = kk < k_end
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        hf = _residual_sum(x_ptr, res_ptr, kk, k_ok, HAS_RESIDUAL).to(tl.float32)
        squares += hf * hf
        v = hf * tl.load(g_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        acc = _tile_dot(v, w, acc, BLOCK_M, CODES, QMAX, INV_QMAX, MIN_AMAX, IS_INT, x_ptr.dtype.element_ty)
    # The first output tile's programs hand on x + residual, after the loop: a store inside it would keep
    # the compiler from loading tiles ahead (it may alias them).
    if HAS_RESIDUAL:  # noqa: SIM102 - a constexpr and a runtime condition: two ifs in Triton
        if pid_n == 0:
            cols = k_start + tl.arange(0, SPLIT_BLOCK)
            ok = cols < k_end
            tl.store(res_out_ptr + cols, _residual_sum(x_ptr, res_ptr, cols, ok, HAS_RESIDUAL), mask=ok)
    if HAS_SCALE:
        acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    sum_sq = tl.sum(squares, axis=0)
    out_mask = (rm < 1)[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        _store_row(acc * tl.rsqrt(sum_sq / K + eps), b_ptr, y_ptr, rm, rn, n_ok, N, HAS_BIAS)
    else:
        # workspace: [SPLIT_K, BLOCK_M, N] partials, then [tiles, SPLIT_K] sums of squares
        ws_tile = ws_ptr + rm[:, None] * N + rn[None, :]
        tl.store(ws_tile + pid_k * BLOCK_M * N, acc, mask=out_mask)
        sq_slots = ws_ptr + SPLIT_K * BLOCK_M * N + pid_n * SPLIT_K
        tl.store(sq_slots + pid_k, sum_sq)
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:  # the last split of this tile: reduce, scale by the row's rstd, publish
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            row_sq = 0.0
            for s in range(SPLIT_K):
                total += tl.load(ws_tile + s * BLOCK_M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                row_sq += tl.load(sq_slots + s, cache_modifier=".cg")
            _store_row(total * tl.rsqrt(row_sq / K + eps), b_ptr, y_ptr, rm, rn, n_ok, N, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def _store_row(total, b_ptr, y_ptr, rm, rn, n_ok, N, HAS_BIAS: tl.constexpr):
    """Row 0 of the [BLOCK_M, BLOCK_N] result (+ bias) to y [1, N] at columns `rn`."""
    if HAS_BIAS:
        total += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None] * N + rn[None, :],
        total.to(y_ptr.dtype.element_ty),
        mask=(rm < 1)[:, None] & n_ok[None, :],
    )


@triton.jit
def _silu_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    N,
    K,
    stride_wn,
    HAS_SCALE: tl.constexpr,
    CODES: tl.constexpr,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    IS_INT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        kk = k + rk
        k_ok = kk < k_end
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        v = _silu_mul(x_ptr, kk, k_ok, K).to(tl.float32)  # 0 where masked
        acc = _tile_dot(v, w, acc, BLOCK_M, CODES, QMAX, INV_QMAX, MIN_AMAX, IS_INT, x_ptr.dtype.element_ty)
    if HAS_SCALE:
        acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    split_k_epilogue(
        acc, b_ptr, y_ptr, ws_ptr, counter_ptr, rm, rn, rm < 1, n_ok, pid_n, pid_k, N, N,
        HAS_BIAS, SPLIT_K, BLOCK_M, BLOCK_N,
    )  # fmt: skip


def _quant_meta(quant: RowQuant | None) -> dict:
    if quant is None:
        return {"CODES": False, "QMAX": 0.0, "INV_QMAX": 0.0, "MIN_AMAX": 0.0, "IS_INT": False}
    return {
        "CODES": True,
        "QMAX": quant.qmax,
        "INV_QMAX": inv_qmax(quant.qmax),
        "MIN_AMAX": quant.min_amax,
        "IS_INT": not quant.dtype.is_floating_point,
    }


def _check(x: torch.Tensor, k: int, weight: torch.Tensor, weight_scale, quant: RowQuant | None) -> None:
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1, "one row, unit stride"
    assert weight.dim() == 2 and weight.shape[1] == k and weight.stride(1) == 1
    if quant is not None:
        assert weight.dtype == quant.dtype and weight_scale is not None, "codes need 8-bit weights and scales"
        assert quant.group is None, "per-row codes only"
    else:
        assert (weight_scale is None) == (weight.dtype == x.dtype), "8-bit weights need their scales"
    assert weight_scale is None or weight_scale.numel() == weight.shape[0]


def _config(ws: GemvWorkspace, n: int, k: int, weight: torch.Tensor, quant, config) -> GemvConfig:
    """The launch shape (the skinny GEMM's for the same product), checked against the workspace, which
    also holds a sum of squares per tile and split (norm_gemv) after the partials."""
    cfg = config or ws.config_for(1, n, k, weight.element_size(), quant is not None)
    tiles = triton.cdiv(n, cfg.block_n)
    ws.check(cfg.split_k, MAX_M, n + triton.cdiv(tiles, MAX_M), tiles, cfg)
    return cfg


def norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    ws: GemvWorkspace,
    weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    quant: RowQuant | None = None,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(norm(h) @ W.T + b, h)` for one row, h = x + residual (x itself without one), in one launch.

    W: [N, K] in x's dtype, or 8-bit codes with `weight_scale` (per output channel): W8A16, or with
    `quant` (the projection's per-row `RowQuant`) codes times the normalized row's codes (W8A8). The
    second result is h in a new tensor (x itself without a residual)."""
    k = x.shape[1]
    _check(x, k, weight, weight_scale, quant)
    n = weight.shape[0]
    cfg = _config(ws, n, k, weight, quant, config)
    h = torch.empty_like(x) if residual is not None else x
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    _norm_gemv_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        x, residual if residual is not None else x, norm_weight, h, weight,
        weight_scale if weight_scale is not None else weight, bias if bias is not None else weight,
        y, ws.partials, ws.counters, n, k, weight.stride(0), eps,
        HAS_RESIDUAL=residual is not None, HAS_SCALE=weight_scale is not None, HAS_BIAS=bias is not None,
        SPLIT_K=cfg.split_k, BLOCK_M=MAX_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_BLOCK=triton.next_power_of_2(k_per_split),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_quant_meta(quant),
    )  # fmt: skip
    return y, h


def silu_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    ws: GemvWorkspace,
    weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    quant: RowQuant | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """`(silu(gate) * up) @ W.T + b` for one row x = [gate | up] ([1, 2K]), in one launch.

    W as in `norm_gemv`; with `quant`, the activations become codes with one scale per BLOCK_K columns of
    the launch (W8A8, each tile's sums scaled by its own)."""
    k = x.shape[1] // 2
    _check(x, k, weight, weight_scale, quant)
    n = weight.shape[0]
    cfg = _config(ws, n, k, weight, quant, config)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _silu_gemv_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        x, weight, weight_scale if weight_scale is not None else weight,
        bias if bias is not None else weight, y, ws.partials, ws.counters, n, k, weight.stride(0),
        HAS_SCALE=weight_scale is not None, HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k,
        BLOCK_M=MAX_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_quant_meta(quant),
    )  # fmt: skip
    return y
