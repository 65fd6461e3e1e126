"""Batch-1 int4 GEMV with the products on the tensor cores (`mma.sync` m16n8k16), in Gluon, against the
engine's packed-fp16 CUDA-core kernel (`qwick.kernels.row_gemv_half2`) at the qwen2.5-7b layer shapes.

Why: the f16x2 kernel spends ~13 instructions per word of eight codes (decode, pair, multiply-add, sum)
and streams the 7b gate/up at ~2.8 TB/s, issue- and latency-bound with few warps resident. Here the
multiply-adds and the sums move to the tensor cores, and the decode is 5 instructions per word: the
weight is the mma's A operand (16 rows x 16 K), the activations its B (16 K x 8 columns, every column the
same x), so every lane's C holds its rows' dot products. It reads the engine's int4 layout as it is
(`QuantizedWeight`: words of eight codes along K); only the mapping from the mma's K index to the
weight's K is chosen to fit it. Lane (g, t) of a warp takes rows g and g + 8 of a 16-row tile and, per
step of 16 words, words 4 t .. 4 t + 3 of each (one 16-byte load per row): the four lanes t hold the 16
words of one group of 128 codes. From one word X of row g and the same word Y of row g + 8:

    lop3(X, 0x000F000F, 0x64006400) = (1024 + q0, 1024 + q4)        a0a1 of mma 1 (row g, k 2t, 2t+1)
    lop3(X, 0x00F000F0, 0x64006400) = (1024 + 16 q1, 1024 + 16 q5)  a4a5 of mma 1 (row g, k 2t+8, 2t+9)

and the same from Y (a2a3, a6a7), then from X >> 8 and Y >> 8 (codes 2, 6 and 3, 7) for mma 2. The B
pairs hold x / 64 for the first kind and x / 1024 for the second (the 16 q cancels), so a group's sums
come out as sum(q x / 64) + O, where O = 1024 * (sum of the B values) is the same for every row. O and
S = sum(x / 64) per step are made with the B operand, and each group adds s * (tot - O - z S) to the
row's fp32 sum. The B operand (four f16x2 per word, in the order the lanes load them, then O and S) is
made by a small launch here; in the engine, x's producer (RMSNorm, SiLU-and-mul) would write it, as it
writes the f16x2 kernel's `HalfPairs` today. The codes reach the registers either by plain loads one pair
of steps ahead (depth 0) or through DEPTH stages of shared memory (cp.async).

Each launch shape is checked against float64, then timed as decode runs it: CUDA-graph replays over
weight copies that together overflow the L2 (the harness of `benchmarks/int4_half2_sweep.py`), beside
the f16x2 kernel pairing x in registers and reading its producer's `HalfPairs` (what decode runs).

Result (30th session, H200, us): it loses. Best mma against f16x2 with the producer's pairs: gate/up
24.09 against 23.92, down 16.19 against 15.81, qkv 6.88 against 6.08, o 6.49 against 5.70 (53.7 against
51.5 per layer, the mma's B operand counted as free). It beats f16x2 only when that kernel pairs x in
registers (gate/up 25.94, down 17.19). Nsight Compute: 13.8% achieved occupancy, 25.6% issue slots
busy, stalls on L1TEX scoreboards; half the instructions of f16x2 but no faster, so instruction count
is not what limits the batch-1 int4 GEMV. DIAG=1: with the loop's scale and zero-point loads dropped,
gate/up 22.6-24.5; with only the codes loaded, 21.7-27.9; deeper cp.async pipelines do not help (they
add a CTA barrier per step). Even the codes alone stream at most ~3.3 TB/s in this structure. Splitting
each step's eight mmas into 2 or 4 independent chains (CHAINS) brings the best launches to gate/up 23.99,
down 15.68, qkv 6.60, o 5.99: 52.3 us per layer against f16x2's 51.7 in the same call, still no win.

    python benchmarks/int4_mma_gemv.py out.json      # env SHAPES, MTS, DEPTHS, CHAINS narrow it
    DIAG=1 python benchmarks/int4_mma_gemv.py out.json
    NCU=1,4,1,0 ncu --clock-control none --profile-from-start off --set full \
        python benchmarks/int4_mma_gemv.py
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

sys.path.insert(0, os.getcwd())
from qwick.kernels.gemv import GemvWorkspace  # noqa: E402
from qwick.kernels.row_gemv_half2 import default_half2_config, half_pairs, w4_half2_gemv  # noqa: E402
from qwick.quantization.formats import rtn  # noqa: E402
from qwick.quantization.formats.layout import QuantizedWeight, dequantize  # noqa: E402

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
L2_OVERFLOW = 200 << 20
STEP_WORDS = 16  # words of a row per step: 4 lanes x 4 words, one group of 128 codes
# cp.async from global to shared memory: `async_load` from Triton 3.7 on, the older name before
MTS = tuple(int(v) for v in os.environ.get("MTS", "1 2").split())  # 16-row tiles per warp
CHAINS = tuple(int(v) for v in os.environ.get("CHAINS", "1 2").split())  # independent mma chains per step
DEPTHS = tuple(int(v) for v in os.environ.get("DEPTHS", "0 2 4 6").split())  # code pairs in shared memory
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


def _mma(d: str, a: list[str], b: str, c: str) -> str:
    return f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d}, {{{', '.join(a)}}}, {b}, {c};"


def _regs(first: int, n: int = 4) -> str:
    return "{" + ", ".join(f"${first + i}" for i in range(n)) + "}"


def _chain(acc: str, x: list[str], y: list[str], b: list[int], words: range) -> list[str]:
    """PTX of one step's mmas over `words` for one lane, summed into `acc` (four .f32 registers, zeroed
    first): words x[j] of row g and y[j] of row g + 8, and the B pairs of word j at $b[j] .. $b[j] + 3."""
    lines = [f"mov.b32 {r}, 0;" for r in acc.strip("{}").split(", ")]
    for j in words:
        lines += [
            f"lop3.b32 a0, {x[j]}, 0x000F000F, 0x64006400, 0xEA;",
            f"lop3.b32 a1, {y[j]}, 0x000F000F, 0x64006400, 0xEA;",
            f"lop3.b32 a2, {x[j]}, 0x00F000F0, 0x64006400, 0xEA;",
            f"lop3.b32 a3, {y[j]}, 0x00F000F0, 0x64006400, 0xEA;",
            _mma(acc, ["a0", "a1", "a2", "a3"], _regs(b[j], 2), acc),
            f"shr.u32 xs, {x[j]}, 8;",
            f"shr.u32 ys, {y[j]}, 8;",
            "lop3.b32 a0, xs, 0x000F000F, 0x64006400, 0xEA;",
            "lop3.b32 a1, ys, 0x000F000F, 0x64006400, 0xEA;",
            "lop3.b32 a2, xs, 0x00F000F0, 0x64006400, 0xEA;",
            "lop3.b32 a3, ys, 0x00F000F0, 0x64006400, 0xEA;",
            _mma(acc, ["a0", "a1", "a2", "a3"], _regs(b[j] + 2, 2), acc),
        ]
    return lines


def _pair_asm(chains: int = 1) -> str:
    """PTX of two steps (A, B) of one lane, pack=4: outputs the step sums of row g for A ($0) and B ($1),
    and of row g + 8 for A ($2) and B ($3) (c0 and c2 of each chain: every column of C is the same);
    inputs the words j = 0-3 of A's rows g ($4-$7) and g + 8 ($8-$11), of B's ($12-$15, $16-$19), then the
    B pairs of A's word j at $20 + 4 j .. $23 + 4 j (kinds 0-3, one 16-byte load) and of B's at $36 + 4 j.
    Each step's eight mmas run as `chains` independent accumulations (8 / chains deep), summed at the end:
    with one wave of few warps resident, a warp's own independent mmas are what can hide their latency."""
    per = 4 // chains
    accs = {(s, c): [f"{s}{c}_{i}" for i in range(4)] for s in "pq" for c in range(chains)}
    lines = ["{", ".reg .b32 a0, a1, a2, a3, xs, ys;"]
    lines += [f".reg .f32 {', '.join(regs)};" for regs in accs.values()]
    for s, first in (("p", 4), ("q", 12)):
        x, y = [f"${first + j}" for j in range(4)], [f"${first + 4 + j}" for j in range(4)]
        b = [(20 if s == "p" else 36) + 4 * j for j in range(4)]
        for c in range(chains):
            acc = "{" + ", ".join(accs[s, c]) + "}"
            lines += _chain(acc, x, y, b, range(c * per, (c + 1) * per))
        for c in range(1, chains):  # rows g (c0) and g + 8 (c2)
            lines += [f"add.f32 {s}0_0, {s}0_0, {s}{c}_0;", f"add.f32 {s}0_2, {s}0_2, {s}{c}_2;"]
    lines += ["mov.b32 $0, p0_0;", "mov.b32 $1, q0_0;", "mov.b32 $2, p0_2;", "mov.b32 $3, q0_2;"]
    return "\n".join([*lines, "}"])


PAIR_ASMS = {chains: _pair_asm(chains) for chains in (1, 2, 4)}


@triton.jit
def _b_operand_kernel(x_ptr, b_ptr, os_ptr, KW, STEPS: tl.constexpr):
    """x [K] bf16/fp16 -> the B pairs of every word w, kinds i = 0-3: (x[8w], x[8w+4]) / 64,
    (x[8w+1], x[8w+5]) / 1024, (x[8w+2], x[8w+6]) / 64, (x[8w+3], x[8w+7]) / 1024 in fp16, at 4 w + i (the
    four pairs of a word are one 16-byte load, and consecutive registers for the mma); and per step of 16
    words (128 codes) O = 1024 * (the sum of its B values) and S = the sum of x / 64 as the pairs hold
    it (kinds 1 and 3 times 16), at os_ptr[2 step] and [2 step + 1], in fp32."""
    st = tl.program_id(0) * STEPS + tl.arange(0, STEPS)
    w = st[:, None] * 16 + tl.arange(0, 16)[None, :]  # [STEPS, 16]
    ok = w < KW
    o = tl.zeros((STEPS, 16), tl.float32)
    sx = tl.zeros((STEPS, 16), tl.float32)
    for i in tl.static_range(4):
        div = 64.0 if i % 2 == 0 else 1024.0
        lo = (tl.load(x_ptr + 8 * w + i, mask=ok, other=0.0).to(tl.float32) / div).to(tl.float16)
        hi = (tl.load(x_ptr + 8 * w + i + 4, mask=ok, other=0.0).to(tl.float32) / div).to(tl.float16)
        pair_sum = lo.to(tl.float32) + hi.to(tl.float32)
        o += pair_sum
        sx += pair_sum * (1.0 if i % 2 == 0 else 16.0)
        lo_b = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi_b = hi.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        tl.store(b_ptr + 4 * w + i, lo_b | (hi_b << 16), mask=ok)
    st_ok = st < KW // 16
    tl.store(os_ptr + 2 * st, 1024.0 * tl.sum(o, axis=1), mask=st_ok)
    tl.store(os_ptr + 2 * st + 1, tl.sum(sx, axis=1), mask=st_ok)


def b_operand(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """x [1, K] -> (the B pairs, int32 [K / 2]; O and S per step, fp32 [K / 64])."""
    kw = x.numel() // 8
    if out is None:
        out = (
            torch.empty(kw * 4, dtype=torch.int32, device=x.device),
            torch.empty(kw // 16 * 2, dtype=torch.float32, device=x.device),
        )
    _b_operand_kernel[(triton.cdiv(kw // 16, 8),)](x, out[0], out[1], kw, STEPS=8)
    return out


@gluon.jit
def _load_codes(px, py, q, ok_x, ok_y, live, CODE_CACHE: gl.constexpr):
    """Pair q's codes: words of steps 2 q and 2 q + 1, rows g (x) and g + 8 (y), one 16-byte load each."""
    xa = gl.load(px + q * 32, mask=ok_x & live, other=0, cache_modifier=CODE_CACHE)
    ya = gl.load(py + q * 32, mask=ok_y & live, other=0, cache_modifier=CODE_CACHE)
    xb = gl.load(px + q * 32 + 16, mask=ok_x & live, other=0, cache_modifier=CODE_CACHE)
    yb = gl.load(py + q * 32 + 16, mask=ok_y & live, other=0, cache_modifier=CODE_CACHE)
    return xa, ya, xb, yb


@gluon.jit
def _async_codes(cxa, cya, cxb, cyb, stage, px, py, q, ok_x, ok_y, live):
    """`_load_codes` into shared-memory stage `stage` by cp.async, as one commit group."""
    _async_load(cxa.index(stage), px + q * 32, mask=ok_x & live)
    _async_load(cya.index(stage), py + q * 32, mask=ok_y & live)
    _async_load(cxb.index(stage), px + q * 32 + 16, mask=ok_x & live)
    _async_load(cyb.index(stage), py + q * 32 + 16, mask=ok_y & live)
    async_copy.commit_group()


@gluon.jit
def _load_x_operand(pb, os_ptr, q, slot_step):
    """Pair q's B pairs (four 16-byte loads per step) and each slot's step's O and S."""
    ba = pb + q * 128
    st = 2 * q + slot_step
    return (
        gl.load(ba), gl.load(ba + 4), gl.load(ba + 8), gl.load(ba + 12),
        gl.load(ba + 64), gl.load(ba + 68), gl.load(ba + 72), gl.load(ba + 76),
        gl.load(os_ptr + 2 * st), gl.load(os_ptr + 2 * st + 1),
    )  # fmt: skip


@gluon.jit
def _load_scales(
    s_rows, z_rows, ok_s, q, slot_step, z_const, GROUP_STEPS: gl.constexpr, ZERO_MODE: gl.constexpr
):
    """Each slot's scale and zero point for pair q, as stored (z_const without zero points)."""
    grp = (2 * q + slot_step) // GROUP_STEPS
    sc = gl.load(s_rows + grp, mask=ok_s, other=0.0)
    if ZERO_MODE == 1:
        z = gl.load(z_rows + grp, mask=ok_s, other=0)
    else:
        z = z_const
    return sc, z


@gluon.jit
def _mma_gemv_kernel(
    b_ptr,
    os_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    N,
    KW,
    stride_qn,
    stride_sn,
    ZERO_POINT: gl.constexpr,
    ZERO_MODE: gl.constexpr,
    SPLIT_K: gl.constexpr,
    GROUP_STEPS: gl.constexpr,
    MT: gl.constexpr,
    WARPS: gl.constexpr,
    PAIR: gl.constexpr,
    DEPTH: gl.constexpr,
    DIAG: gl.constexpr,
    CODE_CACHE: gl.constexpr,
):
    """y[n] = sum_k (q[n, k] - z[n, g]) s[n, g] x[k] for the rows [16 MT WARPS pid_n, ...) and the K pairs of
    steps (32 words) of split pid_k. Tensors are [MT * WARPS, 8, 4, 4]: (16-row tile, lane row g, lane t,
    word j); a warp holds MT tiles, a lane the four words j of each of its rows in a step in registers (one
    16-byte load per row and step)."""
    L4: gl.constexpr = gl.BlockedLayout([MT, 1, 1, 4], [1, 8, 4, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    M: gl.constexpr = MT * WARPS
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    m = gl.arange(0, M, layout=gl.SliceLayout(1, L2))
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, L2))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    m4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(m, 1), 2), 3)  # [M, 1, 1, 1]
    g4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(g, 0), 2), 3)  # [1, 8, 1, 1]
    t4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(t, 0), 1), 3)  # [1, 1, 4, 1]
    j4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(j, 0), 1), 2)  # [1, 1, 1, 4]
    row_x = pid_n * (16 * M) + 16 * m4 + g4  # row g of each tile
    row_y = row_x + 8
    word = 4 * t4 + j4  # the lane's words of a step
    ok_x = row_x < N
    ok_y = row_y < N
    px = qw_ptr + row_x.to(gl.int64) * stride_qn + word  # + 16 per step
    py = qw_ptr + row_y.to(gl.int64) * stride_qn + word
    pb = b_ptr + t4 * 16 + j4  # + 64 step + 4 w: word 16 step + 4 t + w, pair kind j4 (the last index here)
    # a pair's sums come out in the slots j: row g + 8 (j // 2), step 2 p + j % 2
    rows = row_x + 8 * (j4 // 2)  # [M, 8, 1, 4]
    ok_s = rows < N
    s_rows = s_ptr + rows.to(gl.int64) * stride_sn
    z_rows = z_ptr + rows.to(gl.int64) * stride_sn
    slot_step = j4 % 2  # [1, 1, 1, 4]

    n_pairs = KW // 32
    per_split = gl.cdiv(n_pairs, SPLIT_K)
    p_lo = pid_k * per_split
    p_hi = gl.minimum(p_lo + per_split, n_pairs)
    acc = gl.zeros([M, 8, 4, 4], gl.float32, L4)
    any_work = p_lo < p_hi
    # Every load of pair p + 1 (B pairs, O and S, scales, zero points, and with DEPTH 0 the codes) is issued
    # before pair p's mmas, so no warp waits on a load issued in the same iteration (the first version
    # waited on its scale and zero-point loads there, 40% of its stall samples). With DEPTH > 0 the codes
    # come through shared memory instead, DEPTH pairs in flight per warp (cp.async, one group per pair):
    # the bytes in flight then cost shared memory, not registers. Indices past the split clamp to its end.
    q = gl.minimum(p_lo, n_pairs - 1)
    if DEPTH == 0:
        xa, ya, xb, yb = _load_codes(px, py, q, ok_x, ok_y, any_work, CODE_CACHE)
    else:
        SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])  # a [M, 8, 4, 4] stage
        cxa = gl.allocate_shared_memory(gl.int32, [DEPTH, M, 8, 4, 4], SL)
        cya = gl.allocate_shared_memory(gl.int32, [DEPTH, M, 8, 4, 4], SL)
        cxb = gl.allocate_shared_memory(gl.int32, [DEPTH, M, 8, 4, 4], SL)
        cyb = gl.allocate_shared_memory(gl.int32, [DEPTH, M, 8, 4, 4], SL)
        for i in gl.static_range(DEPTH):
            qi = gl.minimum(p_lo + i, n_pairs - 1)
            _async_codes(cxa, cya, cxb, cyb, i, px, py, qi, ok_x, ok_y, p_lo + i < p_hi)
    b0, b1, b2, b3, b4, b5, b6, b7, off, sx = _load_x_operand(pb, os_ptr, q, slot_step)
    # scales and zero points are carried as loaded and converted where used: a conversion right after the
    # load would wait for it at the end of the iteration that issued it
    z_const = gl.zeros([1, 1, 1, 4], gl.float32, L4) + ZERO_POINT
    sc, z = _load_scales(s_rows, z_rows, ok_s, q, slot_step, z_const, GROUP_STEPS, ZERO_MODE)
    for p in range(p_lo, p_hi):
        q = gl.minimum(p + 1, p_hi - 1)
        if DEPTH == 0:
            nxa, nya, nxb, nyb = _load_codes(px, py, q, ok_x, ok_y, p + 1 < p_hi, CODE_CACHE)
        else:
            stage = (p - p_lo) % DEPTH
            async_copy.wait_group(DEPTH - 1)  # pair p's group has landed
            xa = cxa.index(stage).load(L4)
            ya = cya.index(stage).load(L4)
            xb = cxb.index(stage).load(L4)
            yb = cyb.index(stage).load(L4)
        if DIAG < 2:
            nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7, noff, nsx = _load_x_operand(pb, os_ptr, q, slot_step)
        else:
            nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7 = b0, b1, b2, b3, b4, b5, b6, b7
            noff, nsx = off, sx
        if DIAG < 1:
            nsc, nz = _load_scales(s_rows, z_rows, ok_s, q, slot_step, z_const, GROUP_STEPS, ZERO_MODE)
        else:
            nsc, nz = sc, z
        sums = gl.inline_asm_elementwise(
            PAIR, "=r,=r,=r,=r" + ",r" * 48, [xa, ya, xb, yb, b0, b1, b2, b3, b4, b5, b6, b7],
            dtype=gl.float32, is_pure=True, pack=4,
        )  # fmt: skip
        acc += sc.to(gl.float32) * (sums - off - z.to(gl.float32) * sx)
        if DEPTH == 0:
            xa, ya, xb, yb = nxa, nya, nxb, nyb
        else:
            # the stage just read (its values are in registers, consumed above) takes pair p + DEPTH
            qd = gl.minimum(p + DEPTH, n_pairs - 1)
            _async_codes(cxa, cya, cxb, cyb, stage, px, py, qd, ok_x, ok_y, p + DEPTH < p_hi)
        b0, b1, b2, b3, b4, b5, b6, b7 = nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7
        off, sx, sc, z = noff, nsx, nsc, nz
    if DEPTH > 0:
        async_copy.wait_group(0)
    # rows g (slots 0, 1) and g + 8 (slots 2, 3): each the sum of its two slots, in registers
    lo = gl.sum(gl.where(j4 < 2, acc, 0.0), axis=3) * 64.0  # [M, 8, 4]
    hi = gl.sum(gl.where(j4 >= 2, acc, 0.0), axis=3) * 64.0
    row3 = (
        pid_n * (16 * M)
        + 16 * gl.expand_dims(gl.expand_dims(m, 1), 2)
        + gl.expand_dims(gl.expand_dims(g, 0), 2)
        + 0 * gl.expand_dims(gl.expand_dims(t, 0), 1)
    )  # [M, 8, 4]: row g
    lane0 = gl.expand_dims(gl.expand_dims(t, 0), 1) == 0  # the t lanes hold the same sums; lane 0 writes
    ok_lo = (row3 < N) & lane0
    ok_hi = (row3 + 8 < N) & lane0
    if SPLIT_K == 1:
        gl.store(y_ptr + row3, lo.to(y_ptr.dtype.element_ty), mask=ok_lo)
        gl.store(y_ptr + row3 + 8, hi.to(y_ptr.dtype.element_ty), mask=ok_hi)
    else:
        gl.store(ws_ptr + pid_k * N + row3, lo, mask=ok_lo)
        gl.store(ws_ptr + pid_k * N + row3 + 8, hi, mask=ok_hi)
        gl.thread_barrier()
        done = gl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            lo = gl.zeros([M, 8, 4], gl.float32, L3)
            hi = gl.zeros([M, 8, 4], gl.float32, L3)
            for sk in range(SPLIT_K):
                lo += gl.load(ws_ptr + sk * N + row3, mask=ok_lo, other=0.0, cache_modifier=".cg")
                hi += gl.load(ws_ptr + sk * N + row3 + 8, mask=ok_hi, other=0.0, cache_modifier=".cg")
            gl.store(y_ptr + row3, lo.to(y_ptr.dtype.element_ty), mask=ok_lo)
            gl.store(y_ptr + row3 + 8, hi.to(y_ptr.dtype.element_ty), mask=ok_hi)
            gl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def mma_gemv(
    bx: tuple[torch.Tensor, torch.Tensor],
    weight: QuantizedWeight,
    ws: GemvWorkspace,
    *,
    mt: int = 2,
    warps: int = 4,
    split_k: int = 1,
    depth: int = 0,
    diag: int = 0,
    code_cache: str = "",
    chains: int = 1,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x @ W.T for one row, x given as its B operand (`b_operand`); int4 groups of 128 or 256."""
    n, k = weight.shape
    kw = k // 8
    unsupported = weight.perm is not None or weight.mins is not None
    if weight.bits != 4 or weight.group_size % 128 or unsupported or kw % 32:
        raise ValueError("int4 in groups of 128 or 256 with zero points, no act-order, no mins, K % 256 == 0")
    rows = 16 * mt * warps
    tiles = triton.cdiv(n, rows)
    if split_k > 1:
        ws.check(split_k, 1, n, tiles, ("mma", rows, split_k))
    y = torch.empty((1, n), dtype=out_dtype, device=bx[0].device)
    _mma_gemv_kernel[(tiles, split_k)](
        bx[0],
        bx[1],
        weight.qweight,
        weight.scales,
        weight.zeros if weight.zeros is not None else weight.scales,
        y,
        ws.partials,
        ws.counters,
        n,
        kw,
        weight.qweight.stride(0),
        weight.scales.stride(0),
        ZERO_POINT=weight.zero_point,
        ZERO_MODE=1 if weight.zeros is not None else 0,
        SPLIT_K=split_k,
        GROUP_STEPS=weight.group_size // 128,
        MT=mt,
        WARPS=warps,
        PAIR=PAIR_ASMS[chains],
        DEPTH=depth,
        DIAG=diag,
        CODE_CACHE=code_cache,
        num_warps=warps,
    )
    return y


def l2_overflowing_copies(qw: QuantizedWeight) -> list[QuantizedWeight]:
    """Copies of the codes that together overflow the L2, so each call streams its weight from DRAM."""
    return [replace(qw, qweight=qw.qweight.clone()) for _ in range(max(1, -(-L2_OVERFLOW // qw.nbytes)))]


def graph_us(calls, n: int) -> float:
    calls()  # compile outside the capture
    return triton.testing.do_bench_cudagraph(calls, rep=40, return_mode="median") * 1e3 / n


def profile_one_launch_each() -> None:
    """With NCU="mt,warps,split,depth": one launch of the f16x2 kernel and of that mma kernel at gate/up,
    each on weights the L2 does not hold, between profiler start and stop, for Nsight Compute."""
    dev = torch.device("cuda")
    ws = GemvWorkspace(dev, max_elems=1 << 24)
    n, k = SHAPES["gate_up"]
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    qw = rtn.quantize(w, group_size=128)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    copies = [replace(qw, qweight=qw.qweight.clone()) for _ in range(4)]
    bx = b_operand(x)
    cfg = default_half2_config(n, k // 8, ws.num_sms)
    w4_half2_gemv(x, copies[0], None, ws, cfg)  # compile both outside the profiled range
    mt, warps, split, depth = (int(v) for v in os.environ["NCU"].split(","))
    mma_gemv(bx, copies[1], ws, mt=mt, warps=warps, split_k=split, depth=depth)
    flush = torch.empty(L2_OVERFLOW, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    flush.zero_()
    w4_half2_gemv(x, copies[2], None, ws, cfg)
    flush.zero_()
    mma_gemv(bx, copies[3], ws, mt=mt, warps=warps, split_k=split, depth=depth)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


DIAG_SHAPES = {  # the best launch shapes of the sweep: (16-row tiles per warp, warps, split, code depth)
    "gate_up": [(1, 4, 1, 0), (2, 4, 1, 0), (1, 4, 1, 2)],
    "down": [(1, 4, 8, 0), (1, 4, 8, 2), (2, 4, 16, 0)],
}


def diagnose() -> None:
    """With DIAG=1: where the time goes, at the best launch shapes. Each is timed in full, with the
    scale and zero-point loads of the loop dropped (the first group's reused: wrong sums), and with the B
    pair and O / S loads dropped too (only the codes stream); the register-path ones also with the codes
    loaded past the L1 (`.cg`). Prints and writes us per call."""
    dev = torch.device("cuda")
    ws = GemvWorkspace(dev, max_elems=1 << 24)
    report = {}
    for name, shapes in DIAG_SHAPES.items():
        n, k = SHAPES[name]
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        qw = rtn.quantize(w, group_size=128)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        copies = l2_overflowing_copies(qw)
        bx = b_operand(x)
        variants = [(0, ""), (0, ".cg"), (1, ""), (2, ""), (2, ".cg")]
        for (mt, warps, split, depth), (diag, cache), chains in itertools.product(shapes, variants, CHAINS):
            if depth and cache:
                continue  # cp.async already bypasses the L1

            launch = dict(
                mt=mt, warps=warps, split_k=split, depth=depth, diag=diag, code_cache=cache, chains=chains
            )

            def calls(copies=copies, bx=bx, launch=launch) -> None:
                for c in copies:
                    mma_gemv(bx, c, ws, **launch)

            t = graph_us(calls, len(copies))
            what = ("full", "no scale / zero loads", "codes only")[diag]
            what += f", codes {cache}" if cache else ""
            label = (
                f"{name} {mt}x16 rows x {warps} warps, split {split}, depth {depth}, {chains} chains: {what}"
            )
            report[label] = t
            print(f"{label:76s} {t:7.2f} us {qw.nbytes / t / 1e6:5.2f} TB/s", flush=True)
    with open(sys.argv[1] if len(sys.argv) > 1 else "int4_mma_diag.json", "w") as f:
        json.dump(report, f, indent=1)


def main() -> None:
    if os.environ.get("NCU"):
        return profile_one_launch_each()
    if os.environ.get("DIAG"):
        return diagnose()
    dev = torch.device("cuda")
    ws = GemvWorkspace(dev, max_elems=1 << 24)
    report = {}
    only = os.environ.get("SHAPES")
    for name, (n, k) in SHAPES.items():
        if only and name not in only.split():
            continue
        torch.manual_seed(0)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        qw = rtn.quantize(w, group_size=128)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = x.double() @ dequantize(qw).double().T
        nbytes = qw.nbytes
        copies = l2_overflowing_copies(qw)
        bx = b_operand(x)
        rows = []
        half2_cfg = default_half2_config(n, k // 8, ws.num_sms)
        out = w4_half2_gemv(x, qw, None, ws, half2_cfg).double()
        err = ((out - ref).norm() / ref.norm()).item()

        # as in decode: x's producer (RMSNorm, SiLU-and-mul) has written its `HalfPairs` operand
        pairs = half_pairs(x)
        out = w4_half2_gemv(x, qw, None, ws, half2_cfg, pairs=pairs).double()
        err_pairs = ((out - ref).norm() / ref.norm()).item()

        def half2_calls(copies=copies, x=x, cfg=half2_cfg, pairs=None) -> None:
            for c in copies:
                w4_half2_gemv(x, c, None, ws, cfg, pairs=pairs)

        for label, p, e in (
            ("x paired in registers", None, err),
            ("producer's pairs (decode)", pairs, err_pairs),
        ):
            t = graph_us(lambda p=p, calls=half2_calls: calls(pairs=p), len(copies))
            rows.append({"candidate": f"f16x2, {label}", "us": t, "tb_s": nbytes / t / 1e6, "err": e})
        t = graph_us(lambda x=x, bx=bx: b_operand(x, bx), 1)
        rows.append({"candidate": "B operand launch alone", "us": t, "tb_s": 0.0, "err": 0.0})
        for mt, warps, split, depth, chains in itertools.product(
            MTS, (4, 8), (1, 2, 4, 8, 16), DEPTHS, CHAINS
        ):
            tiles = -(-n // (16 * mt * warps))
            if split > 1 and tiles * split > 16 * ws.num_sms or k // 256 < split:  # a pair per split
                continue
            codes = f"{depth} in smem" if depth else "regs"
            label = f"mma {mt}x16 rows x {warps} warps, split {split}, {codes}, {chains} chains"
            launch = dict(mt=mt, warps=warps, split_k=split, depth=depth, chains=chains)
            try:
                out = mma_gemv(bx, qw, ws, **launch).double()
            except Exception as e:  # noqa: BLE001 - a launch shape that does not compile is reported, not fatal
                print(f"{name} {label}: {type(e).__name__}: {e}", flush=True)
                continue
            err = ((out - ref).norm() / ref.norm()).item()
            if not err < 4e-3:
                print(f"{name} {label}: relative error {err:.3g}, skipped", flush=True)
                rows.append({"candidate": label, "us": None, "tb_s": None, "err": err})
                continue

            def calls(copies=copies, bx=bx, launch=launch) -> None:
                for c in copies:
                    mma_gemv(bx, c, ws, **launch)

            t = graph_us(calls, len(copies))
            rows.append({"candidate": label, "us": t, "tb_s": nbytes / t / 1e6, "err": err})
        report[name] = rows
        timed = [r for r in rows if r["us"] is not None and r["candidate"].startswith("mma")]
        for r in rows[:3] + sorted(timed, key=lambda r: r["us"])[:4]:
            us, tb_s, err = r["us"], r["tb_s"], r["err"]
            print(f"{name:8s} {r['candidate']:36s} {us:7.2f} us {tb_s:5.2f} TB/s err {err:.2e}", flush=True)
    with open(sys.argv[1] if len(sys.argv) > 1 else "int4_mma_gemv.json", "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
