"""Can one persistent kernel stream a batch-1 decode step's weights at the copy bandwidth? A Gluon
(Triton's explicit-layout dialect) experiment at qwen2.5-7b shapes, fp8 weights, bf16 activations.

Launched kernels pay each operation's ramp and drain: the DRAM pipe empties at every kernel boundary and
refills after the next launch (`benchmarks/launch_floor.py`, `grid_barrier.py`: ~1 us each, and the
small GEMVs run at 1.4-2.0 TB/s). Here one launch of one program per SM runs the chain of 28 layers x
(QKV -> o -> gate/up with SiLU-and-mul -> down), each operation depending on the last. Every program
streams its share of every operation's weight tiles through a ring of shared-memory buffers filled by
TMA, and the ring runs ahead across operation boundaries: weights do not depend on activations, so while
a program waits at the grid barrier for the previous operation's output, the next operation's tiles keep
arriving. Only the activations (a few KB, read from L2 after the barrier) wait.

Work split: each operation is a grid of 128 x 128 weight tiles (rows x K), row-block-major; program p
takes the contiguous tile range [T p / P, T (p + 1) / P), so every program streams the same bytes
(+- one tile). A row block split between programs is summed with fp32 atomics; the last contributor (a
per-row-block counter) writes the bf16 result, through SiLU-and-mul for gate/up (whose row blocks hold 64
gate rows and the matching 64 up rows). A grid barrier (a counter, release/acquire) separates operations.
Two consumers: W8A16 on the CUDA cores (each weight converted, fp32 or fp16 sums), and W8A8 on the tensor
cores (`_consumer_mma`: the activations as per-program fp8 codes, each weight tile one wgmma).

Not an engine path: no norms, RoPE, attention or KV writes. o reads the first 3584 QKV outputs in place
of attention's, and every layer's QKV reads the chain's input (with no norm, gate/up squares the
activations' scale each layer, and a 28-layer chain overflows), though it still waits at the barrier for
the last down projection. The fp32 sums are zeroed by a memset node before the kernel. Every op is
checked against torch on the kernel's own input; then, in CUDA graphs, it times:
  - the persistent chain (with its memsets; the memsets alone are timed too) and its variants: the
    barrier polled with volatile loads, fp16 tile sums, no proxy fence, the slot release without a barrier,
    the tensor-core consumer (W8A8), and that consumer with chunks of tiles taken dynamically;
  - diagnostics with wrong outputs: without the multiply-adds, without the barrier, with the consumers
    alone (the slots handed over unfilled), and their combinations;
  - the same chain through qwick's batch-1 W8A16 GEMV (`qwick.kernels.gemv`) and SiLU-and-mul launches;
  - the weight bytes read once by a plain streaming kernel, and a device-to-device copy of 1 GB.

    python benchmarks/persistent_gemv_chain.py out.json          # LAYERS=28 STAGES="6 8 10" WARPS=8
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BN = 128  # weight rows per tile
BK = 128  # weight columns per tile (128 fp8 bytes: one 128-byte swizzle row)
X_ROWS = 160  # shared-memory rows of BK activations: K up to 20480
X_CHUNK = 32  # rows per load when the activations are copied into shared memory
MAX_KT = gl.constexpr(64)  # activation K tiles per program, tensor-core consumer (the most any op needs: 34)
FP8_MAX = gl.constexpr(448.0)
CHUNK = gl.constexpr(4)  # tiles per dynamically taken chunk: divides every K's tile count (28, 148)
X_BLOCKS = gl.constexpr(20)  # [8, BK] activation blocks of the dynamic consumer: K up to 20480
# op table, 8 columns: K tiles, kind, fp32 sum (and scale) offset, bf16 out offset, bf16 in offset, row-block
# base, first tile, tiles
QWEN7B = [  # (N, K, kind): kind 1 is gate/up, whose output is SiLU(gate) * up
    (4608, 3584, 0),
    (3584, 3584, 0),
    (37888, 3584, 1),
    (3584, 18944, 0),
]


@gluon.jit
def _arrive(counter_ptr):
    gl.thread_barrier()
    gl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def _wait_for(counter_ptr, target, LOAD_POLL: gl.constexpr):
    """Spins until the counter reaches target: with acquire atomics, or (LOAD_POLL) with volatile loads,
    which do not queue behind the other programs' read-modify-writes, then one acquire atomic."""
    if LOAD_POLL:
        seen = gl.load(counter_ptr, volatile=True)
        while seen < target:
            seen = gl.load(counter_ptr, volatile=True)
        gl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    else:
        seen = gl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = gl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()


@gluon.jit
def _flush(
    acc,
    op,
    rb,
    op_tab,
    ysum_ptr,
    xbuf_ptr,
    scale_ptr,
    sema_ptr,
    expect_ptr,
    BN: gl.constexpr,
    ROW_L: gl.constexpr,
    OUT_L: gl.constexpr,
):
    """Adds a row block's partial sums; the last of its programs writes the block's bf16 output."""
    base = op_tab + op * 8
    kind = gl.load(base + 1)
    y_off = gl.multiple_of(gl.load(base + 2), BN)
    out_off = gl.multiple_of(gl.load(base + 3), BN)
    rb_base = gl.load(base + 5)
    rows = rb * BN + gl.arange(0, BN, layout=ROW_L)
    scale = gl.load(scale_ptr + y_off + rows)
    gl.atomic_add(ysum_ptr + y_off + rows, acc * scale, sem="relaxed", scope="gpu")
    gl.thread_barrier()
    old = gl.atomic_add(sema_ptr + rb_base + rb, 1, sem="acq_rel", scope="gpu")
    need = gl.load(expect_ptr + rb_base + rb)
    if old == need - 1:
        if kind == 1:
            half = gl.arange(0, BN // 2, layout=OUT_L)
            g = gl.load(ysum_ptr + y_off + rb * BN + half, cache_modifier=".cg")
            u = gl.load(ysum_ptr + y_off + rb * BN + BN // 2 + half, cache_modifier=".cg")
            act = g / (1.0 + gl.exp(-g)) * u
            gl.store(xbuf_ptr + out_off + rb * (BN // 2) + half, act.to(gl.bfloat16))
        else:
            full = gl.arange(0, BN, layout=OUT_L)
            v = gl.load(ysum_ptr + y_off + rb * BN + full, cache_modifier=".cg")
            gl.store(xbuf_ptr + out_off + rb * BN + full, v.to(gl.bfloat16))


@gluon.jit
def _zero_acc(BN: gl.constexpr, BK: gl.constexpr, L: gl.constexpr, F16: gl.constexpr):
    """fp32 sums: per row ([BN]) when each tile is reduced in fp16 (F16), else elementwise ([BN, BK])."""
    if F16:
        return gl.zeros([BN], gl.float32, gl.SliceLayout(1, L))
    else:
        return gl.zeros([BN, BK], gl.float32, L)


@gluon.jit
def _row_sums(acc, F16: gl.constexpr):
    if F16:
        return acc
    else:
        return gl.sum(acc, axis=1)


@gluon.jit
def _producer(
    w_desc,
    op_tab,
    n_ops,
    ring,
    ready,
    empty,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    LOAD: gl.constexpr,
):
    """One warp: streams this program's weight tiles of every operation into the ring, as far ahead as
    the ring has room: it never waits for activations. Without LOAD (a diagnostic) it hands the slots
    over unfilled, so the consumers run at their own speed on whatever the ring holds."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    i = 0
    for op in range(n_ops):
        tiles = gl.load(op_tab + op * 8 + 7)
        tile0 = gl.load(op_tab + op * 8 + 6)
        lo = tiles * pid // nprog
        hi = tiles * (pid + 1) // nprog
        for t in range(lo, hi):
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            if LOAD:
                mbarrier.expect(ready.index(slot), BN * BK)
                tma.async_copy_global_to_shared(
                    w_desc, [(tile0 + t) * BN, 0], ready.index(slot), ring.index(slot)
                )
            else:
                mbarrier.arrive(ready.index(slot), count=1)
            i += 1


@gluon.jit
def _consumer(
    op_tab,
    n_ops,
    ring,
    ready,
    empty,
    xs_w,
    xs,
    ysum_ptr,
    xbuf_ptr,
    scale_ptr,
    sema_ptr,
    expect_ptr,
    counter_ptr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    X_ROWS: gl.constexpr,
    X_CHUNK: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    COMPUTE: gl.constexpr,
    BARRIER: gl.constexpr,
    LOAD_POLL: gl.constexpr,
    F16: gl.constexpr,
    SYNC_RELEASE: gl.constexpr,
    FENCE: gl.constexpr,
):
    """The other warps: per operation, wait for the last one's output, copy it into shared memory, then
    multiply-accumulate the ring's tiles elementwise ([BN, BK] sums, reduced once per row block). Without
    COMPUTE (a diagnostic) they only hand each slot back: the weights stream, the barriers still run.
    Without BARRIER (a diagnostic too, its outputs wrong) no operation waits for the last one.

    F16: the activations are kept in fp16 and each tile's products are formed and reduced along K in fp16
    (one fp8 -> fp16x2 conversion per two weights), only the tile's [BN] sums going to fp32, where the
    fp32 path converts every weight to fp32. It measured no faster, so those conversions are not what
    limits this consumer. fp16 products overflow past 65504, so an engine path would scale each
    activation vector by a power of two first; these activations have rms 1."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    L: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0])
    ROW_L: gl.constexpr = gl.SliceLayout(1, L)
    COL_L: gl.constexpr = gl.SliceLayout(0, L)
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    OUT_L: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    xr = gl.expand_dims(gl.arange(0, X_CHUNK, layout=gl.SliceLayout(1, XL)), 1)
    xc = gl.expand_dims(gl.arange(0, BK, layout=gl.SliceLayout(0, XL)), 0)
    i = 0
    for op in range(n_ops):
        kts = gl.load(op_tab + op * 8)
        in_off = gl.multiple_of(gl.load(op_tab + op * 8 + 4), BK)  # offsets are multiples of 128
        tiles = gl.load(op_tab + op * 8 + 7)
        lo = tiles * pid // nprog
        hi = tiles * (pid + 1) // nprog
        if BARRIER:
            _wait_for(counter_ptr, op * nprog, LOAD_POLL)
        for j in gl.static_range(X_ROWS // X_CHUNK):
            r = j * X_CHUNK + xr
            xv = gl.load(xbuf_ptr + in_off + r * BK + xc, mask=r < kts, other=0.0, cache_modifier=".cg")
            xs_w.index(j).store(xv.to(xs_w.dtype))
        gl.thread_barrier()
        rb = lo // kts
        kt = lo % kts
        acc = _zero_acc(BN, BK, L, F16)
        for _t in range(lo, hi):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            if COMPUTE:
                w = ring.index(slot).load(L)
                if FENCE:
                    fence_async_shared()
                if SYNC_RELEASE:  # the arrive is one thread's: every warp must have read the slot first
                    gl.thread_barrier()
                mbarrier.arrive(empty.index(slot), count=1)
                xk = xs.index(kt).load(COL_L)
                if F16:
                    acc += gl.sum(w.to(gl.float16) * gl.expand_dims(xk, 0), axis=1).to(gl.float32)
                else:
                    acc += w.to(gl.float32) * gl.expand_dims(xk.to(gl.float32), 0)
            else:
                mbarrier.arrive(empty.index(slot), count=1)
            i += 1
            kt += 1
            if kt == kts:
                _flush(
                    _row_sums(acc, F16),
                    op,
                    rb,
                    op_tab,
                    ysum_ptr,
                    xbuf_ptr,
                    scale_ptr,
                    sema_ptr,
                    expect_ptr,
                    BN,
                    ROW_L,
                    OUT_L,
                )
                acc = _zero_acc(BN, BK, L, F16)
                kt = 0
                rb += 1
        if kt != 0:
            _flush(
                _row_sums(acc, F16),
                op,
                rb,
                op_tab,
                ysum_ptr,
                xbuf_ptr,
                scale_ptr,
                sema_ptr,
                expect_ptr,
                BN,
                ROW_L,
                OUT_L,
            )
        _arrive(counter_ptr)


@gluon.jit
def _consumer_mma(
    op_tab,
    n_ops,
    ring,
    ready,
    empty,
    xq,
    ysum_ptr,
    xbuf_ptr,
    scale_ptr,
    sema_ptr,
    expect_ptr,
    counter_ptr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    BARRIER: gl.constexpr,
    PROLOGUE: gl.constexpr,
):
    """The tensor-core consumer (W8A8): per operation, after the barrier, each program loads only the K
    tiles of the activations its tile range touches, scales them by their own amax into fp8 codes, and
    writes each as row 0 of an [8, BK] block (rows 1-7 stay zero). Every weight tile is then the A
    operand of a [BN, BK] x [BK, 8] wgmma straight from the ring: no per-weight conversion on the CUDA
    cores. Column 0 of the [BN, 8] sums is the row block's partial dot product. Without PROLOGUE (a
    diagnostic, its outputs wrong) the activation codes are not rebuilt after each barrier."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    MMA_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8, 32]
    )
    ROW_L: gl.constexpr = gl.SliceLayout(1, MMA_L)
    OUT_L: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    XL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0])
    xr = gl.expand_dims(gl.arange(0, MAX_KT, layout=gl.SliceLayout(1, XL)), 1)
    xc = gl.expand_dims(gl.arange(0, BK, layout=gl.SliceLayout(0, XL)), 0)
    zero_block = gl.zeros([8, BK], gl.float8e4nv, gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0]))
    for j in range(MAX_KT):
        xq.index(j).store(zero_block)
    # row 0 of every [8, BK] block, unswizzled under the 128-byte swizzle: a plain [MAX_KT, BK] view
    xq_rows = xq._reinterpret(gl.float8e4nv, [MAX_KT, 8 * BK], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    xq_row0 = xq_rows.slice(0, BK, dim=1)
    i = 0
    for op in range(n_ops):
        kts = gl.load(op_tab + op * 8)
        in_off = gl.multiple_of(gl.load(op_tab + op * 8 + 4), BK)
        tiles = gl.load(op_tab + op * 8 + 7)
        lo = tiles * pid // nprog
        hi = tiles * (pid + 1) // nprog
        kt_lo = lo % kts
        n_kt = gl.minimum(kts, hi - lo)
        if BARRIER:
            _wait_for(counter_ptr, op * nprog, False)
        x_scale = 1.0
        if PROLOGUE:
            kt_of = (kt_lo + xr) % kts
            xv = gl.load(
                xbuf_ptr + in_off + kt_of * BK + xc, mask=xr < n_kt, other=0.0, cache_modifier=".cg"
            ).to(gl.float32)
            amax = gl.max(gl.max(gl.abs(xv), axis=1), axis=0)
            x_scale = gl.where(amax > 0, amax / FP8_MAX, 1.0)
            xq_row0.store((xv / x_scale).to(gl.float8e4nv))
            fence_async_shared()
            gl.thread_barrier()
        rb = lo // kts
        kt = kt_lo
        acc = gl.zeros([BN, 8], gl.float32, MMA_L)
        for _t in range(lo, hi):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            idx = kt - kt_lo
            idx = gl.where(idx < 0, idx + kts, idx)
            acc = warpgroup_mma(ring.index(slot), xq.index(idx).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()  # both warpgroups' wgmmas are done with the slot
            mbarrier.arrive(empty.index(slot), count=1)
            i += 1
            kt += 1
            if kt == kts:
                _flush(
                    gl.sum(acc, axis=1) * x_scale,
                    op,
                    rb,
                    op_tab,
                    ysum_ptr,
                    xbuf_ptr,
                    scale_ptr,
                    sema_ptr,
                    expect_ptr,
                    BN,
                    ROW_L,
                    OUT_L,
                )
                acc = gl.zeros([BN, 8], gl.float32, MMA_L)
                kt = 0
                rb += 1
        if kt != 0:
            _flush(
                gl.sum(acc, axis=1) * x_scale,
                op,
                rb,
                op_tab,
                ysum_ptr,
                xbuf_ptr,
                scale_ptr,
                sema_ptr,
                expect_ptr,
                BN,
                ROW_L,
                OUT_L,
            )
        _arrive(counter_ptr)


@gluon.jit
def _producer_dyn(
    w_desc,
    op_tab,
    n_ops,
    ring,
    ready,
    empty,
    tile_ids,
    grab_ptr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp: takes chunks of CHUNK tiles of each operation from a shared counter until none are left,
    so a program that streams faster takes more of them; each slot's tile index goes beside it, and a
    slot marked -1 (no data) ends the program's share of the operation."""
    ID_L: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    i = 0
    for op in range(n_ops):
        n_chunks = gl.load(op_tab + op * 8 + 7) // CHUNK
        tile0 = gl.load(op_tab + op * 8 + 6)
        c = gl.atomic_add(grab_ptr + op, 1, sem="relaxed", scope="gpu")
        while c < n_chunks:
            for u in gl.static_range(CHUNK):
                t = c * CHUNK + u
                slot = i % STAGES
                mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
                tile_ids.index(slot).store(gl.full([1], t, gl.int32, ID_L))
                mbarrier.expect(ready.index(slot), BN * BK)
                tma.async_copy_global_to_shared(
                    w_desc, [(tile0 + t) * BN, 0], ready.index(slot), ring.index(slot)
                )
                i += 1
            c = gl.atomic_add(grab_ptr + op, 1, sem="relaxed", scope="gpu")
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        tile_ids.index(slot).store(gl.full([1], -1, gl.int32, ID_L))
        mbarrier.arrive(ready.index(slot), count=1)
        i += 1


@gluon.jit
def _next_tile(i, ready, tile_ids, STAGES: gl.constexpr, WARPS: gl.constexpr):
    """Waits for ring entry i and returns its tile index (-1: the end of this operation's share)."""
    slot = i % STAGES
    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
    return gl.max(tile_ids.index(slot).load(gl.BlockedLayout([1], [32], [WARPS], [0])), axis=0)


@gluon.jit
def _consumer_dyn(
    op_tab,
    n_ops,
    ring,
    ready,
    empty,
    tile_ids,
    xq,
    xq_scale,
    ysum_ptr,
    xbuf_ptr,
    scale_ptr,
    sema_ptr,
    expect_ptr,
    counter_ptr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
):
    """The tensor-core consumer for dynamically taken chunks. A program cannot know in advance which K
    tiles it will need, so after each barrier it codes the whole activation vector: K tile kt is row
    kt % 8 of [8, BK] block kt // 8, each block with its own fp8 scale. A weight tile's wgmma against
    its block gives [BN, 8] sums, of which column kt % 8 is the tile's; each chunk's sums are flushed
    (the host sets every row block's expected count to its chunks)."""
    MMA_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8, 32]
    )
    ROW_L: gl.constexpr = gl.SliceLayout(1, MMA_L)
    OUT_L: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    BL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])
    S_L: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    br = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(1, BL)), 1)
    bc = gl.expand_dims(gl.arange(0, BK, layout=gl.SliceLayout(0, BL)), 0)
    col = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, MMA_L)), 0)
    nprog = gl.num_programs(0)
    i = 0
    for op in range(n_ops):
        kts = gl.load(op_tab + op * 8)
        in_off = gl.multiple_of(gl.load(op_tab + op * 8 + 4), BK)
        _wait_for(counter_ptr, op * nprog, False)
        for b in gl.static_range(X_BLOCKS):
            r = b * 8 + br
            xv = gl.load(xbuf_ptr + in_off + r * BK + bc, mask=r < kts, other=0.0, cache_modifier=".cg").to(
                gl.float32
            )
            amax = gl.max(gl.max(gl.abs(xv), axis=1), axis=0)
            sc = gl.where(amax > 0, amax / FP8_MAX, 1.0)
            xq.index(b).store((xv / sc).to(gl.float8e4nv))
            xq_scale.index(b).store(gl.full([1], sc, gl.float32, S_L))
        fence_async_shared()
        gl.thread_barrier()
        acc = gl.zeros([BN], gl.float32, ROW_L)
        tid = _next_tile(i, ready, tile_ids, STAGES, WARPS)
        while tid >= 0:
            slot = i % STAGES
            kt = tid % kts
            part = warpgroup_mma(
                ring.index(slot),
                xq.index(kt // 8).permute((1, 0)),
                gl.zeros([BN, 8], gl.float32, MMA_L),
                use_acc=False,
                is_async=True,
            )
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            gl.thread_barrier()  # both warpgroups' wgmmas are done with the slot
            mbarrier.arrive(empty.index(slot), count=1)
            sc = gl.max(xq_scale.index(kt // 8).load(S_L), axis=0)
            acc += gl.sum(gl.where(col == kt % 8, part, 0.0), axis=1) * sc
            if kt % CHUNK == CHUNK - 1:
                _flush(
                    acc,
                    op,
                    tid // kts,
                    op_tab,
                    ysum_ptr,
                    xbuf_ptr,
                    scale_ptr,
                    sema_ptr,
                    expect_ptr,
                    BN,
                    ROW_L,
                    OUT_L,
                )
                acc = gl.zeros([BN], gl.float32, ROW_L)
            i += 1
            tid = _next_tile(i, ready, tile_ids, STAGES, WARPS)
        gl.thread_barrier()  # every warp has read the end marker
        mbarrier.arrive(empty.index(i % STAGES), count=1)
        i += 1
        _arrive(counter_ptr)


@gluon.jit
def _chain_kernel(
    w_desc,
    op_tab,
    n_ops,
    ysum_ptr,
    xbuf_ptr,
    scale_ptr,
    sema_ptr,
    expect_ptr,
    counter_ptr,
    grab_ptr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    X_ROWS: gl.constexpr,
    X_CHUNK: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    COMPUTE: gl.constexpr,
    BARRIER: gl.constexpr,
    LOAD_POLL: gl.constexpr,
    F16: gl.constexpr,
    SYNC_RELEASE: gl.constexpr,
    FENCE: gl.constexpr,
    LOAD: gl.constexpr,
    MMA: gl.constexpr,
    DYN: gl.constexpr,
):
    ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for p in gl.static_range(STAGES):
        mbarrier.init(ready.index(p), count=1)
        mbarrier.init(empty.index(p), count=1)
    if DYN:
        tile_ids = gl.allocate_shared_memory(gl.int32, [STAGES, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        xq = gl.allocate_shared_memory(
            gl.float8e4nv, [X_BLOCKS, 8, BK], gl.NVMMASharedLayout.get_default_for([8, BK], gl.float8e4nv)
        )
        xq_scale = gl.allocate_shared_memory(gl.float32, [X_BLOCKS, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        gl.warp_specialize(
            [
                (
                    _consumer_dyn,
                    (
                        op_tab,
                        n_ops,
                        ring,
                        ready,
                        empty,
                        tile_ids,
                        xq,
                        xq_scale,
                        ysum_ptr,
                        xbuf_ptr,
                        scale_ptr,
                        sema_ptr,
                        expect_ptr,
                        counter_ptr,
                        BN,
                        BK,
                        STAGES,
                        WARPS,
                    ),
                ),
                (
                    _producer_dyn,
                    (w_desc, op_tab, n_ops, ring, ready, empty, tile_ids, grab_ptr, BN, BK, STAGES),
                ),
            ],
            [1],
            [24],
        )
    elif MMA:
        xq = gl.allocate_shared_memory(
            gl.float8e4nv, [MAX_KT, 8, BK], gl.NVMMASharedLayout.get_default_for([8, BK], gl.float8e4nv)
        )
        gl.warp_specialize(
            [
                (
                    _consumer_mma,
                    (
                        op_tab,
                        n_ops,
                        ring,
                        ready,
                        empty,
                        xq,
                        ysum_ptr,
                        xbuf_ptr,
                        scale_ptr,
                        sema_ptr,
                        expect_ptr,
                        counter_ptr,
                        BN,
                        BK,
                        STAGES,
                        WARPS,
                        BARRIER,
                        COMPUTE,
                    ),
                ),
                (_producer, (w_desc, op_tab, n_ops, ring, ready, empty, BN, BK, STAGES, LOAD)),
            ],
            [1],
            [24],
        )
    else:
        # X_ROWS rows of BK activations, unswizzled: written as [chunks, X_CHUNK, BK] (a chunk per load),
        # read through a [rows, BK] view whose rank-1 layout lets one row be indexed out.
        x_dtype: gl.constexpr = gl.float16 if F16 else gl.bfloat16
        xs_w = gl.allocate_shared_memory(
            x_dtype, [X_ROWS // X_CHUNK, X_CHUNK, BK], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        )
        xs = xs_w._reinterpret(x_dtype, [X_ROWS, BK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        op_tab,
                        n_ops,
                        ring,
                        ready,
                        empty,
                        xs_w,
                        xs,
                        ysum_ptr,
                        xbuf_ptr,
                        scale_ptr,
                        sema_ptr,
                        expect_ptr,
                        counter_ptr,
                        BN,
                        BK,
                        X_ROWS,
                        X_CHUNK,
                        STAGES,
                        WARPS,
                        COMPUTE,
                        BARRIER,
                        LOAD_POLL,
                        F16,
                        SYNC_RELEASE,
                        FENCE,
                    ),
                ),
                (_producer, (w_desc, op_tab, n_ops, ring, ready, empty, BN, BK, STAGES, LOAD)),
            ],
            [1],
            [24],
        )


@triton.jit
def _read_kernel(src_ptr, blocks, out_ptr, BLOCK: tl.constexpr):
    """Streams `blocks` blocks of int32 words, XORed together so the loads stay."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for b in range(pid, blocks, tl.num_programs(0)):
        acc ^= tl.load(src_ptr + b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK), cache_modifier=".cg")
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


_READ_OUT: dict = {}


def read_all(t: torch.Tensor, block: int = 4096) -> None:
    """One streaming read of t (its bytes a multiple of 4 * block): the read-only bandwidth reference."""
    words = t.view(torch.int32).flatten()
    programs = 8 * torch.cuda.get_device_properties(t.device).multi_processor_count
    out = _READ_OUT.setdefault(t.device, torch.empty(programs * block, dtype=torch.int32, device=t.device))
    _read_kernel[(programs,)](words, words.numel() // block, out, BLOCK=block, num_warps=8)


class Chain:
    """The weights (tile-major), schedule and buffers of a chain of `layers` x QWEN7B operations."""

    def __init__(self, layers: int, programs: int, dev: torch.device) -> None:
        self.ops = [spec for _ in range(layers) for spec in QWEN7B]
        self.programs = programs
        tab, tile0, t = [], [], 0
        y_off, rb_base, prev_out = 0, 0, 0
        out_off = QWEN7B[0][1]  # xbuf[0:K] holds the chain's input
        for j, (n, k, kind) in enumerate(self.ops):
            rbs, kts = n // BN, k // BK
            in_off = 0 if j % len(QWEN7B) == 0 else prev_out  # every QKV reads the chain's input
            tab.append([kts, kind, y_off, out_off, in_off, rb_base, t, rbs * kts])
            tile0.append(t)
            prev_out = out_off
            t += rbs * kts
            y_off += n
            out_off += n // 2 if kind == 1 else n
            rb_base += rbs
        self.tab_rows = tab
        self.tile0 = tile0
        self.total_tiles = t
        self.op_tab = torch.tensor(tab, dtype=torch.int32, device=dev).flatten()
        # each row block's count of programs (contiguous tile ranges [T p / P, T (p + 1) / P))
        expect = torch.zeros(rb_base, dtype=torch.int32)
        for j, (n, k, _) in enumerate(self.ops):
            kts = k // BK
            tiles = (n // BN) * kts
            for p in range(programs):
                lo, hi = tiles * p // programs, tiles * (p + 1) // programs
                assert hi > lo, "every program needs tiles of every operation (the grid barrier counts them)"
                expect[tab[j][5] + torch.arange(lo // kts, (hi - 1) // kts + 1)] += 1
        self.expect = expect.to(dev)
        self.sema = torch.zeros(rb_base, dtype=torch.int32, device=dev)
        self.counter = torch.zeros(1, dtype=torch.int32, device=dev)
        self.grab = torch.zeros(len(self.ops), dtype=torch.int32, device=dev)  # the dynamic chunk counters
        # with chunks taken dynamically, every row block is summed from its K tiles' chunks
        self.expect_dyn = torch.cat(
            [torch.full((n // BN,), k // BK // CHUNK.value, dtype=torch.int32) for n, k, _ in self.ops]
        ).to(dev)
        self.ysum = torch.zeros(y_off, dtype=torch.float32, device=dev)
        self.xbuf = torch.zeros(out_off, dtype=torch.bfloat16, device=dev)
        self.xbuf[: QWEN7B[0][1]] = torch.randn(QWEN7B[0][1], device=dev).to(torch.bfloat16)
        self.wt = torch.empty(t * BN, BK, dtype=torch.float8_e4m3fn, device=dev)
        step = 1 << 24
        for a in range(0, t * BN, step // BK):
            b = min(t * BN, a + step // BK)
            self.wt[a:b] = torch.randn(b - a, BK, device=dev).to(torch.float8_e4m3fn)
        # per-row scales that keep every activation near rms 1 down the chain (with k^-0.5 alone the sums
        # drift geometrically and overflow by the last layer): one torch pass sets each op's scale from its
        # own output, times a random factor in [0.5, 1.5) per row
        self.scale = torch.empty(y_off, device=dev)
        x0 = x = self.xbuf[: QWEN7B[0][1]].float()
        for j, (n, k, kind) in enumerate(self.ops):
            if j % len(QWEN7B) == 0:
                x = x0
            y = self.weight(j).float() @ x[:k]
            s = (0.5 + torch.rand(n, device=dev)) / y.pow(2).mean().sqrt()
            self.scale[tab[j][2] : tab[j][2] + n] = s
            x = self._activation(y * s, kind).to(torch.bfloat16).float()
        self.weight_bytes = self.wt.numel()
        self.maxnreg = int(os.environ.get("MAXNREG", "168"))  # 8 + 4 warps' registers must fit 64K

    def weight(self, j: int) -> torch.Tensor:
        """Op j's logical [N, K] fp8 weight, rebuilt from its tiles."""
        n, k, _ = self.ops[j]
        rbs, kts = n // BN, k // BK
        tiles = self.wt[self.tile0[j] * BN : (self.tile0[j] + rbs * kts) * BN]
        return tiles.view(rbs, kts, BN, BK).permute(0, 2, 1, 3).reshape(n, k)

    def launch(
        self,
        stages: int,
        warps: int,
        compute: bool = True,
        barrier: bool = True,
        load_poll: bool = False,
        f16: bool = False,
        sync_release: bool = True,
        fence: bool = True,
        load: bool = True,
        mma: bool = False,
        dyn: bool = False,
    ):
        """One run of the chain; the flags pick the variants and diagnostics in the kernels' docstrings
        (with `mma`, compute=False drops the activation prologue; `dyn` is the tensor-core consumer with
        chunks taken dynamically, which ignores the diagnostic flags)."""
        self.ysum.zero_()
        self.sema.zero_()
        self.counter.zero_()
        if dyn:
            self.grab.zero_()
        layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv)
        desc = TensorDescriptor(self.wt, list(self.wt.shape), list(self.wt.stride()), [BN, BK], layout)
        return _chain_kernel[(self.programs,)](
            desc,
            self.op_tab,
            len(self.ops),
            self.ysum,
            self.xbuf,
            self.scale,
            self.sema,
            self.expect_dyn if dyn else self.expect,
            self.counter,
            self.grab,
            BN=BN,
            BK=BK,
            X_ROWS=X_ROWS,
            X_CHUNK=X_CHUNK,
            STAGES=stages,
            WARPS=warps,
            COMPUTE=compute,
            BARRIER=barrier,
            LOAD_POLL=load_poll,
            F16=f16,
            SYNC_RELEASE=sync_release,
            FENCE=fence,
            LOAD=load,
            MMA=mma,
            DYN=dyn,
            num_warps=warps,
            maxnreg=self.maxnreg,
        )

    @staticmethod
    def _activation(y: torch.Tensor, kind: int) -> torch.Tensor:
        """An op's output from its scaled sums: as is, or SiLU(gate) * up over 64-row halves of row blocks."""
        if kind != 1:
            return y
        gu = y.view(-1, 2, BN // 2)
        return (torch.nn.functional.silu(gu[:, 0]) * gu[:, 1]).flatten()

    def check(self, j: int, w8a8: bool = False) -> tuple[float, float, float]:
        """Op j's largest error against torch in fp32 on the kernel's own input, over the output's rms;
        the kernel's floor: torch's output rounded to bf16 (the kernel writes bf16), plus with `w8a8`
        torch's own error from fp8 activation codes (one amax scale; the kernel's per-program scales are
        as fine or finer); and the input's rms."""
        n, k, kind = self.ops[j]
        _, _, s_off, out_off, in_off, _, _, _ = self.tab_rows[j]
        x = self.xbuf[in_off : in_off + k].float()
        w, s = self.weight(j).float(), self.scale[s_off : s_off + n]
        y = self._activation((w @ x) * s, kind)
        got = self.xbuf[out_off : out_off + y.numel()].float()
        rms = y.pow(2).mean().sqrt()
        floor = (y.to(torch.bfloat16).float() - y).abs().max() / rms
        if w8a8:
            x_scale = x.abs().max().clamp(min=1e-30) / 448.0
            xq = (x / x_scale).to(torch.float8_e4m3fn).float() * x_scale
            floor = floor + (self._activation((w @ xq) * s, kind) - y).abs().max() / rms
        return ((got - y).abs().max() / rms).item(), floor.item(), x.pow(2).mean().sqrt().item()

    def first_bad_output(self) -> int | None:
        """The first op whose output, as the kernel left it, is not finite."""
        for j, (n, _, kind) in enumerate(self.ops):
            off = self.tab_rows[j][3]
            if not bool(torch.isfinite(self.xbuf[off : off + (n // 2 if kind == 1 else n)]).all()):
                return j
        return None

    def op_outputs(self, count: int) -> list[torch.Tensor]:
        """The first `count` ops' outputs, as the kernel left them (fp32 copies)."""
        return [
            self.xbuf[r[3] : r[3] + (n // 2 if kind == 1 else n)].float().clone()
            for r, (n, _, kind) in zip(self.tab_rows[:count], self.ops[:count])
        ]


def launched_chain(chain: Chain, dev: torch.device):
    """The same chain through qwick's launched kernels: W8A16 GEMVs and SiLU-and-mul, separate weights."""
    from qwick.kernels.elementwise import silu_and_mul
    from qwick.kernels.gemv import gemv, shared_workspace

    ws = shared_workspace(dev)

    def halves_apart(t: torch.Tensor, kind: int) -> torch.Tensor:
        """gate/up rows from the kernel's order (64 gate, 64 up per row block) to silu_and_mul's (all the
        gate rows, then all the up rows), so both chains compute the same function."""
        if kind != 1:
            return t.contiguous()
        return t.reshape(-1, 2, BN // 2, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()

    weights = [
        (
            halves_apart(chain.weight(j), chain.ops[j][2]),
            halves_apart(chain.scale[r[2] : r[2] + chain.ops[j][0]], chain.ops[j][2]),
        )
        for j, r in enumerate(chain.tab_rows)
    ]
    x0 = chain.xbuf[: QWEN7B[0][1]].view(1, -1).clone()

    def run(keep: int = 0) -> list[torch.Tensor]:
        """The chain; the first `keep` ops' outputs are returned."""
        h, kept = x0, []
        for j, (w, s) in enumerate(weights):
            _, k, kind = chain.ops[j]
            if j % len(QWEN7B) == 0:
                h = x0
            y = gemv(h[:, :k].contiguous() if h.shape[1] != k else h, w, None, ws, weight_scale=s)
            h = silu_and_mul(y) if kind == 1 else y
            if j < keep:
                kept.append(h.float().flatten().clone())
        return kept

    return run


def copy_tb_s(graph_us, dev: torch.device) -> float:
    """A 1 GB device-to-device copy's bandwidth, read + write."""
    src = torch.empty(1 << 29, dtype=torch.int16, device=dev)
    dst = torch.empty_like(src)
    for _ in range(200):  # ~0.2 s of copies first: the clocks ramp up under load
        dst.copy_(src)
    return 2 * src.nbytes / graph_us(lambda: dst.copy_(src), calls=4, replays=5) / 1e6


def main() -> None:
    from qwick.bench.gpu_timing import graph_us

    out_path = sys.argv[1] if len(sys.argv) > 1 else "persistent_gemv_chain.json"
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    layers = int(os.environ.get("LAYERS", "28"))
    warps = int(os.environ.get("WARPS", "8"))
    stages_list = [int(s) for s in os.environ.get("STAGES", "6 8 10").split()]
    chain = Chain(layers, sms, dev)
    result = {"layers": layers, "programs": sms, "weight_bytes": chain.weight_bytes, "runs": []}
    print(
        f"{layers} layers, {chain.weight_bytes / 1e9:.3f} GB of fp8 weights, {chain.total_tiles} tiles, "
        f"{sms} programs",
        flush=True,
    )

    # the bandwidth references: a 1 GB device-to-device copy, and one streaming read of the chain's weights
    copy_bw = copy_tb_s(graph_us, dev)
    read_us = graph_us(lambda: read_all(chain.wt), calls=1, replays=10)
    result.update(copy_tb_s=copy_bw, read_us=read_us, read_tb_s=chain.weight_bytes / read_us / 1e6)
    print(
        f"copy {copy_bw:.2f} TB/s (read + write); the weights read once {read_us:.1f} us, "
        f"{result['read_tb_s']:.2f} TB/s",
        flush=True,
    )

    memset_us = graph_us(
        lambda: (chain.ysum.zero_(), chain.sema.zero_(), chain.counter.zero_()), calls=1, replays=20
    )
    result["memset_us"] = memset_us

    def verify(stages: int, **kw) -> dict:
        """One launch, then every op checked against torch on the kernel's own input: within twice the
        floor (torch's own bf16 rounding, and for W8A8 its fp8-code error) plus 1e-3 passes."""
        chain.xbuf[QWEN7B[0][1] :] = 0
        chain.launch(stages, warps, **kw)
        torch.cuda.synchronize()
        w8a8 = kw.get("mma", False) or kw.get("dyn", False)
        errs = [chain.check(j, w8a8=w8a8) for j in range(len(chain.ops))]
        # a guard: ops whose input's rms left [1/16, 16] are not checked. With no norms, gate/up squares
        # its input's scale, so a chain through all the layers drifted from torch's (whose rms set the
        # scales) by layer ~12 and overflowed by ~18; every QKV now reads the chain's input instead.
        sane = [j for j, (_, _, xr) in enumerate(errs) if 1 / 16 <= xr <= 16]
        drift = next((j for j in range(len(errs)) if j not in sane), None)
        wrong = [j for j in sane if not errs[j][0] <= 2 * errs[j][1] + 1e-3]  # NaN counts as wrong
        return {
            "correct": not wrong,
            "checked_ops": len(sane),
            "first_op_out_of_range": drift,
            "first_wrong_op": wrong[0] if wrong else None,
            "wrong_ops": len(wrong),
            "first_not_finite_op": chain.first_bad_output(),
            "max_rel_err": max(errs[j][0] for j in sane),
            "max_floor": max(errs[j][1] for j in sane),
            "input_rms": [round(xr, 4) for _, _, xr in errs],
            "outputs": chain.op_outputs(8),
        }

    def timed(name: str, stages: int, **kw) -> dict:
        row = verify(stages, **kw)
        out = row.pop("outputs")
        row.update(
            variant=name,
            stages=stages,
            warps=warps,
            us=graph_us(lambda: chain.launch(stages, warps, **kw), calls=1, replays=20),
        )
        row["tb_s"] = chain.weight_bytes / (row["us"] - memset_us) / 1e6
        result["runs"].append(row)
        print(
            f"persistent {name}, {stages} stages, {warps} warps: {row['us']:.1f} us a chain "
            f"({memset_us:.1f} of it memsets), {row['tb_s']:.2f} TB/s; correct {row['correct']} (max "
            f"error / rms {row['max_rel_err']:.2e}, floor {row['max_floor']:.2e}; "
            f"{row['checked_ops']} ops checked, the first left unchecked {row['first_op_out_of_range']}; "
            f"wrong ops {row['wrong_ops']}, first {row['first_wrong_op']}; first not finite "
            f"{row['first_not_finite_op']})",
            flush=True,
        )
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
        return {**row, "outputs": out}

    base = [timed("fp32 math", stages) for stages in stages_list]
    best = min(base, key=lambda r: r["us"])["stages"]
    outputs = base[0]["outputs"]
    timed("fp32 math, barrier polled with volatile loads", best, load_poll=True)
    timed("fp16 tile sums", best, f16=True)
    timed(
        "fp32 math, slot released by thread 0 without a barrier (the earlier race)", best, sync_release=False
    )
    timed("fp32 math, no proxy fence before a slot's release", best, fence=False)
    timed("fp32 math, no fence, fp16 tile sums", best, fence=False, f16=True)
    for stages in (6, 8):  # the ring and the 64 KB of activation blocks must fit 227 KB
        timed("wgmma (W8A8: fp8 activation codes)", stages, mma=True)
        timed("wgmma, chunks of 4 tiles taken dynamically, codes per 8 K tiles", stages, dyn=True)
    # diagnostics (outputs not checked): without the multiply-adds, without the barrier, without both
    for name, kw in [
        ("no_compute", dict(compute=False)),
        ("no_barrier", dict(barrier=False)),
        ("no_compute_no_barrier", dict(compute=False, barrier=False)),
        ("fp16_no_barrier", dict(f16=True, barrier=False)),
        ("no_fence_no_barrier", dict(fence=False, barrier=False)),
        ("consumers_alone_no_barrier", dict(load=False, barrier=False)),
        ("consumers_alone", dict(load=False)),
        ("wgmma_no_barrier", dict(mma=True, barrier=False)),
        ("wgmma_consumers_alone_no_barrier", dict(mma=True, load=False, barrier=False)),
        ("wgmma_consumers_alone", dict(mma=True, load=False)),
        ("wgmma_no_prologue", dict(mma=True, compute=False)),
        ("wgmma_consumers_alone_no_prologue", dict(mma=True, load=False, compute=False)),
    ]:
        us = graph_us(lambda kw=kw: chain.launch(best, warps, **kw), calls=1, replays=20)
        result[name + "_us"] = us
        print(
            f"persistent, {name.replace('_', ' ')} ({best} stages): {us:.1f} us a chain, "
            f"{chain.weight_bytes / (us - memset_us) / 1e6:.2f} TB/s",
            flush=True,
        )

    run = launched_chain(chain, dev)
    refs = run(len(outputs))
    us = graph_us(run, calls=1, replays=20)
    diff = max(((o - r).pow(2).mean() / r.pow(2).mean()).sqrt().item() for o, r in zip(outputs, refs))
    result.update(launched_us=us, first_ops_max_rel_rms_diff=diff)
    print(
        f"launched W8A16 GEMVs + SiLU-and-mul: {us:.1f} us a chain, {chain.weight_bytes / us / 1e6:.2f} "
        f"TB/s; its first {len(refs)} outputs against the persistent chain's: relative rms difference up "
        f"to {diff:.2e}",
        flush=True,
    )
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
