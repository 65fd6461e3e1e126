"""Triton attention over the paged KV cache: the GPU backend (TorchAttentionBackend is its oracle).

Three kernels per layer, all launched without a host sync (grid sizes come from the step's metadata,
which is built once on the host from the scheduler's lists and shared by every layer):

- `_kv_write_kernel`: one program per new token scatters its k/v (all kv heads) into the cache slot
  `slot_mapping[t]`; slots < 0 are skipped (padding rows of a CUDA-graph batch). Given the step's rotary
  tables (`rope`), `_rope_kv_write_kernel` does the same with the k heads rotated on the way, and rotates
  the q heads in place: one launch per layer fewer than RoPE and the write apart.
- decode (rows with one query token): flash-decoding. The grid is (row, kv head, split): each program
  loads the query vectors of the whole GQA group (`G_PAD` >= 16 rows, padded, so `tl.dot` runs on tensor
  cores) and reads each KV page of its context partition once for all of them, with an online softmax.
  With several splits, each writes its partial output and log-sum-exp, and `_decode_reduce_kernel`
  combines them. The grid depends only on (padded batch, kv heads, splits): static under CUDA graphs when
  the split count is fixed (`fixed_num_splits`).
- extend (rows with several query tokens: prefill, chunked prefill, prefill after a prefix hit): a
  flash-attention kernel over (query tile of BLOCK_M tokens, head): the causal mask is offset by the row's
  cached context, and a sliding window moves the first key tile forward. (torch's SDPA on whole prompts
  was tried on the H200: flash attention ran no faster than this kernel in a 2048-token TTFT, 47.1 against
  46.4 ms, and cuDNN, faster per call, plans every new prompt length for 37-58 ms:
  `benchmarks/sdpa_new_lengths.py`. Tried again with prompts padded to 256-token buckets and every bucket
  planned at startup (commit `b183115`): cuDNN's attention took 2.11 ms of a 2048-token prefill against
  this kernel's 3.52, but the TTFT was 47.44 against 46.35 ms, startup 19.0 against 11.2 s, and new
  lengths still ran slower.)

A mixed step runs both attention kernels over disjoint sets of rows, writing disjoint output tokens.
Softmax is computed in fp32 with exp2; P is cast to the KV dtype for the P@V product, as flash attention
does; fp32 inputs use IEEE (not TF32) dot products.

FP8 KV cache (`KV_FP8`, a float8_e4m3fn cache): the write kernel stores `clamp(x * (1 / scale), +-448)`
rounded to e4m3 (the reference's `quantize_kv`, byte for byte); the attention kernels load fp8 pages
(half the bytes), convert them exactly to the dot products' dtype, and apply the scales outside the dot
products: `k_scale` is folded into the softmax scale on the host and `v_scale` multiplies the output once.
With bf16/fp16 models the dot products run in fp16 (`F16_DOT`, queries scaled by 1/256): e4m3 converts to
fp16 in one instruction, to bf16 in three. On the H200 at 32k context that took batch-1 decode from 199.5
to 201.5 tok/s, still below a bf16 cache's 209.6: the conversion was not the main cost. fp32 models
convert to fp32.
Both scales are plain float arguments (never specialized); 16/32-bit caches compile exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from qwick.device_upload import to_device
from qwick.kernels.elementwise import rope_tables, rotate_halves, rotate_tile
from qwick.kernels.half2 import quarter_byte_f16
from qwick.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionRow,
    is_fp8_kv,
    kv_layout_of,
)

LOG2E = 1.4426950408889634
# Decode split-KV defaults: splits per row are chosen so that (rows x kv heads x splits) is about
# SPLIT_FILL x the number of SMs, each split reading at least MIN_TOKENS_PER_SPLIT keys.
SPLIT_FILL = 2
MIN_TOKENS_PER_SPLIT = 128
MAX_NUM_SPLITS = 64
# Decode rows launched longest context first, a row's kv heads side by side in the grid (`HEADS_FIRST`), so
# that in a batch of mixed lengths the long programs start in the first wave and the short ones fill the
# tail, and one wave's programs on an SM mix long and short. Measured on the H200 (eighth session of 12-01
# in BENCHMARKS.md): workload 3 bf16 13,623 out tok/s against 13,336 in the old order, fp8 16,845 against
# 15,927.
LONGEST_FIRST = True
# RoPE applied by the KV-write kernel (`_rope_kv_write_kernel`) when a step's rotary tables are on the
# device: one launch per layer fewer. Measured on the H200 (ninth session of 12-01 in BENCHMARKS.md):
# batch-1 decode bf16 235.2 against 233.4 tok/s, int4 410.9 against 405.9; a 2048-token TTFT unchanged.
FUSE_ROPE = True
# Prefill rows of at least this many queries (the chunks of a long prompt) take a third pipeline stage in
# the extend kernel (head_dim 128). Measured on the H200 (twelfth session of 12-01 in BENCHMARKS.md,
# benchmarks/extend_prefix_probe.py): 8,192 new tokens after 24,576 cached ones 8.95 against 9.86 ms per
# layer, without a prefix 1.30 against 1.37; at 2,048 queries the third stage lost (184 against 134 us).
# A 32k-token prompt's TTFT: 1,131.6 against 1,171.9 ms (benchmarks/long_prefill_ab.py).
LONG_PREFILL_QUERIES = 4096
# Pure decode steps rotate q and write the new key and value inside the decode kernel (`FUSED_WRITE`), not
# in `_rope_kv_write_kernel` before it: one launch per layer fewer again. H200, qwen2.5-7b shapes, batch-1
# decode with it / without (`gpu_session.sh decodewrite`): bf16 238.0 / 235.1, int4 470.5 / 459.5, fp8
# weights 360.4 / 354.6 tok/s (all with a bf16 cache).
FUSE_DECODE_WRITE = True
# The same into an fp8 cache. Off until the twentieth session: its cache codes had differed from the
# separate write's by an e4m3 step, because the two kernels contracted different rotary products into bf16
# FMAs; `round_to` now rounds them as PyTorch does, and the exactness tests and the fp8-cache graph test pass
# on the H200. Batch 1, fp8 weights and fp8 cache, with it / without: 358.5 / 354.3 tok/s in one machine's
# processes, 354.0 and 353.3 with it on another: no loss, a gain inside process-to-process noise.
FUSE_FP8_DECODE_WRITE = True
NO_WINDOW = 1 << 30  # "no sliding window": every key is inside it
# A finite "minus infinity" for running maxima and the decode kernel's (already scaled) masked scores: a
# fully masked tile then yields exp2(0) garbage that the next real maximum wipes out (alpha = 0), instead
# of NaN; every real query has at least one real key. The extend kernel masks with -inf instead, because
# it scales inside the exponent: the compiler fuses s * scale - max into one FMA, whose exact product of a
# finite -1e30 minus the rounded one is off by ~1e22, and exp2 of that is inf (NaN out, seen on the H200).
_NEG = tl.constexpr(-1.0e30)

if TYPE_CHECKING:
    from qwick.layers.rotary import RopeStep


# ---------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _tile_mask(row_ok, d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Mask of a [rows, D_PAD] tile. Without head-dim padding it is constant along d, which keeps the
    loads and stores 16-byte vectorized (a `d < HEAD_DIM` term would defeat Triton's analysis)."""
    if D_PAD == HEAD_DIM:
        return row_ok[:, None]
    else:
        return row_ok[:, None] & (d < HEAD_DIM)[None, :]


@triton.jit
def _to_cache(x, inv_scale, cache_ptr, KV_FP8: tl.constexpr):
    """Values as the cache stores them: into fp8 as x / scale in fp32, saturated to e4m3's largest finite
    value and rounded to nearest even; otherwise a plain cast."""
    if KV_FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -448.0), 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_inv_scale,
    v_inv_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    hv = tl.arange(0, H_PAD)
    h = hv[:, None]
    d = tl.arange(0, D_PAD)
    # `hv * 0 + slot`: a block, not a scalar, in the AND (the Triton interpreter rejects the mixed mask)
    mask = _tile_mask((hv < NUM_KV_HEADS) & (hv * 0 + slot >= 0), d, HEAD_DIM, D_PAD)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d[None, :], mask=mask)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d[None, :]
    tl.store(k_cache_ptr + dst, _to_cache(k, k_inv_scale, k_cache_ptr, KV_FP8), mask=mask)
    tl.store(v_cache_ptr + dst, _to_cache(v, v_inv_scale, v_cache_ptr, KV_FP8), mask=mask)


@triton.jit
def _rope_kv_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    pos_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    k_inv_scale,
    v_inv_scale,
    stride_qt,
    stride_kt,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QH_PAD: tl.constexpr,
    KVH_PAD: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One program per token: its q heads rotated in place, its k heads rotated into the cache slot and its
    v heads copied there (slot < 0: no write), the values `rotary_in_place` then `_kv_write_kernel` give.
    q and k heads are contiguous rows of HEAD_DIM (a power of two); the k input is left unrotated."""
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, half)
    dtype = q_ptr.dtype.element_ty
    c, s = rope_tables(cos_ptr, sin_ptr, pos, d, HEAD_DIM, dtype)

    hq = tl.arange(0, QH_PAD)[:, None]
    q_mask = hq < NUM_Q_HEADS
    q1 = q_ptr + t * stride_qt + hq * HEAD_DIM + d[None, :]
    o1, o2 = rotate_halves(q1, half, q_mask, c, s, dtype)
    tl.store(q1, o1, mask=q_mask)
    tl.store(q1 + half, o2, mask=q_mask)

    hv = tl.arange(0, KVH_PAD)
    h = hv[:, None]
    # `hv * 0 + slot`: a block, not a scalar, in the AND (the Triton interpreter rejects the mixed mask)
    kv_mask = ((hv < NUM_KV_HEADS) & (hv * 0 + slot >= 0))[:, None]
    k1, k2 = rotate_halves(k_ptr + t * stride_kt + h * HEAD_DIM + d[None, :], half, kv_mask, c, s, dtype)
    v1_ptr = v_ptr + t * stride_vt + h * stride_vh + d[None, :]
    v1 = tl.load(v1_ptr, mask=kv_mask)
    v2 = tl.load(v1_ptr + half, mask=kv_mask)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d[None, :]
    tl.store(k_cache_ptr + dst, _to_cache(k1, k_inv_scale, k_cache_ptr, KV_FP8), mask=kv_mask)
    tl.store(k_cache_ptr + dst + half, _to_cache(k2, k_inv_scale, k_cache_ptr, KV_FP8), mask=kv_mask)
    tl.store(v_cache_ptr + dst, _to_cache(v1, v_inv_scale, v_cache_ptr, KV_FP8), mask=kv_mask)
    tl.store(v_cache_ptr + dst + half, _to_cache(v2, v_inv_scale, v_cache_ptr, KV_FP8), mask=kv_mask)


# Values that change from step to step (the block-table width, split counts) are not specialized on: a new
# value would otherwise compile a new kernel variant in the middle of serving a request.
@triton.jit
def _fp16_queries(q, scale_log2):
    """Queries for fp16 dot products with fp8 keys and values (`F16_DOT`): e4m3 converts to fp16 in one
    instruction and to bf16 in three, which made an fp8 cache slower to read than a bf16 one. fp16 holds
    q / 256 for any bf16 q below 2^24 (q itself could pass fp16's 65504); the 256 returns in the softmax
    scale. Probabilities and fp8 values are exact or finer in fp16 than in bf16."""
    return quarter_byte_f16(q), scale_log2 * 256.0


# Integers that vary with the step (split counts, and the split scratch's strides, heads x splits and
# splits) are not specialized: Triton would compile a variant per divisibility class of each, and a
# prefill's last token (decode attention outside the graphs) would meet classes no warm-up ran.
@triton.jit(do_not_specialize=["num_splits", "window", "group", "stride_bt", "stride_ml_r", "stride_ml_h"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    rows_ptr,
    scale_log2,
    v_scale,
    num_splits,
    window,
    group,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_mo_r,
    stride_mo_h,
    stride_mo_s,
    stride_ml_r,
    stride_ml_h,
    k_ptr,
    v_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    k_inv_scale,
    v_inv_scale,
    stride_kt,
    stride_vt,
    stride_vh,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr,
    F16_DOT: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    FUSED_WRITE: tl.constexpr,
):
    """Flash-decoding over one split of a row's context for one kv head's query group. With FUSED_WRITE
    (q, k, v the step's unrotated projections; `write_kv_rope`'s work done here): the queries are rotated
    in registers, and the program whose split holds the row's last position rotates that token's key and
    writes it with its value into the cache slot (slot < 0: no write) before reading its keys."""
    if HEADS_FIRST:  # kv heads fastest in launch order: a row's heads start together
        kvh = tl.program_id(0)
        i = tl.program_id(1)
    else:
        i = tl.program_id(0)
        kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + i)
    seq_len = tl.load(seq_lens_ptr + row)
    tok = tl.load(query_start_ptr + row).to(tl.int64)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    head = kvh * group + g
    g_mask = g < group
    gd_mask = _tile_mask(g_mask, d, HEAD_DIM, D_PAD)
    q_row = q_ptr + tok * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_row + d[None, :], mask=gd_mask, other=0.0)
    if FUSED_WRITE:  # D_PAD == HEAD_DIM, a power of two: each column's partner is in the other half
        half: tl.constexpr = HEAD_DIM // 2
        dtype = q_ptr.dtype.element_ty
        c, s = rope_tables(cos_ptr, sin_ptr, (seq_len - 1).to(tl.int64), d % half, HEAD_DIM, dtype)
        partner = (d + half) % HEAD_DIM
        first_half = d < half
        q_partner = tl.load(q_row + partner[None, :], mask=gd_mask, other=0.0)
        q = rotate_tile(q, q_partner, first_half[None, :], c[None, :], s[None, :], dtype)
    if F16_DOT:
        q, scale_log2 = _fp16_queries(q, scale_log2)

    # This split's range of key tiles; the window (if any) moves the first key forward.
    start = tl.maximum(seq_len - window, 0)
    first = start // BLOCK_N
    last = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(last - first, num_splits)
    t0 = first + split * per_split
    t1 = tl.minimum(t0 + per_split, last)
    if FUSED_WRITE:
        if (t0 < t1) & (t1 == last):  # this split reads the row's last key: write it first
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            k_row = k_ptr + tok * stride_kt + kvh * HEAD_DIM
            k_new = rotate_tile(tl.load(k_row + d), tl.load(k_row + partner), first_half, c, s, dtype)
            v_new = tl.load(v_ptr + tok * stride_vt + kvh * stride_vh + d)
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kvh * stride_ch + d
            ok = d * 0 + slot >= 0  # a block, not a scalar (the interpreter rejects the mixed mask)
            tl.store(k_cache_ptr + dst, _to_cache(k_new, k_inv_scale, k_cache_ptr, KV_FP8), mask=ok)
            tl.store(v_cache_ptr + dst, _to_cache(v_new, v_inv_scale, v_cache_ptr, KV_FP8), mask=ok)
        tl.debug_barrier()  # the stores before any thread of the program reads the tile holding them

    m_i = tl.full([G_PAD], _NEG, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    bt_row = block_tables_ptr + row.to(tl.int64) * stride_bt
    kv_off = kvh * stride_ch + d[None, :]
    for t in range(t0, t1):
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        in_seq = n < seq_len
        valid = in_seq & (n >= start)
        page = tl.load(bt_row + n // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        at = page * stride_cb + (n % BLOCK_SIZE) * stride_cs  # the keys' slots (any `kv_layout`)
        kv_mask = _tile_mask(valid, d, HEAD_DIM, D_PAD)
        k = tl.load(k_cache_ptr + at[:, None] + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + at[:, None] + kv_off, mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * scale_log2
        qk = tl.where(valid[None, :], qk, _NEG)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * v_scale  # linear: the split partials combine the same with it applied
    if num_splits == 1:
        tl.store(
            out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=gd_mask,
        )
    else:
        mid = mid_o_ptr + i * stride_mo_r + head[:, None] * stride_mo_h + split * stride_mo_s + d[None, :]
        tl.store(mid, o, mask=gd_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(mid_lse_ptr + i * stride_ml_r + head * stride_ml_h + split, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_ml_r", "stride_ml_h"])
def _decode_reduce_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    query_start_ptr,
    rows_ptr,
    num_splits,
    stride_mo_r,
    stride_mo_h,
    stride_mo_s,
    stride_ml_r,
    stride_ml_h,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    S_CHUNK: tl.constexpr,
):
    """out = sum_s w_s * o_s / sum_s w_s with w_s = 2^(lse_s - max lse); empty splits have lse = -inf."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(rows_ptr + i)
    tok = tl.load(query_start_ptr + row).to(tl.int64)
    lse_row = mid_lse_ptr + i * stride_ml_r + h * stride_ml_h
    s = tl.arange(0, S_PAD)
    lse = tl.load(lse_row + s, mask=s < num_splits, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    denom = tl.sum(tl.exp2(lse - mx), 0)
    denom = tl.where(denom > 0, denom, 1.0)
    d = tl.arange(0, D_PAD)
    acc = tl.zeros([D_PAD], tl.float32)
    o_row = mid_o_ptr + i * stride_mo_r + h * stride_mo_h
    for s0 in range(0, num_splits, S_CHUNK):
        sc = s0 + tl.arange(0, S_CHUNK)
        sc_mask = sc < num_splits
        w = tl.exp2(tl.load(lse_row + sc, mask=sc_mask, other=float("-inf")) - mx)
        o = tl.load(
            o_row + sc[:, None] * stride_mo_s + d[None, :],
            mask=_tile_mask(sc_mask, d, HEAD_DIM, D_PAD),
            other=0.0,
        )
        acc += tl.sum(w[:, None] * o, 0)
    res = (acc / denom).to(out_ptr.dtype.element_ty)
    if D_PAD == HEAD_DIM:
        tl.store(out_ptr + tok * stride_ot + h * stride_oh + d, res)
    else:
        tl.store(out_ptr + tok * stride_ot + h * stride_oh + d, res, mask=d < HEAD_DIM)


@triton.jit
def _extend_tiles(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    kv_off,
    d,
    seq_len,
    scale_log2,
    window,
    n_start,
    n_end,
    stride_cb,
    stride_cs,
    MASKED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Online-softmax over key tiles [n_start, n_end); MASKED=False for tiles every query fully sees."""
    # Tiles start at multiples of BLOCK_N (the callers' bounds are), so with pages that divide a tile a
    # key's place inside its page is the same in every tile: its offset is computed once, out of the loop.
    if BLOCK_N % BLOCK_SIZE == 0:
        in_page = (tl.arange(0, BLOCK_N) % BLOCK_SIZE) * stride_cs
    for n0 in range(n_start, n_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        in_seq = n < seq_len
        page = tl.load(bt_row + n // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        if BLOCK_N % BLOCK_SIZE == 0:
            at = page * stride_cb + in_page  # the keys' slots (any `kv_layout`)
        else:
            at = page * stride_cb + (n % BLOCK_SIZE) * stride_cs
        kv_mask = _tile_mask(in_seq, d, HEAD_DIM, D_PAD)
        k = tl.load(k_cache_ptr + at[:, None] + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + at[:, None] + kv_off, mask=kv_mask, other=0.0)
        # The softmax runs on the CUDA cores between the two dots, so each op per score counts: the scale
        # goes into the exponent's FMA (max(s) * scale = max(s * scale) for scale > 0), and P @ V
        # accumulates into the rescaled acc inside the dot.
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)
        if MASKED:
            mask = (n[None, :] <= q_pos[:, None]) & in_seq[None, :]
            mask = mask & (n[None, :] > q_pos[:, None] - window)
            qk = tl.where(mask, qk, float("-inf"))  # exp2 -> 0; the running max stays finite (_NEG)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["window", "group", "stride_bt"])
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    tiles_ptr,
    scale_log2,
    v_scale,
    window,
    group,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr,
    F16_DOT: tl.constexpr,
    SPARE_TILES: tl.constexpr,
):
    h = tl.program_id(0)  # heads fastest: the launch order is the tile order (`_tiles`) for every head
    tile = tl.program_id(1)
    kvh = h // group
    row = tl.load(tiles_ptr + 2 * tile)
    m0 = tl.load(tiles_ptr + 2 * tile + 1)
    q_start = tl.load(query_start_ptr + row)
    q_len = tl.load(query_start_ptr + row + 1) - q_start
    if SPARE_TILES:  # noqa: SIM102 (a constexpr branch) a CUDA graph's tiles past the step's: no queries
        if m0 >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + row)
    ctx = seq_len - q_len  # tokens already in the cache before this step's queries

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    q_pos = ctx + offs_m
    tok = (q_start + offs_m).to(tl.int64)
    d = tl.arange(0, D_PAD)
    md_mask = _tile_mask(m_mask, d, HEAD_DIM, D_PAD)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :], mask=md_mask, other=0.0)
    if F16_DOT:
        q, scale_log2 = _fp16_queries(q, scale_log2)

    # Key tiles: [lo, hi) in all. Tiles in [full_lo, full_hi) lie before the tile's first query and
    # inside the window of its last one, so they need no mask; the rest (the diagonal, the window's
    # edge, the sequence end) are masked.
    first_q = ctx + m0
    last_q = tl.minimum(seq_len, first_q + BLOCK_M) - 1
    hi = last_q + 1  # causal: no key past the tile's last query
    lo = (tl.maximum(first_q - window + 1, 0) // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(last_q - window + 1, 0), BLOCK_N) * BLOCK_N, lo), hi)
    full_hi = tl.maximum(((first_q + 1) // BLOCK_N) * BLOCK_N, full_lo)

    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = block_tables_ptr + row.to(tl.int64) * stride_bt
    kv_off = kvh * stride_ch + d[None, :]
    acc, l_i, m_i = _extend_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_off, d, seq_len, scale_log2, window,
        lo, full_lo, stride_cb, stride_cs, True, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, DOT_PREC,
    )  # fmt: skip
    acc, l_i, m_i = _extend_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_off, d, seq_len, scale_log2, window,
        full_lo, full_hi, stride_cb, stride_cs, False, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, DOT_PREC,
    )  # fmt: skip
    acc, l_i, m_i = _extend_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_off, d, seq_len, scale_log2, window,
        full_hi, hi, stride_cb, stride_cs, True, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, DOT_PREC,
    )  # fmt: skip

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * v_scale
    tl.store(
        out_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=md_mask,
    )


# ---------------------------------------------------------------------------------------------------------
# backend
# ---------------------------------------------------------------------------------------------------------
@dataclass
class _TritonPlan:
    """Per-step values shared by all layers: which rows take which kernel, and scratch buffers."""

    num_decode: int
    decode_rows: torch.Tensor | None  # [num_decode] int32 row indices
    decode_max_seq_len: int
    extend_rows: list[tuple[int, int]]  # (row, query tokens) of rows with several queries
    tiles: dict = field(default_factory=dict)  # BLOCK_M -> [num_tiles, 2] int32: (row, first query)
    spare_tiles: bool = False  # tiles may start past their row's queries (a graph's fixed tile count)
    buffers: dict = field(default_factory=dict)  # (heads, head_dim, splits) -> (mid_o, mid_lse)


def _pow2(x: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(x))


def _slot_geometry(kv_cache: torch.Tensor) -> dict:
    """The KV-write kernels' view of a cache: where a slot's heads lie (page, slot-in-page and head strides,
    page size) and whether it stores fp8."""
    return dict(
        stride_cb=kv_cache.stride(1),
        stride_cs=kv_cache.stride(2),
        stride_ch=kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[2],
        KV_FP8=is_fp8_kv(kv_cache.dtype),
    )


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton; a drop-in for TorchAttentionBackend on CUDA devices.

    Tunables (instance attributes, so a benchmark can sweep them): `decode_config` / `extend_config`
    override the kernels' meta-parameters (None: the measured defaults in `_decode_cfg`/`_extend_cfg`);
    `split_fill`, `max_num_splits`, `min_tokens_per_split` shape the split-KV heuristic;
    `fixed_num_splits` pins the split count (a CUDA-graph runner sets it so the decode grid is the same
    on every replay); `longest_first` orders decode rows by context length, longest first (the graph
    runner orders its rows the same way when the backend asks for it); `fuse_rope` lets the KV write
    apply RoPE (`write_kv_rope`); prefills of `long_prefill_queries` queries or more pipeline deeper (the
    runner's warm-up compiles that variant too).

    The kernels address the cache through its strides (page, slot in page, head), so they read either
    `kv_layout`; HND gives a decode program one contiguous run of `block_size` keys per page instead of
    `block_size` runs of one key. NHD stays the default: on the H200 (seventh session of 12-01 in
    BENCHMARKS.md) decode attention ran at the same speed in both (256 rows at 8k context: 957 against 965
    us), and workload 3 gave 12,998 out tok/s with HND against 13,255 with NHD.
    """

    name = "triton"
    kv_layout = "NHD"

    def __init__(
        self, block_size: int, device: torch.device | str, fixed_num_splits: int | None = None
    ) -> None:
        super().__init__(block_size, torch.device(device))
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.num_sms = torch.cuda.get_device_properties(index).multi_processor_count
        else:  # the Triton interpreter (tests on CPU)
            self.num_sms = 132
        self.fixed_num_splits = fixed_num_splits
        self.min_tokens_per_split = MIN_TOKENS_PER_SPLIT
        self.split_fill = SPLIT_FILL
        self.max_num_splits = MAX_NUM_SPLITS
        self.decode_config: dict | None = None
        self.extend_config: dict | None = None
        self.longest_first = LONGEST_FIRST
        self.fuse_rope = FUSE_ROPE
        self.fuse_decode_write = FUSE_DECODE_WRITE
        self.fuse_fp8_decode_write = FUSE_FP8_DECODE_WRITE
        self.long_prefill_queries = LONG_PREFILL_QUERIES

    # ---- tuning --------------------------------------------------------------------------------------
    def _decode_cfg(self, head_dim: int, itemsize: int, kv_fp8: bool, num_rows: int) -> dict:
        if self.decode_config is not None:
            return self.decode_config
        if itemsize == 4:  # IEEE fp32 dots run on FMAs and need many registers: small tiles
            return {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
        # Measured on the H200 at qwen2.5-7b shapes (attention_bench --sweep [--kv-cache-dtype fp8]). fp8
        # pages: 4 warps read them 25-36% faster than 8 (batch 1 at 32k: 24.3 against 32.7 us per layer).
        # bf16 pages at 64 rows and more: 64-key tiles on 4 warps (batch 256 at a 640-token context: 87.1
        # against 95.4 us per layer); fewer rows keep 128-key tiles on 8 warps (batch 8 at 8k: 44.5 vs 47.8).
        if kv_fp8:
            return {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}
        if num_rows >= 64:
            return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
        return {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}

    def prefill_tile_rows(self, head_dim: int, itemsize: int, max_query_len: int) -> int:
        """The prefill kernel's query-tile height (BLOCK_M) for rows of up to `max_query_len` queries."""
        return self._extend_cfg(head_dim, itemsize, max_query_len)["BLOCK_M"]

    def _extend_cfg(self, head_dim: int, itemsize: int, max_query_len: int) -> dict:
        if self.extend_config is not None:
            return self.extend_config
        if itemsize == 4:
            return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
        # Measured on the H200 at qwen2.5-7b shapes (attention_bench --sweep): 128x128 tiles are fastest
        # for long prompts (358 TFLOP/s at 8k); 64x64 wastes less on short chunks.
        if 64 < head_dim <= 128 and max_query_len >= self.long_prefill_queries:
            return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
        if head_dim > 64 and max_query_len >= 128:
            return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}

    # ---- metadata ------------------------------------------------------------------------------------
    def build_metadata(self, rows: list[AttentionRow]) -> AttentionMetadata:
        md = super().build_metadata(rows)
        self._plan(md)
        return md

    def _plan(self, md: AttentionMetadata) -> _TritonPlan:
        """Split the rows between the kernels (host lists only: no device sync), once per step."""
        plan = md.plan.get("triton")
        if plan is not None:
            return plan
        decode = [i for i, n in enumerate(md.query_lens_cpu) if n == 1]
        if self.longest_first:
            decode.sort(key=lambda i: -md.seq_lens_cpu[i])
        plan = _TritonPlan(
            num_decode=len(decode),
            decode_rows=self._to_dev(decode, md) if decode else None,
            decode_max_seq_len=max((md.seq_lens_cpu[i] for i in decode), default=0),
            extend_rows=[(i, n) for i, n in enumerate(md.query_lens_cpu) if n > 1],
        )
        md.plan["triton"] = plan
        return plan

    @staticmethod
    def _to_dev(values: list[int], md: AttentionMetadata) -> torch.Tensor:
        return to_device(values, torch.int32, md.seq_lens.device)

    def _tiles(self, plan: _TritonPlan, md: AttentionMetadata, block_m: int) -> torch.Tensor:
        """(row, first query) of every query tile, the most keys first. A causal tile's work grows with
        the keys it reads (its row's cached context plus its own offset); launching the longest first, with
        the heads varying fastest in the grid, leaves the short ones for the last wave instead of the long
        ones of the last heads (longest-processing-time order)."""
        tiles = plan.tiles.get(block_m)
        if tiles is None:
            order = sorted(
                (
                    (md.seq_lens_cpu[i] - n + m0, i, m0)
                    for i, n in plan.extend_rows
                    for m0 in range(0, n, block_m)
                ),
                reverse=True,
            )
            tiles = plan.tiles[block_m] = self._to_dev([x for _, i, m0 in order for x in (i, m0)], md).view(
                -1, 2
            )
        return tiles

    def num_splits(self, num_rows: int, num_kv_heads: int, max_seq_len: int) -> int:
        """Splits per decode row: about `split_fill` programs per SM, each reading at least
        `min_tokens_per_split` keys.

        Known gap (H200, qwen2.5-7b shapes): the cdiv can overshoot one wave of resident programs
        (batch 8 at 32k: 9 splits = 288 programs for ~264 slots, 2.9 TB/s, while 17 splits gave 3.8);
        a wave-aware count (floor, or whole waves) is the next thing to measure."""
        if self.fixed_num_splits is not None:
            return self.fixed_num_splits
        want = triton.cdiv(self.split_fill * self.num_sms, max(1, num_rows * num_kv_heads))
        by_len = triton.cdiv(max(max_seq_len, 1), self.min_tokens_per_split)
        return max(1, min(want, by_len, self.max_num_splits))

    # ---- per layer -----------------------------------------------------------------------------------
    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Scatter k/v `[tokens, kv_heads, head_dim]` into the cache at `slot_mapping` (< 0: skipped);
        into an fp8 cache as `x / scale` (the scales are ignored otherwise)."""
        tokens, num_kv_heads, head_dim = k.shape
        if tokens == 0:
            return
        if k.stride(2) != 1:
            k = k.contiguous()
        if v.stride(2) != 1:
            v = v.contiguous()
        _kv_write_kernel[(tokens,)](
            k,
            v,
            kv_cache[0],
            kv_cache[1],
            slot_mapping,
            1.0 / float(k_scale),
            1.0 / float(v_scale),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            **_slot_geometry(kv_cache),
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            H_PAD=_pow2(num_kv_heads),
            D_PAD=_pow2(head_dim),
            num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
        )

    def write_kv_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        rope: RopeStep,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """`rope.apply(q, k)` then `write_kv(k, v, ...)` in one launch: q is rotated in place, k rotated
        into the cache (the k tensor itself is left as it was)."""
        tokens, num_heads, head_dim = q.shape
        if tokens == 0:
            return
        num_kv_heads = k.shape[1]
        _rope_kv_write_kernel[(tokens,)](
            q,
            k,
            v,
            kv_cache[0],
            kv_cache[1],
            rope.positions,
            slot_mapping,
            rope.cos_cache,
            rope.sin_cache,
            1.0 / float(k_scale),
            1.0 / float(v_scale),
            q.stride(0),
            k.stride(0),
            v.stride(0),
            v.stride(1),
            **_slot_geometry(kv_cache),
            NUM_Q_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            QH_PAD=_pow2(num_heads),
            KVH_PAD=_pow2(num_kv_heads),
            num_warps=4,
        )

    def fuses_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeStep) -> bool:
        """Whether `write_kv_rope` takes this step: `fuse_rope` on, rotary tables on the device (the CUDA
        path of `RopeStep`), q / k heads as contiguous rows of a power-of-two head_dim, v rows contiguous."""
        head_dim = q.shape[2]
        return (
            self.fuse_rope
            and rope.cos is None
            and head_dim >= 2
            and head_dim & (head_dim - 1) == 0
            and q.stride(2) == 1
            and k.stride(2) == 1
            and v.stride(2) == 1
            and q.stride(1) == head_dim
            and k.stride(1) == head_dim
        )

    def write(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        rope: RopeStep | None = None,
    ) -> torch.Tensor:
        self._check_cache(kv_cache, metadata)
        if not is_fp8_kv(kv_cache.dtype):
            k_scale = v_scale = 1.0  # scales belong to fp8 caches only
        if rope is not None and self.fuses_rope(q, k, v, rope):
            self.write_kv_rope(q, k, v, kv_cache, metadata.slot_mapping, rope, k_scale, v_scale)
        else:
            if rope is not None:
                q, k = rope.apply(q, k)
            self.write_kv(k, v, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        return q

    def forward(self, q, k, v, kv_cache, metadata, *, rope=None, output_rows=None, **scales) -> torch.Tensor:
        """The base class's (`scales`: its scale, sliding_window, k_scale, v_scale); a pure decode step with
        `fuse_decode_write` on writes its keys and values inside the decode kernel (`FUSED_WRITE`)
        instead of a launch of its own."""
        fuse = rope is not None and self.fuses_decode_write(q, k, v, rope, metadata, kv_cache.dtype)
        if output_rows is None and fuse:
            return self.attend(q, kv_cache, metadata, new_kv=(k, v, rope), **scales)
        return super().forward(q, k, v, kv_cache, metadata, rope=rope, output_rows=output_rows, **scales)

    def fuses_decode_write(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: RopeStep,
        md: AttentionMetadata,
        cache_dtype: torch.dtype,
    ) -> bool:
        """Whether the decode kernel writes this step's keys and values: `fuse_decode_write` on (and
        `fuse_fp8_decode_write` for an fp8 cache), every row one decode token, and what `write_kv_rope`
        would take (a head_dim of 16 or more, so that the kernel's padded head is the head)."""
        return (
            self.fuse_decode_write
            and (self.fuse_fp8_decode_write or not is_fp8_kv(cache_dtype))
            and md.num_tokens == md.num_rows
            and q.shape[2] >= 16
            and self.fuses_rope(q, k, v, rope)
        )

    @staticmethod
    def _check_cache(kv_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
        kv_layout_of(kv_cache)  # NHD or HND (ValueError otherwise): the kernels read the cache's strides
        if kv_cache.shape[2] != metadata.block_size:
            raise ValueError("KV cache block size does not match the metadata's")

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        new_kv: tuple[torch.Tensor, torch.Tensor, RopeStep] | None = None,
    ) -> torch.Tensor:
        """`new_kv` (k, v, rope; pure decode steps only): the step's keys and values, which the decode
        kernel rotates and writes itself, and q not yet rotated (`forward`)."""
        self._check_cache(kv_cache, metadata)
        fp8 = is_fp8_kv(kv_cache.dtype)
        if q.stride(2) != 1:
            q = q.contiguous()
        plan = self._plan(metadata)
        out = torch.empty_like(q)
        # k_scale folds into the softmax scale (q.(k_fp8 * s) = s * q.k_fp8); v_scale scales the output.
        qk_scale_log2 = float(scale) * LOG2E * (float(k_scale) if fp8 else 1.0)
        v_scale = float(v_scale) if fp8 else 1.0
        if plan.num_decode:
            write = None
            if new_kv is not None:  # the kernel quantizes into an fp8 cache as `write_kv` does
                inv = (1.0 / float(k_scale), 1.0 / v_scale) if fp8 else (1.0, 1.0)
                write = (*new_kv, *inv)
            self._decode(q, kv_cache, out, metadata, plan, qk_scale_log2, v_scale, sliding_window, write)
        if plan.extend_rows:
            self._extend(q, kv_cache, out, metadata, plan, qk_scale_log2, v_scale, sliding_window)
        return out

    def _decode(self, q, kv_cache, out, md, plan, scale_log2, v_scale, sliding_window, write=None) -> None:
        """`write` (k, v, rope, 1 / k_scale, 1 / v_scale): the kernel's FUSED_WRITE (see `attend`)."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = kv_cache.shape[3]
        splits = self.num_splits(plan.num_decode, num_kv_heads, plan.decode_max_seq_len)
        key = (num_heads, head_dim, splits)
        bufs = plan.buffers.get(key)
        if bufs is None:
            shape = (plan.num_decode, num_heads, splits)
            mid_o = torch.empty((*shape, head_dim), dtype=torch.float32, device=q.device)
            mid_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
            bufs = plan.buffers[key] = (mid_o, mid_lse)
        mid_o, mid_lse = bufs
        cfg = self._decode_cfg(head_dim, q.element_size(), is_fp8_kv(kv_cache.dtype), plan.num_decode)
        d_pad = _pow2(head_dim, 16)
        grid = (num_kv_heads, plan.num_decode) if self.longest_first else (plan.num_decode, num_kv_heads)
        _decode_kernel[(*grid, splits)](
            q,
            kv_cache[0],
            kv_cache[1],
            out,
            mid_o,
            mid_lse,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            plan.decode_rows,
            scale_log2,
            v_scale,
            splits,
            int(sliding_window) if sliding_window else NO_WINDOW,
            num_heads // num_kv_heads,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            md.block_tables.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            mid_o.stride(0),
            mid_o.stride(1),
            mid_o.stride(2),
            mid_lse.stride(0),
            mid_lse.stride(1),
            *self._write_args(q, md, write),
            G_PAD=_pow2(num_heads // num_kv_heads, 16),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            BLOCK_SIZE=md.block_size,
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
            KV_FP8=is_fp8_kv(kv_cache.dtype),
            F16_DOT=is_fp8_kv(kv_cache.dtype) and q.dtype != torch.float32,
            HEADS_FIRST=self.longest_first,
            FUSED_WRITE=write is not None,
            **cfg,
        )
        if splits > 1:
            s_pad = _pow2(max(splits, self.max_num_splits), 16)
            _decode_reduce_kernel[(plan.num_decode, num_heads)](
                mid_o,
                mid_lse,
                out,
                md.query_start_loc,
                plan.decode_rows,
                splits,
                mid_o.stride(0),
                mid_o.stride(1),
                mid_o.stride(2),
                mid_lse.stride(0),
                mid_lse.stride(1),
                out.stride(0),
                out.stride(1),
                HEAD_DIM=head_dim,
                D_PAD=d_pad,
                # One width for every split count up to the maximum: one variant to compile.
                S_PAD=s_pad,
                S_CHUNK=min(s_pad, 64),
                num_warps=4,
            )

    @staticmethod
    def _write_args(q: torch.Tensor, md: AttentionMetadata, write) -> tuple:
        """The decode kernel's FUSED_WRITE arguments (k, v, slots, cos / sin tables, inverse scales, k and v
        strides); without a write, placeholders it does not read."""
        if write is None:
            return (q, q, md.seq_lens, q, q, 1.0, 1.0, 0, 0, 0)
        k, v, rope, k_inv, v_inv = write
        return (
            k, v, md.slot_mapping, rope.cos_cache, rope.sin_cache, k_inv, v_inv,
            k.stride(0), v.stride(0), v.stride(1),
        )  # fmt: skip

    def _extend(self, q, kv_cache, out, md, plan, scale_log2, v_scale, sliding_window) -> None:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = kv_cache.shape[3]
        max_query_len = max(n for _, n in plan.extend_rows)
        cfg = dict(self._extend_cfg(head_dim, q.element_size(), max_query_len))
        tiles = self._tiles(plan, md, cfg["BLOCK_M"])
        if tiles.shape[0] > 65535:  # CUDA's grid limit along y; 65535 x BLOCK_M >= 2M query tokens
            raise ValueError(
                f"{tiles.shape[0]} prefill query tiles in one step; lower max_num_batched_tokens"
            )
        _extend_kernel[(num_heads, tiles.shape[0])](
            q,
            kv_cache[0],
            kv_cache[1],
            out,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            tiles,
            scale_log2,
            v_scale,
            int(sliding_window) if sliding_window else NO_WINDOW,
            num_heads // num_kv_heads,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            md.block_tables.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            HEAD_DIM=head_dim,
            D_PAD=_pow2(head_dim, 16),
            BLOCK_SIZE=md.block_size,
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
            KV_FP8=is_fp8_kv(kv_cache.dtype),
            F16_DOT=is_fp8_kv(kv_cache.dtype) and q.dtype != torch.float32,
            SPARE_TILES=plan.spare_tiles,
            **cfg,
        )
