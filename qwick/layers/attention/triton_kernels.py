"""The Triton kernels of the attention backend (`triton_backend` plans each step and launches them).


Three kernels per layer, all launched without a host sync (grid sizes come from the step's metadata,
which is built once on the host from the scheduler's lists and shared by every layer):

- `kv_write_kernel`: one program per new token scatters its k/v (all kv heads) into the cache slot
  `slot_mapping[t]`; slots < 0 are skipped (padding rows of a CUDA-graph batch). Given the step's rotary
  tables (`rope`), `rope_kv_write_kernel` does the same with the k heads rotated on the way, and rotates
  the q heads in place: one launch per layer fewer than RoPE and the write apart.
- decode (rows with one query token): flash-decoding. The grid is (row, kv head, split): each program
  loads the query vectors of the whole GQA group (`G_PAD` >= 16 rows, padded, so `tl.dot` runs on tensor
  cores) and reads each KV page of its context partition once for all of them, with an online softmax.
  With several splits, each writes its partial output and log-sum-exp, and `decode_reduce_kernel`
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

import triton
import triton.language as tl

from qwick.kernels.elementwise import rope_tables, rotate_halves, rotate_tile
from qwick.kernels.half2 import quarter_byte_f16
from qwick.kernels.pdl import pdl_trigger, pdl_wait

# A finite "minus infinity" for running maxima and the decode kernel's (already scaled) masked scores: a
# fully masked tile then yields exp2(0) garbage that the next real maximum wipes out (alpha = 0), instead
# of NaN; every real query has at least one real key. The extend kernel masks with -inf instead, because
# it scales inside the exponent: the compiler fuses s * scale - max into one FMA, whose exact product of a
# finite -1e30 minus the rounded one is off by ~1e22, and exp2 of that is inf (NaN out, seen on the H200).
_NEG = tl.constexpr(-1.0e30)


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
def kv_write_kernel(
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
def rope_kv_write_kernel(
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
    v heads copied there (slot < 0: no write), the values `rotary_in_place` then `kv_write_kernel` give.
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
def decode_kernel(
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
    PDL_TRIGGER: tl.constexpr,
    PDL_WAIT: tl.constexpr,
    PRELOAD: tl.constexpr,
    TRIGGER_LATE: tl.constexpr,
    NEW_KEY_APART: tl.constexpr = False,
):
    """Flash-decoding over one split of a row's context for one kv head's query group. With FUSED_WRITE
    (q, k, v the step's unrotated projections; `write_kv_rope`'s work done here): the queries are rotated
    in registers, and the program whose split holds the row's last position rotates that token's key and
    writes it with its value into the cache slot (slot < 0: no write) before reading its keys.

    PRELOAD (with FUSED_WRITE and one split): the row's metadata and its first key tile are read before
    the wait of an early launch (`qwick.kernels.pdl`). Only the step's q, k and v come from the kernel
    before; everything else was written by kernels that had ended before that one could let this one in.
    The tile's slot of the new key, read before this kernel writes it, takes the written value from
    registers: the same tile as the loop would read, so the same bits. TRIGGER_LATE: PDL_TRIGGER's
    trigger after the wait (and the preload), not at the start.

    NEW_KEY_APART (with PRELOAD): the rotary tables and the slot are read before the wait too, the new key
    and value right after it with q, and the preloaded tile is left as read: its slot of the new key is
    masked out and that key scored and weighted apart (`_decode_tile_new_apart`). Nothing the wait
    releases then flows into the tile, so the compiler stages it for the dot products (shared memory,
    `ldmatrix`) before the wait instead of after it. The same products, summed in another order."""
    if PDL_TRIGGER and not TRIGGER_LATE:  # the next kernel may launch now (the o projection's weights)
        pdl_trigger()
    if PDL_WAIT and not PRELOAD:  # launched early: nothing is read before the kernel before has ended
        pdl_wait()
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

    # This split's range of key tiles; the window (if any) moves the first key forward.
    start = tl.maximum(seq_len - window, 0)
    first = start // BLOCK_N
    last = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(last - first, num_splits)
    t0 = first + split * per_split
    t1 = tl.minimum(t0 + per_split, last)
    bt_row = block_tables_ptr + row.to(tl.int64) * stride_bt
    kv_off = kvh * stride_ch + d[None, :]
    half: tl.constexpr = HEAD_DIM // 2
    dtype = q_ptr.dtype.element_ty
    if PRELOAD:
        n_pre, valid_pre, k_pre, v_pre = _decode_kv_tile(
            t0, seq_len, start, bt_row, k_cache_ptr, v_cache_ptr, kv_off, d, stride_cb, stride_cs,
            HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N,
        )  # fmt: skip
        if NEW_KEY_APART:  # written before the step, not by the kernel before: read before the wait
            c, s = rope_tables(cos_ptr, sin_ptr, (seq_len - 1).to(tl.int64), d % half, HEAD_DIM, dtype)
            slot = tl.load(slot_ptr + tok).to(tl.int64)
        if PDL_WAIT:
            pdl_wait()
    if PDL_TRIGGER and TRIGGER_LATE:
        pdl_trigger()
    q_row = q_ptr + tok * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_row + d[None, :], mask=gd_mask, other=0.0)
    if FUSED_WRITE:  # D_PAD == HEAD_DIM, a power of two: each column's partner is in the other half
        partner = (d + half) % HEAD_DIM
        first_half = d < half
        q_partner = tl.load(q_row + partner[None, :], mask=gd_mask, other=0.0)
        k_row = k_ptr + tok * stride_kt + kvh * HEAD_DIM
        if NEW_KEY_APART:  # issued with q's loads, not behind q's rotation
            k_raw = tl.load(k_row + d)
            k_partner = tl.load(k_row + partner)
            v_raw = tl.load(v_ptr + tok * stride_vt + kvh * stride_vh + d)
        else:
            c, s = rope_tables(cos_ptr, sin_ptr, (seq_len - 1).to(tl.int64), d % half, HEAD_DIM, dtype)
        q = rotate_tile(q, q_partner, first_half[None, :], c[None, :], s[None, :], dtype)
    if F16_DOT:
        q, scale_log2 = _fp16_queries(q, scale_log2)

    if NEW_KEY_APART:  # one split: it holds the row's last key
        k_new = _to_cache(
            rotate_tile(k_raw, k_partner, first_half, c, s, dtype), k_inv_scale, k_cache_ptr, KV_FP8
        )
        v_new = _to_cache(v_raw, v_inv_scale, v_cache_ptr, KV_FP8)
        _store_new_kv(
            k_new, v_new, slot, k_cache_ptr, v_cache_ptr, kvh, d, stride_cb, stride_cs, stride_ch,
            BLOCK_SIZE,
        )  # fmt: skip
        # the preloaded tile's slot of the new key (when it holds it and the key was written) is stale
        new_in_tile = ((seq_len - 1) // BLOCK_N == t0) & (slot >= 0)
        tl.debug_barrier()  # the stores before any thread of the program reads the tile holding them
    elif FUSED_WRITE:
        if (t0 < t1) & (t1 == last):  # this split reads the row's last key: write it first
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            k_new = rotate_tile(tl.load(k_row + d), tl.load(k_row + partner), first_half, c, s, dtype)
            v_new = tl.load(v_ptr + tok * stride_vt + kvh * stride_vh + d)
            k_new = _to_cache(k_new, k_inv_scale, k_cache_ptr, KV_FP8)
            v_new = _to_cache(v_new, v_inv_scale, v_cache_ptr, KV_FP8)
            _store_new_kv(
                k_new, v_new, slot, k_cache_ptr, v_cache_ptr, kvh, d, stride_cb, stride_cs, stride_ch,
                BLOCK_SIZE,
            )  # fmt: skip
            if PRELOAD:  # the preloaded tile's slot of the new key, as the loop would read it back
                is_new = ((n_pre == seq_len - 1) & (slot >= 0))[:, None]
                k_pre = tl.where(is_new, k_new[None, :], k_pre)
                v_pre = tl.where(is_new, v_new[None, :], v_pre)
        tl.debug_barrier()  # the stores before any thread of the program reads the tile holding them

    m_i = tl.full([G_PAD], _NEG, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    t_loop = t0
    if NEW_KEY_APART:
        m_i, l_i, acc = _decode_tile_new_apart(
            q, k_pre, v_pre, valid_pre, n_pre == seq_len - 1, new_in_tile, k_new, v_new, scale_log2,
            DOT_PREC,
        )  # fmt: skip
        t_loop = t0 + 1
    elif PRELOAD:
        if t0 < t1:  # (a row's one split always has a tile)
            m_i, l_i, acc = _decode_tile(q, k_pre, v_pre, valid_pre, m_i, l_i, acc, scale_log2, DOT_PREC)
        t_loop = t0 + 1
    for t in range(t_loop, t1):
        _, valid, k, v = _decode_kv_tile(
            t, seq_len, start, bt_row, k_cache_ptr, v_cache_ptr, kv_off, d, stride_cb, stride_cs,
            HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N,
        )  # fmt: skip
        m_i, l_i, acc = _decode_tile(q, k, v, valid, m_i, l_i, acc, scale_log2, DOT_PREC)

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


@triton.jit
def _decode_kv_tile(
    t, seq_len, start, bt_row, k_cache_ptr, v_cache_ptr, kv_off, d, stride_cb, stride_cs,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key tile `t` of a decode row: its positions, which of them are keys to attend, its keys and values."""
    n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    in_seq = n < seq_len
    valid = in_seq & (n >= start)
    page = tl.load(bt_row + n // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
    at = page * stride_cb + (n % BLOCK_SIZE) * stride_cs  # the keys' slots (any `kv_layout`)
    kv_mask = _tile_mask(valid, d, HEAD_DIM, D_PAD)
    k = tl.load(k_cache_ptr + at[:, None] + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + at[:, None] + kv_off, mask=kv_mask, other=0.0)
    return n, valid, k, v


@triton.jit
def _store_new_kv(
    k_new, v_new, slot, k_cache_ptr, v_cache_ptr, kvh, d, stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """The step's key and value of kv head `kvh` (cache form) into cache slot `slot` (< 0: none)."""
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kvh * stride_ch + d
    ok = d * 0 + slot >= 0  # a block, not a scalar (the interpreter rejects the mixed mask)
    tl.store(k_cache_ptr + dst, k_new, mask=ok)
    tl.store(v_cache_ptr + dst, v_new, mask=ok)


@triton.jit
def _decode_tile_new_apart(
    q, k, v, valid, is_new, has_new, k_new, v_new, scale_log2, DOT_PREC: tl.constexpr
):  # fmt: skip
    """The first tile of a fresh online softmax (`_decode_tile` from m = -inf) read before the new key was
    written: where `has_new`, its slot `is_new` is stale, so it is masked out and the new key (k_new,
    v_new, the cache's values) scored and weighted apart, with the same products and roundings (p in
    q's dtype before its product with v)."""
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * scale_log2
    qk = tl.where(valid[None, :] & ~(is_new & has_new)[None, :], qk, _NEG)
    s_new = tl.sum(q.to(tl.float32) * k_new.to(q.dtype).to(tl.float32)[None, :], 1) * scale_log2
    s_new = tl.where(has_new, s_new, _NEG)
    m_new = tl.maximum(tl.max(qk, 1), s_new)
    p = tl.exp2(qk - m_new[:, None])
    p_new = tl.where(has_new, tl.exp2(s_new - m_new), 0.0)
    l_i = tl.sum(p, 1) + p_new
    p_new = p_new.to(q.dtype).to(tl.float32)
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
    acc += p_new[:, None] * v_new.to(q.dtype).to(tl.float32)[None, :]
    return m_new, l_i, acc


@triton.jit
def _decode_tile(q, k, v, valid, m_i, l_i, acc, scale_log2, DOT_PREC: tl.constexpr):
    """One key tile into the online softmax of a query group."""
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * scale_log2
    qk = tl.where(valid[None, :], qk, _NEG)
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_splits", "stride_ml_r", "stride_ml_h"])
def decode_reduce_kernel(
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
def extend_kernel(
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
