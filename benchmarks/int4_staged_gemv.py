"""Batch-1 int4 GEMV with the activation pairs staged in shared memory once per program and no barrier in
its loop (Gluon), against the engine's f16x2 kernel (`qwick.kernels.row_gemv_half2`) at the qwen2.5-7b
layer shapes. A prototype, not an engine path.

Why: in the 49th session Nsight Compute's per-instruction sampling of the f16x2 gate/up launch on an H100
put 34% of its warps' stalls at the two `bar.sync` of each tile, around the exchange of the tile's
activation pairs through shared memory (each thread loads one int32 of them, stores it, and after the
barrier reads its quad's 16 back), and 42% on each tile's own code loads. The four warps of a program
move in lockstep, so one warp's late tile holds the others. The TMA ring of that session
(`benchmarks/int4_ring_gemv.py`) staged the pairs once per program too, but it also moved the code bytes
through shared memory with an mbarrier wait, a barrier and an arrive a tile, on a third of the decoding
warps; it lost (30.5 us against 26.7 at gate/up). Here only the pairs move:

- each program (one row block, one K split: the f16x2 kernel's grid) copies its split's activation pairs
  (`half_pairs`, what decode's RMSNorm and SiLU-and-mul write for the f16x2 kernel: a thread reads one
  quad's 16, 64 bytes) into shared memory as [16, quads], then one barrier;
- its loop loads each code tile from global memory straight into the registers the products read (each
  thread a quad of words of BN / (32 / C) / WARPS rows), the scales one tile ahead, and reads its quad's
  16 pairs from shared memory (`ldmatrix`, one register each, the same for every row a thread holds): no
  barrier, no exchange, so the warps drift apart as their loads land;
- the decode and products are the f16x2 kernel's (`DOT4_ASM`, 13 instructions a word); PREFETCH keeps a
  second tile in flight (A and B alternating, as `RowGemvConfig.prefetch`).

K splits end as the engine's (`gemv.split_k_epilogue`): each program writes its partial sums, and the row
block's last program to finish (an acq_rel counter) adds them in split order and writes the output.

    python benchmarks/int4_staged_gemv.py out.json   # env SHAPES, BNS, BWS, WARPS, PREFETCH ("0 1")
    OFFLINE=1 python benchmarks/int4_staged_gemv.py      # no GPU: compile for sm_90, print SASS counts
    CHECK=1 python benchmarks/int4_staged_gemv.py        # the engine's calls against the f16x2 kernel

In the engine (`install()`, for A/B runs: `gpu_session.sh stagedab`), the kernel takes the f16x2 kernel's
batch-1 options: the bias, a constant zero point, SiLU-and-mul with the output's pairs (gate/up), the
residual add + RMSNorm in the launch's tail (o), a bf16 input paired once per program (o's input, the
attention's row: `XPAIRS_BF16_ASM` in the staging), PDL's preload of the first two tiles and trigger.

Offline (56th session, Triton 3.6, sm_90 SASS): one `BAR.SYNC` in the whole kernel (the f16x2 kernel: two a
tile), 16 `LDSM` and two `LDG.128` a tile, 40 registers a thread against the f16x2 kernel's 54 (so 12
programs of 4 warps an SM, not 9), and 40 with the prefetch too.

Result on an H100 (56th session): it loses. Every candidate matched float64 within 1.8e-3, and on the
engine's five calls (`CHECK=1`) its outputs equal the f16x2 kernel's bit for bit. The sweep, us, the f16x2
default against the best staged launch: qkv 6.37 against 7.26, o 5.85 against 6.51, gate/up 26.71 against
26.82, down 16.06 against 16.08. In the engine (`stagedab`), int4 batch 1 made 472.2 and 470.8 decode tok/s
against the f16x2 kernel's 519.0 and 517.7 (-9%). Without the barriers the warps wait on their code loads
instead: the barrier stalls the sampling showed were not what limits the kernel.
"""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass, replace

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from int4_half2_sweep import sweep_against_f16x2, workspace  # noqa: E402  (beside this script)
from int4_ring_gemv import SHAPES, quad_products  # noqa: E402

from qwick.kernels.row_gemv_half2 import (  # noqa: E402
    X_DIV,
    XPAIRS_BF16_ASM,
    default_half2_config,
    half_pairs,
)

_X_DIV = gl.constexpr(X_DIV)
_XPAIRS = gl.constexpr(XPAIRS_BF16_ASM)


@dataclass(frozen=True)
class StagedConfig:
    block_n: int = 32  # rows per tile
    block_w: int = 32  # words per tile (8 quads)
    split_k: int = 1
    warps: int = 4
    prefetch: bool = False


@gluon.jit
def _pdl_wait():
    """`qwick.kernels.pdl.pdl_wait` in Gluon."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], gl.int32, False, 1)


@gluon.jit
def _pdl_trigger():
    """`qwick.kernels.pdl.pdl_trigger` in Gluon."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], gl.int32, False, 1)


@gluon.jit
def _group_scales(
    s_ptr, z_ptr, rows, ok, kt, quad4, stride_sn, BW: gl.constexpr, GROUP_W: gl.constexpr,
    ZERO_POINT: gl.constexpr, ZERO_MODE: gl.constexpr,
):  # fmt: skip
    """[BN, C] scales and zero points (fp32) of tile kt's quads for `rows` (a constant zero point unless
    ZERO_MODE is 1, `w4a16.ZERO_TENSOR`)."""
    g = (kt * BW + quad4) // GROUP_W
    off = gl.expand_dims(rows.to(gl.int64) * stride_sn, 1) + gl.expand_dims(g, 0)
    mask = gl.expand_dims(ok, 1)
    sc = gl.load(s_ptr + off, mask=mask, other=0.0).to(gl.float32)
    if ZERO_MODE == 1:
        z = gl.load(z_ptr + off, mask=mask, other=0).to(gl.float32)
    else:
        z = gl.zeros_like(sc) + ZERO_POINT
    return sc, z


@gluon.jit
def _tile_part(w, xs, kt, sc, z, BN: gl.constexpr, C: gl.constexpr, NKT_PAD: gl.constexpr, LW: gl.constexpr):
    """[BN, C] scaled sums of one code tile w [BN, 4 C] (tile kt of the program's split)."""
    return sc * quad_products(w, xs, kt, z, BN, C, NKT_PAD, LW)


@gluon.jit
def _tile_rows(rb, N, BN: gl.constexpr, layout: gl.constexpr, GATED: gl.constexpr):
    """Row block rb's rows (in `layout`) and which are in range; GATED (`gemv.gated_rows`): BN / 2 gate
    rows, then the up rows of the same outputs, N / 2 further on."""
    r = gl.arange(0, BN, layout=layout)
    if GATED:
        outs = rb * (BN // 2) + r % (BN // 2)
        return outs + (r // (BN // 2)) * (N // 2), outs < N // 2
    else:
        return rb * BN + r, rb * BN + r < N


@gluon.jit
def _gated_epilogue(
    out, b_ptr, y_ptr, pout_ptr, rows, ok, rb, N, HAS_BIAS: gl.constexpr, OUT_PAIRS: gl.constexpr,
    OUT_INV_DIV: gl.constexpr, BN: gl.constexpr, WARPS: gl.constexpr,
):  # fmt: skip
    """`row_gemv_half2._gated_epilogue` of the row block's sums (`gated_rows` order): gate and up (+ bias)
    rounded to y's dtype, silu(gate) * up stored, and with OUT_PAIRS its `HalfPairs` (`store_half_pairs`)."""
    HALF: gl.constexpr = BN // 2
    if HAS_BIAS:
        out += gl.load(b_ptr + rows, mask=ok, other=0.0).to(gl.float32)
    y = out.to(y_ptr.dtype.element_ty)
    G2: gl.constexpr = gl.BlockedLayout([2, 1], [1, 32], [1, WARPS], [0, 1])  # gate and up in one thread
    gate, up = gl.split(gl.permute(gl.convert_layout(gl.reshape(y, [2, HALF]), G2), [1, 0]))
    cols = gl.expand_dims(gl.arange(0, HALF, layout=gl.SliceLayout(0, G2)), 0) + gl.zeros(
        [2, HALF], gl.int32, G2
    )
    col, _ = gl.split(gl.permute(cols, [1, 0]))
    g = gate.to(gl.float32)
    act = (g / (1.0 + gl.exp(-g))).to(gate.dtype).to(gl.float32)  # `swiglu.silu_times`
    act = (act * up.to(gl.float32)).to(gate.dtype)
    outs = rb * HALF + col
    gl.store(y_ptr + outs, act, mask=outs < N // 2)
    if OUT_PAIRS:  # words of eight outputs: (x_p, x_{p+4}) * OUT_INV_DIV in fp16, x_p in the low half
        P8: gl.constexpr = gl.BlockedLayout([8], [32], [WARPS], [0])
        h = (gl.convert_layout(act, P8).to(gl.float32) * OUT_INV_DIV).to(gl.float16)
        h = h.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        lo, hi = gl.split(gl.permute(gl.reshape(h, [HALF // 8, 2, 4]), [0, 2, 1]))
        i = gl.arange(0, HALF, layout=P8)
        i_lo, _ = gl.split(gl.permute(gl.reshape(i, [HALF // 8, 2, 4]), [0, 2, 1]))
        word = rb * (HALF // 8) + i_lo // 8
        gl.store(pout_ptr + 4 * word + i_lo % 8, lo | (hi << 16), mask=word < N // 16)


@gluon.jit
def _pairs_of_bf16(raw, NKT_PAD: gl.constexpr, C: gl.constexpr):
    """[16, NKT_PAD, C] int32: per quad, its four words' bf16 values two to an int32 (x0x1, x2x3, x4x5,
    x6x7 of word r // 4 at r) -> the same quads' `half_pairs` (pair r % 4 of word r // 4), each thread
    holding a quad's 16: `row_gemv_half2.XPAIRS_BF16_ASM`."""
    w = gl.reshape(gl.permute(raw, [1, 2, 0]), [NKT_PAD, C, 4, 2, 2])  # [.., word, int32 of the word]
    a, b = gl.split(w)
    a0, a1 = gl.split(a)
    b0, b1 = gl.split(b)
    d0, d1, d2, d3 = gl.inline_asm_elementwise(
        _XPAIRS, "=r,=r,=r,=r,r,r,r,r", [a0, b0, a1, b1], dtype=(gl.int32,) * 4, is_pure=True, pack=1
    )
    # join's new index is the last: (d0, d2) inner, then outer, flattens to d0, d1, d2, d3
    out = gl.reshape(gl.join(gl.join(d0, d2), gl.join(d1, d3)), [NKT_PAD, C, 16])
    return gl.permute(out, [2, 0, 1])


@gluon.jit
def _norm_tail(
    y_ptr, res_ptr, w_ptr, out_ptr, p_ptr, counter_ptr, N, eps, PAIRS: gl.constexpr, INV_DIV: gl.constexpr,
    BLOCK: gl.constexpr, WARPS: gl.constexpr,
):  # fmt: skip
    """`elementwise.rms_norm_tail`: the launch's last program to arrive adds y [N] to the residual (in
    place), normalizes it into out, and with PAIRS writes out's `HalfPairs` from the stored row."""
    gl.thread_barrier()  # every thread's part of y is stored before the release below
    done = gl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if done == gl.num_programs(0) * gl.num_programs(1) - 1:
        SPT: gl.constexpr = BLOCK // (32 * WARPS) if BLOCK >= 32 * WARPS else 1
        NB: gl.constexpr = gl.BlockedLayout([SPT], [32], [WARPS], [0])
        cols = gl.arange(0, BLOCK, layout=NB)
        mask = cols < N
        x = gl.load(y_ptr + cols, mask=mask, other=0.0, cache_modifier=".cg")
        r = gl.load(res_ptr + cols, mask=mask, other=0.0)
        w = gl.load(w_ptr + cols, mask=mask, other=0.0).to(gl.float32)
        x = (x.to(gl.float32) + r.to(gl.float32)).to(x.dtype)  # rounded, as `x + residual` is
        gl.store(res_ptr + cols, x, mask=mask)
        xf = x.to(gl.float32)
        rstd = gl.rsqrt(gl.sum(xf * xf, axis=0) / N + eps)
        normed = (xf * rstd).to(x.dtype).to(gl.float32)
        gl.store(out_ptr + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)
        if PAIRS:  # `elementwise.half_pairs_of_row`, from the stored row
            gl.thread_barrier()  # the whole row is stored before any thread reads another's part
            slot = gl.arange(0, BLOCK // 2, layout=NB)
            col = 8 * (slot // 4) + slot % 4
            pok = slot < N // 2
            lo = gl.load(out_ptr + col, mask=pok, other=0.0, cache_modifier=".cg").to(gl.float32)
            hi = gl.load(out_ptr + col + 4, mask=pok, other=0.0, cache_modifier=".cg").to(gl.float32)
            lo = (lo * INV_DIV).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
            hi = (hi * INV_DIV).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
            gl.store(p_ptr + slot, lo | (hi << 16), mask=pok)
        gl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _staged_kernel(
    qw_ptr,
    p_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    pout_ptr,
    ws_ptr,
    counter_ptr,
    N,
    stride_qn,
    stride_sn,
    n_quads,
    n_kt,
    ZERO_POINT: gl.constexpr,
    ZERO_MODE: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    SPLIT: gl.constexpr,
    BN: gl.constexpr,
    BW: gl.constexpr,
    WARPS: gl.constexpr,
    GROUP_W: gl.constexpr,
    NKT_PAD: gl.constexpr,
    PREFETCH: gl.constexpr,
    GATED: gl.constexpr,
    OUT_PAIRS: gl.constexpr,
    OUT_INV_DIV: gl.constexpr,
    PRELOAD: gl.constexpr,
    TRIGGER: gl.constexpr,
    TRIGGER_START: gl.constexpr = False,
    X_BF16: gl.constexpr = False,
    NORM_TAIL: gl.constexpr = False,
    NORM_BLOCK: gl.constexpr = 1,
    res_ptr=None,
    nw_ptr=None,
    nout_ptr=None,
    tail_ptr=None,
    eps=0.0,
):
    """y[n] = sum_k (q[n, k] - z) * s * x[k] (+ b[n]) over K split program_id(1) (up to n_kt tiles of BW
    words, the last split fewer or none) for the BN rows of row block program_id(0); x as its `half_pairs`.
    The f16x2 kernel's options: GATED (+ OUT_PAIRS) its SiLU-and-mul epilogue (one split); PRELOAD the
    split's first tile loaded before `pdl_wait` (everything this kernel's predecessor writes comes after);
    TRIGGER `pdl_trigger` once the loop is done (TRIGGER_START: at the program's start). As in the f16x2
    kernel, PRELOAD loads the split's first two tiles before the wait (one with PREFETCH), and a split of
    at most two tiles (NKT_PAD <= 2) is loaded whole and runs no loop (`PRELOAD_ALL`)."""
    if TRIGGER_START:
        _pdl_trigger()
    C: gl.constexpr = BW // 4
    L2: gl.constexpr = gl.BlockedLayout([1, 4], [32 // C, C], [WARPS, 1], [1, 0])  # a quad's words a thread
    probe = gl.zeros([BN, BW], gl.int32, L2)  # the layout of one word of each quad, as the loop splits it
    pa, pb = gl.split(gl.reshape(probe, [BN, C, 2, 2]))
    p0, p1 = gl.split(pa)
    LW: gl.constexpr = p0.type.layout
    XL: gl.constexpr = gl.SliceLayout(0, LW)
    RL: gl.constexpr = gl.SliceLayout(1, LW)
    rb = gl.program_id(0)
    kt0 = gl.program_id(1) * n_kt
    last = n_quads // C - 1  # the row's last tile: tiles past the split's end read it with scale 0
    n_here = gl.minimum(n_kt, last + 1 - kt0)  # tiles in this split (<= 0: none)

    # the code tiles straight from global memory, in the layout the products take them
    rows_w, ok_w = _tile_rows(rb, N, BN, gl.SliceLayout(1, L2), GATED)
    cols_w = gl.arange(0, BW, layout=gl.SliceLayout(0, L2))
    w_ptrs = (
        qw_ptr + gl.expand_dims(rows_w.to(gl.int64) * stride_qn, 1) + gl.expand_dims(kt0 * BW + cols_w, 0)
    )
    w_mask = gl.expand_dims(ok_w, 1)
    rows, ok = _tile_rows(rb, N, BN, RL, GATED)
    quad4 = gl.arange(0, C, layout=XL) * 4
    ka = gl.minimum(kt0, last) - kt0
    w_a = gl.load(w_ptrs + ka * BW, mask=w_mask, other=0)
    s_a, z_a = _group_scales(
        s_ptr, z_ptr, rows, ok, kt0 + ka, quad4, stride_sn, BW, GROUP_W, ZERO_POINT, ZERO_MODE
    )
    s_a = gl.where(n_here > 0, s_a, 0.0)
    WHOLE: gl.constexpr = NKT_PAD <= 2 and not PREFETCH
    EARLY_B: gl.constexpr = (PRELOAD or WHOLE) and not PREFETCH
    if EARLY_B:  # the split's second tile too (past its end: the first again, scale 0)
        kb = gl.minimum(1, n_here - 1)
        w_b = gl.load(w_ptrs + kb * BW, mask=w_mask, other=0)
        s_b, z_b = _group_scales(
            s_ptr, z_ptr, rows, ok, kt0 + kb, quad4, stride_sn, BW, GROUP_W, ZERO_POINT, ZERO_MODE
        )
        s_b = gl.where(n_here > 1, s_b, 0.0)
    if PRELOAD:
        _pdl_wait()

    # the split's activation pairs into xs [16 * NKT_PAD, 1, C], pair r of tile kt's quads in row
    # r * NKT_PAD + kt, once (`half_pairs` holds pair r of quad j at 16 j + r: a thread reads one quad's 16)
    SL3: gl.constexpr = gl.BlockedLayout([16, 1, 1], [1, 32 // C, C], [1, WARPS, 1], [0, 2, 1])
    r3 = gl.expand_dims(
        gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, SL3))), 1), 2
    )
    kt3 = gl.expand_dims(
        gl.expand_dims(gl.arange(0, NKT_PAD, layout=gl.SliceLayout(0, gl.SliceLayout(2, SL3))), 0), 2
    )
    qc3 = gl.expand_dims(
        gl.expand_dims(gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, SL3))), 0), 1
    )
    q = (kt0 + kt3) * C + qc3  # [1, NKT_PAD, C] quad indices
    pairs = gl.load(p_ptr + q * 16 + r3, mask=(kt3 < n_here) & (r3 < 16), other=0)
    if X_BF16:  # p_ptr is x itself (bf16, as int32 pairs of values): its pairs made here, once
        pairs = _pairs_of_bf16(pairs, NKT_PAD, C)
    xs = gl.allocate_shared_memory(
        gl.int32, [16, NKT_PAD, C], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]), pairs
    )
    gl.thread_barrier()
    xs = xs._reinterpret(gl.int32, [16 * NKT_PAD, 1, C], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    acc = gl.zeros([BN, C], gl.float32, LW)
    if PREFETCH:  # tiles A (even) and B (odd) in flight together; B past the end: the last tile, scale 0
        for kt in range(0, n_here, 2):
            kb = gl.minimum(kt + 1, n_here - 1)
            w_b = gl.load(w_ptrs + kb * BW, mask=w_mask, other=0)
            s_b, z_b = _group_scales(
                s_ptr, z_ptr, rows, ok, kt0 + kb, quad4, stride_sn, BW, GROUP_W, ZERO_POINT, ZERO_MODE
            )
            s_b = gl.where(kt + 1 < n_here, s_b, 0.0)
            acc += _tile_part(w_a, xs, kt, s_a, z_a, BN, C, NKT_PAD, LW)
            ka = gl.minimum(kt + 2, n_here - 1)
            w_a = gl.load(w_ptrs + ka * BW, mask=w_mask, other=0)
            s_a, z_a = _group_scales(
                s_ptr, z_ptr, rows, ok, kt0 + ka, quad4, stride_sn, BW, GROUP_W, ZERO_POINT, ZERO_MODE
            )
            acc += _tile_part(w_b, xs, kb, s_b, z_b, BN, C, NKT_PAD, LW)
    else:  # tile A (and B) first; then each tile's scales are loaded one tile ahead
        acc += _tile_part(w_a, xs, 0, s_a, z_a, BN, C, NKT_PAD, LW)
        if EARLY_B:
            acc += _tile_part(w_b, xs, 1 if NKT_PAD > 1 else 0, s_b, z_b, BN, C, NKT_PAD, LW)
    if not PREFETCH and not WHOLE:
        FIRST: gl.constexpr = 2 if EARLY_B else 1
        sc, z = _group_scales(
            s_ptr, z_ptr, rows, ok, kt0 + gl.minimum(FIRST, n_here - 1), quad4, stride_sn, BW, GROUP_W,
            ZERO_POINT, ZERO_MODE,
        )  # fmt: skip
        for kt in range(FIRST, n_here):
            w = gl.load(w_ptrs + kt * BW, mask=w_mask, other=0)
            nxt = gl.minimum(kt + 1, n_here - 1)
            nsc, nz = _group_scales(
                s_ptr, z_ptr, rows, ok, kt0 + nxt, quad4, stride_sn, BW, GROUP_W, ZERO_POINT, ZERO_MODE
            )
            acc += _tile_part(w, xs, kt, sc, z, BN, C, NKT_PAD, LW)
            sc, z = nsc, nz
    if TRIGGER and not TRIGGER_START:  # the next kernel may launch once every program is past its loop
        _pdl_trigger()
    out = gl.sum(acc, axis=1) * _X_DIV
    if GATED:
        _gated_epilogue(
            out, b_ptr, y_ptr, pout_ptr, rows, ok, rb, N, HAS_BIAS, OUT_PAIRS, OUT_INV_DIV, BN, WARPS
        )
    elif SPLIT == 1:
        if HAS_BIAS:
            out += gl.load(b_ptr + rows, mask=ok, other=0.0).to(gl.float32)
        gl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty), mask=ok)
    else:  # as the engine's `split_k_epilogue`: partials [SPLIT, N], the row block's last program sums them
        gl.store(ws_ptr + gl.program_id(1) * N + rows, out, mask=ok)
        gl.thread_barrier()  # every thread's partial is written before the release below
        done = gl.atomic_add(counter_ptr + rb, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            total = gl.zeros([BN], gl.float32, RL)
            for k in range(SPLIT):
                total += gl.load(ws_ptr + k * N + rows, mask=ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += gl.load(b_ptr + rows, mask=ok, other=0.0).to(gl.float32)
            gl.store(y_ptr + rows, total.to(y_ptr.dtype.element_ty), mask=ok)
            gl.atomic_xchg(counter_ptr + rb, 0, sem="relaxed", scope="gpu")
    if NORM_TAIL:
        _norm_tail(
            y_ptr,
            res_ptr,
            nw_ptr,
            nout_ptr,
            pout_ptr,
            tail_ptr,
            N,
            eps,
            OUT_PAIRS,
            OUT_INV_DIV,
            NORM_BLOCK,
            WARPS,
        )


def launch(
    qw,
    pairs: torch.Tensor,
    y: torch.Tensor,
    cfg: StagedConfig,
    ws,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    pout: torch.Tensor | None = None,
    out_inv_div: float = 1.0,
    preload: bool = False,
    trigger: bool = False,
    trigger_at_start: bool = False,
    x_bf16: bool = False,
    norm=None,
    nout: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [1, N] (gated: [1, N / 2], and its `HalfPairs` into pout) from x's `half_pairs` (x_bf16: from x
    itself, bf16 [1, K]); `ws` a `GemvWorkspace` (the split-K partials and counters, as the engine's).
    `norm` (a `NormAfter`): then the residual add + RMSNorm of y into nout (and its pairs into pout)."""
    n, kw = qw.qweight.shape
    assert kw % cfg.block_w == 0 and (not gated or cfg.split_k == 1)
    n_kt = triton.cdiv(kw // cfg.block_w, cfg.split_k)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    if x_bf16:  # read as int32: two values each, the words' layout of the pairs
        pairs = pairs.view(torch.int32)
    tail = {}
    if norm is not None:
        tail = dict(
            NORM_TAIL=True, NORM_BLOCK=triton.next_power_of_2(n), res_ptr=norm.residual, nw_ptr=norm.weight,
            nout_ptr=nout, tail_ptr=ws.tail_counter, eps=norm.eps,
        )  # fmt: skip
    _staged_kernel[grid](
        qw.qweight, pairs, qw.scales, qw.zeros if qw.zeros is not None else qw.scales,
        bias if bias is not None else qw.scales, y, pout if pout is not None else y, ws.partials, ws.counters,
        n, qw.qweight.stride(0), qw.scales.stride(0), kw // 4, n_kt,
        ZERO_POINT=qw.zero_point, ZERO_MODE=int(qw.zeros is not None), HAS_BIAS=bias is not None,
        SPLIT=cfg.split_k, BN=cfg.block_n, BW=cfg.block_w, WARPS=cfg.warps, GROUP_W=qw.group_size // 8,
        NKT_PAD=triton.next_power_of_2(n_kt), PREFETCH=cfg.prefetch, GATED=gated, OUT_PAIRS=pout is not None,
        OUT_INV_DIV=out_inv_div, PRELOAD=preload, TRIGGER=trigger, TRIGGER_START=trigger and trigger_at_start,
        X_BF16=x_bf16, **tail, num_warps=cfg.warps, **({"launch_pdl": True} if preload else {}),
    )  # fmt: skip
    return nout if norm is not None else y


def install() -> None:
    """Route the engine's batch-1 f16x2 GEMVs (decode's QKV, o with its norm tail, gated gate/up and down)
    to the staged kernel, at the launch shape the engine chose for them, with the same PDL options; x is
    the producer's pairs, or bf16 (o's input, the attention's row) paired once per program. For `python -c`
    A/B runs of `qwick bench latency` (`gpu_session.sh stagedab`)."""
    from qwick.kernels import row_gemv_half2 as h
    from qwick.kernels.pdl import pdl_supported
    from qwick.layers.linear import PairedRows

    original = h._launch

    def _launch(x, weight, bias, ws, config, pairs, gated, out_pairs, norm=None, preload=False, trigger=False,
                trigger_at_start=False):  # fmt: skip
        n, k = weight.shape
        cfg = config or h.default_half2_config(n, k // 8, ws.num_sms)
        x_bf16 = pairs is None and x.dtype == torch.bfloat16 and weight.perm is None
        if not (pairs is not None or x_bf16) or not x.is_cuda or cfg.max_registers or cfg.block_k % 4:
            return original(
                x, weight, bias, ws, config, pairs, gated, out_pairs, norm, preload, trigger, trigger_at_start
            )
        src = x.contiguous() if x_bf16 else pairs.contiguous()
        y = torch.empty((1, n // 2 if gated else n), dtype=x.dtype, device=x.device)
        p = torch.empty((1, y.shape[1] // 2), dtype=torch.int32, device=x.device) if out_pairs else None
        nout = torch.empty_like(y) if norm is not None else None
        pdl = pdl_supported(x.device)
        out = launch(
            weight, src, y, StagedConfig(cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.prefetch),
            ws, bias, gated, p, 1.0 / out_pairs.x_div if out_pairs else 1.0, preload and pdl, trigger and pdl,
            trigger_at_start, x_bf16, norm, nout,
        )  # fmt: skip
        return PairedRows(out, p) if out_pairs is not None else out

    h._launch = _launch


def check() -> None:
    """The staged launches of the engine's calls against the f16x2 kernel's, on one GPU: QKV (bias, split
    8), o (bf16 input, the residual add + RMSNorm in its tail, with the pairs), gate/up (gated, with the
    output's pairs), down (split 8, prefetch) and a symmetric weight (a constant zero point), each launched
    plainly and then with PDL's preload and trigger (what is compared is the second). Prints the relative
    error, the largest difference and the share of equal elements; exits 1 if a relative error passes 2e-3."""
    from qwick.kernels import row_gemv_half2 as h
    from qwick.layers.linear import HalfPairs, NormAfter
    from qwick.quantization.formats import rtn

    dev = torch.device("cuda")
    ws = workspace(dev)
    torch.manual_seed(0)
    failed = False
    cases = [
        ("qkv+bias", 4608, 3584, "bias"),
        ("o normed", 3584, 3584, "norm"),
        ("gate_up", 37888, 3584, "gated"),
    ]
    cases += [("down", 3584, 18944, ""), ("o symmetric", 3584, 3584, "symmetric")]
    for name, n, k, kind in cases:
        qw = rtn.quantize(torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5, group_size=128)
        if kind == "symmetric":
            qw = replace(qw, zeros=None, zero_point=8)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if kind == "bias" else None
        gated, normed = kind == "gated", kind == "norm"
        pairs = None if normed else half_pairs(x)
        out_pairs = HalfPairs(X_DIV) if gated or normed else None
        cfg = (
            h.normed_half2_config(n, k // 8, ws.num_sms)
            if normed
            else h.default_half2_config(n, k // 8, ws.num_sms)
        )
        res = torch.randn(1, n, device=dev, dtype=torch.bfloat16)
        nw = torch.randn(n, device=dev, dtype=torch.bfloat16)

        def norm_after(res=res, nw=nw, out_pairs=out_pairs):
            return NormAfter(nw, 1e-6, res.clone(), out_pairs)

        ref_norm = norm_after() if normed else None
        ref = h._launch(x, qw, bias, ws, cfg, pairs, gated, out_pairs, ref_norm)
        scfg = StagedConfig(cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.prefetch)
        for pdl in (False, True):  # the second launch finds the counters the first left; PDL: the same sums
            norm = norm_after() if normed else None
            y = torch.empty((1, n // 2 if gated else n), device=dev, dtype=torch.bfloat16)
            p = torch.empty((1, y.shape[1] // 2), dtype=torch.int32, device=dev) if out_pairs else None
            nout = torch.empty_like(y) if normed else None
            out = launch(
                qw, x if normed else pairs, y, scfg, ws, bias, gated, p, 1.0 / X_DIV if out_pairs else 1.0,
                pdl, pdl, False, normed, norm, nout,
            )  # fmt: skip
        torch.cuda.synchronize()
        outs = [(ref.x, out), (ref.pairs, p)] if out_pairs else [(ref, out)]
        if normed:
            outs.append((ref_norm.residual, norm.residual))
        for what, (a, b) in zip(("y", "pairs", "residual"), outs):
            if what == "pairs":  # compare the fp16 values, not the int32 words
                a, b = a.view(torch.float16), b.view(torch.float16)
            a, b = a.float(), b.float()
            err = ((a - b).norm() / a.norm()).item()
            same = (a == b).float().mean().item()
            print(f"{name:14s} {what:8s} rel err {err:.2e}, max |diff| {(a - b).abs().max().item():.3e}, "
                  f"{100 * same:.2f}% equal", flush=True)  # fmt: skip
            failed |= not err <= 2e-3
    sys.exit(1 if failed else 0)


def candidates(n: int, kw: int, num_sms: int) -> list[StagedConfig]:
    """The f16x2 default's rows, warps and split, then the swept rows, tile widths (BWS, words), warps and
    prefetch at its split."""
    base = default_half2_config(n, kw, num_sms)
    out = [StagedConfig(base.block_n, base.block_k, base.split_k, base.num_warps, base.prefetch)]
    bns = [int(v) for v in os.environ.get("BNS", "32 64").split()]
    bws = [int(v) for v in os.environ.get("BWS", str(base.block_k)).split()]
    warps = [int(v) for v in os.environ.get("WARPS", "2 4 8").split()]
    pfs = [bool(int(v)) for v in os.environ.get("PREFETCH", "0 1").split()]
    for bn, bw, w, pf in itertools.product(bns, bws, warps, pfs):
        cfg = StagedConfig(bn, bw, base.split_k, w, pf)
        if cfg not in out and kw % bw == 0 and bn % (32 // (bw // 4) * w) == 0:  # whole warps of rows
            out.append(cfg)
    return out


def offline() -> None:
    """Compile for sm_90 without a GPU (Triton's own ptxas) with the divisibility a launch would see, and
    print the resources and the SASS of each shape's default launch (barriers, shared and global loads),
    then of the engine's batch-1 variants (`install`)."""
    from ptx_counts import registers, sass_counts  # beside this script
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    variants = [
        (name, n, k, cfg, {}) for name, (n, k) in SHAPES.items() for cfg in candidates(n, k // 8, 132)[:1]
    ]
    variants.append(("gate_up", 37888, 3584, StagedConfig(prefetch=True), {}))
    engine = dict(HAS_BIAS=True, PRELOAD=True, TRIGGER=True, TRIGGER_START=True)  # QKV (`pdl_qkv_start`)
    variants.append(("qkv, engine", 4608, 3584, StagedConfig(split_k=8), engine))
    engine = dict(GATED=True, OUT_PAIRS=True, OUT_INV_DIV=1 / X_DIV, PRELOAD=True, TRIGGER=True)
    variants.append(("gate_up, engine", 37888, 3584, StagedConfig(), engine))
    engine = dict(X_BF16=True, NORM_TAIL=True, NORM_BLOCK=4096, OUT_PAIRS=True, OUT_INV_DIV=1 / X_DIV)
    variants.append(("o, engine", 3584, 3584, StagedConfig(64, 32, 8, 8), engine | dict(PRELOAD=True)))
    engine = dict(PRELOAD=True, TRIGGER=True, ZERO_MODE=0, ZERO_POINT=8)  # a symmetric weight
    variants.append(("down, engine", 3584, 18944, StagedConfig(split_k=8, warps=2, prefetch=True), engine))
    for name, _n, k, cfg, extra in variants:
        n_kt = triton.cdiv(k // 8 // cfg.block_w, cfg.split_k)
        sig = {"qw_ptr": "*i32", "p_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "b_ptr": "*bf16"}
        sig |= {"y_ptr": "*bf16", "pout_ptr": "*i32", "ws_ptr": "*fp32", "counter_ptr": "*i32"}
        sig |= {a: "i32" for a in ("N", "stride_qn", "stride_sn", "n_quads", "n_kt")}
        norm = {"res_ptr": "*bf16", "nw_ptr": "*bf16", "nout_ptr": "*bf16", "tail_ptr": "*i32"}
        if not extra.get("NORM_TAIL"):
            norm = dict.fromkeys(norm, "constexpr")
        sig |= norm | {"eps": "fp32"}
        const = {n: None for n, t in norm.items() if t == "constexpr"}
        const |= dict(
            ZERO_POINT=0, ZERO_MODE=1, HAS_BIAS=False, GATED=False, OUT_PAIRS=False, OUT_INV_DIV=1.0
        )
        const |= dict(PRELOAD=False, TRIGGER=False, SPLIT=cfg.split_k, BN=cfg.block_n, BW=cfg.block_w)
        const |= dict(
            WARPS=cfg.warps, GROUP_W=16, NKT_PAD=triton.next_power_of_2(n_kt), PREFETCH=cfg.prefetch
        )
        const |= extra
        names = list(sig)
        divisible = [*names[:9], "N", "stride_qn", "stride_sn", "n_quads"]  # pointers, rows, strides
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible}
        src = GluonASTSource(
            fn=_staged_kernel, signature=sig | {c: "constexpr" for c in const}, constexprs=const, attrs=attrs
        )
        opts = dict(num_warps=cfg.warps, launch_pdl=bool(extra.get("PRELOAD")))
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        n_sass, ops = sass_counts(kern)
        top = ", ".join(f"{op} {ops[op]}" for op in ("LDG", "LDSM", "STSM", "BAR", "HFMA2", "REDG"))
        regs = registers(kern)
        print(f"{name}: {cfg}: {kern.metadata.shared} B shared, {regs} registers, SASS {n_sass}: {top}")


def label(cfg: StagedConfig) -> str:
    out = f"staged {cfg.block_n}x{cfg.block_w} split{cfg.split_k} {cfg.warps}w"
    return out + (" prefetch" if cfg.prefetch else "")


def prepare(cfg: StagedConfig, qw, copies, pairs, ws):
    """(one launch, every copy's launch) of `cfg` (see `sweep_against_f16x2`)."""
    y = torch.zeros(1, qw.shape[0], device=pairs.device, dtype=torch.bfloat16)

    def calls() -> None:
        for c in copies:
            launch(c, pairs, y, cfg, ws)

    return (lambda: launch(qw, pairs, y, cfg, ws)), calls


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "int4_staged_gemv.json"
    sweep_against_f16x2(SHAPES, candidates, prepare, label, out)


if __name__ == "__main__":
    if os.environ.get("OFFLINE"):
        offline()
    elif os.environ.get("CHECK"):
        check()
    else:
        main()
