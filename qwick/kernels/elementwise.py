"""Fused elementwise kernels of the decoder layer (GPU): residual add + RMSNorm, RoPE in place, SiLU-and-mul.

Each replaces a chain of small PyTorch ops (6-10 launches and as many passes over the activations) with one
launch and one pass. At batch 1 a 7B step is ~4 ms of weight reads spread over ~200 kernels, so every launch
saved inside the CUDA graph is worth ~1-2 us.

The kernels write transformers' bf16/fp16 arithmetic step by step (statistics in fp32, the normalized value
rounded to the model dtype before the weight multiply; rotary products rounded before the sum; silu rounded
before the multiply). Triton's compiler may fold such a round trip away: it fused a rounded rotary product
into the sum after it (`fma.rn.bf16`, one rounding where PyTorch has two, and not the same product in every
kernel), so those products are rounded in PTX it cannot see through (`round_to`). Elsewhere the fused layers
agree with the PyTorch path to one rounding step of the output (tests/kernels).

RMSNorm and SiLU-and-mul can also quantize their output per token for a W8A8 projection that reads it
(`quant`, a `RowQuant`): the codes and scales are bit-identical to `qwick.kernels.w8a8.quantize_rows` on
the output, written in the same launch. For the batch-1 int4 GEMV in packed fp16 they write its operand
instead (`quant`, a `HalfPairs`): the output's fp16 pairs, as that GEMV would make them in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qwick.kernels.codes import code_buffers, codes_of
from qwick.kernels.half2 import _EMULATE
from qwick.kernels.pdl import pdl_supported, pdl_trigger, pdl_wait
from qwick.kernels.swiglu import silu_times
from qwick.layers.linear import HalfPairs, PairedRows, QuantizedRows, RowQuant

# RMSNorm reads its weight together with x and the residual, not after the row's sum of squares: sm_90 PTX
# (Triton 3.6, compiled offline) kept that load behind the reduction's barriers, one more dependent trip to
# memory in every norm (two a layer of a batch-1 decode step in the 8-bit modes; in int4 one, and the o
# GEMV's norm tail). Read first, its layout change through shared memory held x's loads back instead;
# read after x's and the residual's, all three are in flight at once. The same sums. Batch 1 on one H100
# (43rd session, BENCHMARKS.md): int4 486.4 / 485.9 / 485.9 decode tok/s against 483.5 / 483.4 / 484.3
# without (+0.5%), fp8 329.3 against 329.3 (with the 8-bit GEMVs' `SCALES_FIRST` on) and 329.8 / 329.3
# against 329.6 / 329.7 with both off (the same).
NORM_WEIGHT_WITH_X = True


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    q_ptr,
    s_ptr,
    p_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_q,
    stride_p,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    IS_INT: tl.constexpr,
    PAIRS: tl.constexpr,
    INV_DIV: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
    PDL_WAIT: tl.constexpr,
    W_WITH_X: tl.constexpr,
):
    if PDL_TRIGGER:  # the next kernel may launch now (qwick.kernels.pdl: the QKV GEMV's weights)
        pdl_trigger()
    if PDL_WAIT:  # launched early: nothing is read before the kernel before has ended
        pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    rms_norm_row(
        x_ptr + row * stride_x,
        res_ptr + row * stride_res,
        w_ptr,
        out_ptr + row * stride_out,
        q_ptr + row * stride_q,
        s_ptr + row,
        p_ptr + row * stride_p,
        N,
        eps,
        HAS_RESIDUAL,
        QUANT,
        QMAX,
        INV_QMAX,
        MIN_AMAX,
        IS_INT,
        PAIRS,
        INV_DIV,
        BLOCK,
        "",
        W_WITH_X,
    )


@triton.jit
def rms_norm_row(
    x_row,
    res_row,
    w_ptr,
    out_row,
    q_row,
    s_ptr,
    p_row,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    IS_INT: tl.constexpr,
    PAIRS: tl.constexpr,
    INV_DIV: tl.constexpr,
    BLOCK: tl.constexpr,
    X_CACHE: tl.constexpr,
    W_WITH_X: tl.constexpr = True,
):
    """One row of `rms_norm` (the whole row in one block): x (+ residual, written back), normalized,
    times the weight, with its codes or `HalfPairs` if asked. X_CACHE: x's load cache modifier (".cg"
    where other programs of the same launch wrote x: `qwick.kernels.row_gemv_half2`'s norm tail).
    W_WITH_X (`NORM_WEIGHT_WITH_X`): the weight is read with x and the residual, else after the row's sum
    (a load the compiler then keeps behind the reduction's barriers)."""
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_row + cols, mask=mask, other=0.0, cache_modifier=X_CACHE)
    if HAS_RESIDUAL:
        r = tl.load(res_row + cols, mask=mask, other=0.0)
    if W_WITH_X:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded, as `x + residual` is
        tl.store(res_row + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    if not W_WITH_X:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed).to(out_row.dtype.element_ty)
    tl.store(out_row + cols, y, mask=mask)
    if QUANT:  # the row's codes and scale, as `quantize_rows` would make them from `out`
        _store_codes(y, q_row + cols, s_ptr, mask, QMAX, INV_QMAX, MIN_AMAX, IS_INT)
    if PAIRS:
        store_half_pairs(y, p_row, 0, N // 8, INV_DIV, BLOCK)


@triton.jit
def rms_norm_tail(
    y_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    p_ptr,
    counter_ptr,
    N,
    eps,
    PAIRS: tl.constexpr,
    INV_DIV: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The end of a GEMV launch whose one-row output y [N] feeds a residual add + RMSNorm: every program
    arrives at `counter_ptr` once its share of y is stored, and the last to arrive runs `rms_norm_row` on
    the whole of y (which the others' releases made visible), then resets the counter. One launch fewer
    than the GEMV and `rms_norm` apart. The row is one block: the program needs the threads for it (at
    qwen2.5-7b's 4096, 2 warps hold 64 values a thread within the int4 down GEMV's registers)."""
    tl.debug_barrier()  # every thread's part of y is stored before the release below
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) * tl.num_programs(1) - 1:
        rms_norm_row(
            y_ptr, res_ptr, w_ptr, out_ptr, out_ptr, y_ptr, p_ptr, N, eps,
            True, False, 0.0, 0.0, 0.0, False, False, INV_DIV, BLOCK, ".cg",
        )  # fmt: skip
        if PAIRS:
            # From the stored row, not `store_half_pairs` on the registers: here (after the atomic and
            # the row's sum), that in-register reshape intermittently wrote a stale last word on an
            # H100 (Triton 3.6; N = 40, 4 and 8 warps; 35th session), where the stored row was right.
            tl.debug_barrier()  # the whole row is stored before any thread reads another's part
            half_pairs_of_row(out_ptr, p_ptr, N, INV_DIV, BLOCK)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def half_pairs_of_row(row_ptr, p_row, N, INV_DIV: tl.constexpr, BLOCK: tl.constexpr):
    """The `HalfPairs` of the stored row [N] (N a multiple of 8), as `store_half_pairs` writes them: pair
    slot 4 * word + p holds (x[8 word + p], x[8 word + p + 4]) * INV_DIV in fp16, x[8 word + p] low."""
    slot = tl.arange(0, BLOCK // 2)
    col = 8 * (slot // 4) + slot % 4
    ok = slot < N // 2
    lo = tl.load(row_ptr + col, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    hi = tl.load(row_ptr + col + 4, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    lo = (lo * INV_DIV).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi = (hi * INV_DIV).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    tl.store(p_row + slot, lo | (hi << 16), mask=ok)


@triton.jit
def store_half_pairs(y, p_row, first_word, num_words, INV_DIV: tl.constexpr, BLOCK: tl.constexpr):
    """The values y [BLOCK] (BLOCK / 8 words of eight columns from word `first_word`) as the `HalfPairs`
    operand: for each word, (x_p, x_{p+4}) * INV_DIV rounded to fp16, x_p in the low half, at int32
    `p_row + 4 * word + p`. The same values as the int4 f16x2 GEMV's in-register pairing."""
    h = (y.to(tl.float32) * INV_DIV).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    lo, hi = tl.split(tl.permute(tl.reshape(h, (BLOCK // 8, 2, 4)), (0, 2, 1)))  # [word, p] each
    words = first_word + tl.arange(0, BLOCK // 8)
    ptrs = p_row + 4 * words[:, None] + tl.arange(0, 4)[None, :]
    tl.store(ptrs, lo | (hi << 16), mask=(words < num_words)[:, None])


@triton.jit
def _store_codes(
    y,
    q_ptrs,
    s_ptr,
    mask,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    IS_INT: tl.constexpr,
):
    """The codes of the values `y` (all in registers; masked lanes 0) at one scale, their absmax over
    qmax, as `quantize_rows` makes them: the scale to `s_ptr`, the codes to `q_ptrs`."""
    yf = y.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(yf), axis=0), MIN_AMAX) * INV_QMAX
    tl.store(s_ptr, scale)
    tl.store(q_ptrs, codes_of(yf, scale, QMAX, IS_INT).to(q_ptrs.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quant: RowQuant | None = None,
    num_warps: int | None = None,
    early: bool = False,
) -> torch.Tensor | QuantizedRows:
    """`norm(x)`; with `residual`: `norm(x + residual)`, and `residual` is overwritten with `x + residual`.
    With `quant`, also the output's per-row codes and scales (`QuantizedRows`), in the same pass.
    `early`: launched by programmatic dependent launch where the device has it (`qwick.kernels.pdl`), so
    it may start while a kernel before that lets it in still runs; it waits for that kernel to end first.

    x: [rows, N] with unit stride along N (row stride free); residual: [rows, N], updated in place.
    `num_warps` overrides the launch's (`_norm_warps`): one program per row, `N / 256` warps up to 8;
    with `quant`, `N / 128` up to 32 for at most 256 rows, where the row's two reductions are latency (at
    one 3584-wide row on the H200 2.8-3.0 us with 32 warps against 4.4-4.7 with 8, plain 1.45 us;
    benchmarks/decode_quant_kernels.py, in a CUDA graph), and `N / 256` up to 16 beyond.
    """
    rows, n = x.shape
    half_pairs = quant if isinstance(quant, HalfPairs) else None
    quant = None if half_pairs is not None else quant
    if quant is not None and quant.group is not None:  # not written in this kernel: a launch of its own
        from qwick.kernels.w8a8 import quantize_rows

        out = rms_norm(x, weight, eps, residual, num_warps=num_warps, early=early)
        codes, scales = quantize_rows(out, quant.dtype, quant.qmax, quant.min_amax, quant.group)
        return QuantizedRows(out, codes, scales, quant.group)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    codes, scales, meta = code_buffers(out, quant)
    pairs, pair_meta = _pairs_buffer(out, half_pairs)
    if rows > 0:
        block = triton.next_power_of_2(n)
        res = residual if residual is not None else x
        pdl = pdl_supported(x.device)
        _rms_norm_kernel[(rows,)](
            x,
            res,
            weight,
            out,
            codes,
            scales,
            pairs,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            codes.stride(0),
            pairs.stride(0),
            n,
            eps,
            HAS_RESIDUAL=residual is not None,
            QUANT=quant is not None,
            BLOCK=block,
            PDL_TRIGGER=pdl,
            PDL_WAIT=early and pdl,
            W_WITH_X=NORM_WEIGHT_WITH_X,
            num_warps=num_warps or _norm_warps(block, rows, quant is not None),
            **meta,
            **pair_meta,
            **({"launch_pdl": True} if early and pdl else {}),
        )
    if half_pairs is not None:
        return PairedRows(out, pairs)
    return out if quant is None else QuantizedRows(out, codes, scales)


def _pairs_buffer(out: torch.Tensor, half_pairs: HalfPairs | None) -> tuple[torch.Tensor, dict]:
    """The int32 [rows, N / 2] buffer of `half_pairs` (a dummy without it) and its meta-parameters."""
    if half_pairs is None:
        return out, {"PAIRS": False, "INV_DIV": 1.0}
    rows, n = out.shape
    if n % 8:
        raise ValueError(f"fp16 pairs are made per word of eight values: {n} columns are not whole words")
    pairs = torch.empty((rows, n // 2), dtype=torch.int32, device=out.device)
    return pairs, {"PAIRS": True, "INV_DIV": 1.0 / half_pairs.x_div}


def _norm_warps(block: int, rows: int, codes: bool) -> int:
    """Warps per row of RMSNorm: `block / 256` up to 8; with codes, `block / 128` up to 32 for at most 256
    rows (the row's two reductions are latency there) and `block / 256` up to 16 beyond. With codes at
    3584 columns on the H200 (benchmarks/row_quant_launch.py, us in a CUDA graph): 2.9 / 4.1 us at 64 / 256
    rows on 32 warps against 4.6 / 5.3 on 8, 21.4 / 74.5 us at 2048 / 8192 rows on 16 against 24.4 / 80.2."""
    if codes:
        return max(min(block // 128, 32), 1) if rows <= 256 else max(min(block // 256, 16), 1)
    return max(min(block // 256, 8), 1)


@triton.jit
def rope_tables(cos_ptr, sin_ptr, pos, d, HEAD_DIM: tl.constexpr, dtype: tl.constexpr):
    """cos / sin of position `pos` at columns `d` of the fp32 tables [max_len, head_dim], rounded to the
    model dtype as PyTorch's path casts them before multiplying."""
    c = tl.load(cos_ptr + pos * HEAD_DIM + d).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * HEAD_DIM + d).to(dtype).to(tl.float32)
    return c, s


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to nearest in `dtype` (bf16 or fp16; fp32 unchanged), back in fp32. On the GPU through
    a PTX conversion the compiler cannot see through: written as `x.to(dtype)`, a rounded product feeding
    an add is contracted into a 16-bit FMA that skips the product's rounding (Triton 3.6, sm_90 PTX)."""
    if dtype == tl.float32:
        y = x
    elif _EMULATE:  # the interpreter runs no PTX (and contracts nothing)
        y = x.to(dtype).to(tl.float32)
    elif dtype == tl.bfloat16:
        y = tl.inline_asm_elementwise("cvt.rn.bf16.f32 $0, $1;", "=h,r", [x], tl.bfloat16, True, 1)
        y = y.to(tl.float32)
    else:
        y = tl.inline_asm_elementwise("cvt.rn.f16.f32 $0, $1;", "=h,r", [x], tl.float16, True, 1)
        y = y.to(tl.float32)
    return y


@triton.jit
def rotate_halves(p1, half, mask, c, s, dtype: tl.constexpr):
    """The NeoX rotation of the heads at `p1` (first halves; second halves at `p1 + half`), in `dtype`:
    out1 = x1*cos + (-x2)*sin, out2 = x2*cos + x1*sin, each product rounded as in PyTorch."""
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    a1 = round_to(x1 * c, dtype)
    b1 = round_to(-x2 * s, dtype)
    a2 = round_to(x2 * c, dtype)
    b2 = round_to(x1 * s, dtype)
    return (a1 + b1).to(dtype), (a2 + b2).to(dtype)


@triton.jit
def rotate_tile(x, partner, first_half, c, s, dtype: tl.constexpr):
    """`rotate_halves` on whole heads held in registers: each element x beside its partner in the other
    half (`first_half` where x is x1), and the cos / sin of its column: the same products, rounded alike."""
    x = x.to(tl.float32)
    partner = partner.to(tl.float32)
    a = round_to(x * c, dtype)
    b = round_to(tl.where(first_half, -partner, partner) * s, dtype)
    return (a + b).to(dtype)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_kt,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
):
    """One program per token: rotates all q heads and all k heads of that token in place (NeoX layout)."""
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, half)
    dtype = q_ptr.dtype.element_ty
    c, s = rope_tables(cos_ptr, sin_ptr, pos, d, HEAD_DIM, dtype)
    h = tl.arange(0, H_PAD)[:, None]
    for which in tl.static_range(2):
        if which == 0:
            base = q_ptr + t * stride_qt
            heads = NUM_Q_HEADS
        else:
            base = k_ptr + t * stride_kt
            heads = NUM_KV_HEADS
        mask = h < heads
        p1 = base + h * HEAD_DIM + d[None, :]
        o1, o2 = rotate_halves(p1, half, mask, c, s, dtype)
        tl.store(p1, o1, mask=mask)
        tl.store(p1 + half, o2, mask=mask)


def rotary_in_place(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """Rotate q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] in place.

    q and k may be strided views into the packed QKV output (heads contiguous within a token). The
    fp32 cos/sin tables [max_len, head_dim] are gathered by position inside the kernel.
    """
    tokens, num_heads, head_dim = q.shape
    if tokens == 0:
        return
    assert q.stride(2) == 1 and k.stride(2) == 1 and q.stride(1) == head_dim and k.stride(1) == head_dim
    _rope_kernel[(tokens,)](
        q,
        k,
        positions,
        cos_cache,
        sin_cache,
        q.stride(0),
        k.stride(0),
        NUM_Q_HEADS=num_heads,
        NUM_KV_HEADS=k.shape[1],
        HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(max(num_heads, k.shape[1])),
        num_warps=4,
    )


@triton.jit
def _silu_mul(x_row, cols, mask, N):
    """silu(gate) * up at `cols` of one row of [gate | up], in x's dtype."""
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + N + cols, mask=mask, other=0.0)
    return silu_times(gate, up)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    p_ptr,
    stride_x,
    stride_out,
    stride_p,
    N,
    PAIRS: tl.constexpr,
    INV_DIV: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    y = _silu_mul(x_ptr + row * stride_x, cols, mask, N)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)
    if PAIRS:
        store_half_pairs(y, p_ptr + row * stride_p, tl.program_id(1) * (BLOCK // 8), N // 8, INV_DIV, BLOCK)


@triton.jit
def _silu_tile(x_row, out_row, start, N, amax, BLOCK: tl.constexpr):
    """Step `start` of a row: silu(gate) * up stored and returned, and the running |max| folded in."""
    cols = start + tl.arange(0, BLOCK)
    mask = cols < N
    y = _silu_mul(x_row, cols, mask, N)
    tl.store(out_row + cols, y, mask=mask)
    return y, tl.maximum(amax, tl.abs(y.to(tl.float32)))


@triton.jit
def _tile_codes(y, q_row, start, N, scale, QMAX: tl.constexpr, IS_INT: tl.constexpr, BLOCK: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    codes = codes_of(y.to(tl.float32), scale, QMAX, IS_INT)
    tl.store(q_row + cols, codes.to(q_row.dtype.element_ty), mask=cols < N)


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr,
    out_ptr,
    q_ptr,
    s_ptr,
    stride_x,
    stride_out,
    stride_q,
    N,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    IS_INT: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
    """One program per row: silu(gate) * up as `_silu_and_mul_kernel` computes it, then the row's codes
    and scale from the rounded output.

    TILES > 0 (at most 8, the row's steps of BLOCK): each step's output stays in registers, written out one
    by one with no loop, so the compiler may issue every step's loads at once. TILES = 0, for longer rows:
    a loop over the steps, and a second one reading the row back from where the first wrote it, each step
    waiting on memory after the one before. (A whole row as one power-of-two block, 32768 for 18944
    columns, spilled.) The codes are the same either way, bit for bit."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    q_row = q_ptr + row * stride_q
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    if TILES == 0:
        for start in range(0, N, BLOCK):
            _, amax = _silu_tile(x_row, out_row, start, N, amax, BLOCK)
        scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) * INV_QMAX
        tl.store(s_ptr + row, scale)
        tl.debug_barrier()  # the row's outputs, written by all of this program's threads, are visible to all
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            y = tl.load(out_row + cols, mask=cols < N, other=0.0)
            _tile_codes(y, q_row, start, N, scale, QMAX, IS_INT, BLOCK)
    else:
        y0, amax = _silu_tile(x_row, out_row, 0, N, amax, BLOCK)
        if TILES > 1:
            y1, amax = _silu_tile(x_row, out_row, BLOCK, N, amax, BLOCK)
        if TILES > 2:
            y2, amax = _silu_tile(x_row, out_row, 2 * BLOCK, N, amax, BLOCK)
        if TILES > 3:
            y3, amax = _silu_tile(x_row, out_row, 3 * BLOCK, N, amax, BLOCK)
        if TILES > 4:
            y4, amax = _silu_tile(x_row, out_row, 4 * BLOCK, N, amax, BLOCK)
        if TILES > 5:
            y5, amax = _silu_tile(x_row, out_row, 5 * BLOCK, N, amax, BLOCK)
        if TILES > 6:
            y6, amax = _silu_tile(x_row, out_row, 6 * BLOCK, N, amax, BLOCK)
        if TILES > 7:
            y7, amax = _silu_tile(x_row, out_row, 7 * BLOCK, N, amax, BLOCK)
        scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) * INV_QMAX
        tl.store(s_ptr + row, scale)
        _tile_codes(y0, q_row, 0, N, scale, QMAX, IS_INT, BLOCK)
        if TILES > 1:
            _tile_codes(y1, q_row, BLOCK, N, scale, QMAX, IS_INT, BLOCK)
        if TILES > 2:
            _tile_codes(y2, q_row, 2 * BLOCK, N, scale, QMAX, IS_INT, BLOCK)
        if TILES > 3:
            _tile_codes(y3, q_row, 3 * BLOCK, N, scale, QMAX, IS_INT, BLOCK)
        if TILES > 4:
            _tile_codes(y4, q_row, 4 * BLOCK, N, scale, QMAX, IS_INT, BLOCK)
        if TILES > 5:
            _tile_codes(y5, q_row, 5 * BLOCK, N, scale, QMAX, IS_INT, BLOCK)
        if TILES > 6:
            _tile_codes(y6, q_row, 6 * BLOCK, N, scale, QMAX, IS_INT, BLOCK)
        if TILES > 7:
            _tile_codes(y7, q_row, 7 * BLOCK, N, scale, QMAX, IS_INT, BLOCK)


MAX_REGISTER_TILES = 8  # the steps `_silu_and_mul_quant_kernel` unrolls (its `TILES`)


def silu_codes_in_registers(n: int, rows: int, block: int = 4096) -> bool:
    """Whether SiLU-and-mul with per-row codes keeps each of `rows` rows of `n` outputs in registers: up to
    128 rows, where a row fits. On the H200 at 7b's 18944 columns (32 warps), 5.69 against 6.26 us at 64
    rows and 5.82 against 6.43 at 128; at 256 the two tie (11.26 against 10.38 on 32 warps, 10.22 against
    10.85 on 16), and at 2048 reading back wins (82.7 against 94.8 on 16 warps;
    `benchmarks/row_quant_launch.py`, twenty-third session)."""
    return rows <= 128 and triton.cdiv(n, block) <= MAX_REGISTER_TILES


@triton.jit
def _silu_and_mul_group_quant_kernel(
    x_ptr,
    out_ptr,
    q_ptr,
    s_ptr,
    stride_x,
    stride_out,
    stride_q,
    stride_s,
    N,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    IS_INT: tl.constexpr,
    GROUP: tl.constexpr,
):
    """One program per row and group of GROUP columns: silu(gate) * up, the group's scale from the rounded
    outputs and their codes, all from registers. No row-wide reduction, so a few rows spread over many
    programs (a decode step's one row over 37 at 7b's 18944 columns and groups of 512)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = cols < N
    y = _silu_mul(x_ptr + row * stride_x, cols, mask, N)  # 0 where masked: silu(0) * 0
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)
    q_ptrs = q_ptr + row * stride_q + cols
    _store_codes(y, q_ptrs, s_ptr + row * stride_s + g, mask, QMAX, INV_QMAX, MIN_AMAX, IS_INT)


def silu_quant_warps(rows: int) -> int:
    """Warps per row of SiLU-and-mul with per-row codes (4096-wide steps): 32 up to 256 rows, 16 beyond."""
    return 32 if rows <= 256 else 16


def silu_and_mul_quant(
    x: torch.Tensor,
    quant: RowQuant,
    block: int = 4096,
    num_warps: int | None = None,
    in_registers: bool | None = None,
) -> QuantizedRows:
    """`silu_and_mul` with the output's per-row codes and scales; `block` and `num_warps` are the launch
    shape: 4096-wide steps on 32 warps up to 256 rows, 16 beyond (at 7b's 18944 columns on the H200, 6.2 /
    10.4 us at 64 / 256 rows against 7.1 / 10.9 on 16 warps; 82.9 us at 2048 rows on 16 against 91.3;
    benchmarks/row_quant_launch.py, with the row read back). Rows of up to `MAX_REGISTER_TILES` steps
    may keep their outputs in registers for the codes (`in_registers`; None: `silu_codes_in_registers`,
    up to 128 rows); otherwise they are read back. With `quant.group`, per-group scales from a kernel with one
    program per row and group (the launch shape is the group)."""
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    codes, scales, meta = code_buffers(out, quant)
    if rows > 0 and quant.group is not None:
        group = quant.group
        if group & (group - 1):
            raise ValueError(f"SiLU-and-mul writes codes in groups of a power of two, not {group}")
        _silu_and_mul_group_quant_kernel[(rows, triton.cdiv(n, group))](
            x, out, codes, scales, x.stride(0), out.stride(0), codes.stride(0), scales.stride(0), n,
            GROUP=group, num_warps=max(min(group // 256, 8), 1), **meta,
        )  # fmt: skip
    elif rows > 0:
        tiles = triton.cdiv(n, block)
        if in_registers is None:
            in_registers = silu_codes_in_registers(n, rows, block)
        if in_registers and tiles > MAX_REGISTER_TILES:
            raise ValueError(f"{n} columns are {tiles} steps of {block}: more than {MAX_REGISTER_TILES}")
        _silu_and_mul_quant_kernel[(rows,)](
            x, out, codes, scales, x.stride(0), out.stride(0), codes.stride(0), n, BLOCK=block,
            TILES=tiles if in_registers else 0, num_warps=num_warps or silu_quant_warps(rows), **meta,
        )  # fmt: skip
    return QuantizedRows(out, codes, scales, quant.group)


def silu_and_mul(
    x: torch.Tensor, quant: RowQuant | HalfPairs | None = None
) -> torch.Tensor | QuantizedRows | PairedRows:
    """silu(x[:, :N]) * x[:, N:] for x [rows, 2N]. With `quant`, also the output's per-row codes and scales
    (`QuantizedRows`): one launch where a separate quantization would take another and a second read; or,
    with a `HalfPairs`, the output's fp16 pairs (`PairedRows`)."""
    rows, two_n = x.shape
    n = two_n // 2
    if isinstance(quant, RowQuant):
        return silu_and_mul_quant(x, quant)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    pairs, pair_meta = _pairs_buffer(out, quant)
    if rows > 0:
        block = min(triton.next_power_of_2(n), 2048)
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
            x, out, pairs, x.stride(0), out.stride(0), pairs.stride(0), n, BLOCK=block, num_warps=4,
            **pair_meta,
        )  # fmt: skip
    return out if quant is None else PairedRows(out, pairs)
