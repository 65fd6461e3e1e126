"""The sampler's GPU kernels: per-request seeded uniform noise in one launch for all seeded rows, the
exponential race that samples in one pass over the logits, and the greedy argmax.

A seeded row must draw the same noise whatever else is in the batch. On the CPU the sampler reseeds one
torch.Generator per row (a launch or two per row); at 256 seeded rows on a GPU that is ~500 tiny launches a
step. Here each row's uniforms come from Philox keyed by the row's 63-bit step seed and the vocabulary
index: a pure function of (seed, position, token), computed for every seeded row at once.

One Philox4x32-10 call gives four uniforms (`tl.rand4x`), and the hashing, not the memory, bounds these
kernels (a fused race over 256 rows of a 152k vocabulary took 0.20 ms with one call per column). So the
vocabulary is cut into blocks of `NOISE_BLOCK` columns, and the call at counter `block * Q + i` (Q =
NOISE_BLOCK / 4) gives columns `i`, `Q + i`, `2Q + i` and `3Q + i` of the block: four contiguous quarters,
so that every load stays coalesced.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from qwick.device_upload import to_device

NOISE_BLOCK = 1024


@functools.cache
def _num_sms(device: torch.device) -> int:
    """SMs of a CUDA device, asked once (the kernels size their grids by it every step); 4 elsewhere (the
    interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _vocab_chunks(
    b: int, vocab: int, block: int, programs_per_sm: int, device: torch.device
) -> tuple[int, int]:
    """(chunk, parts): each of b rows cut into `parts` chunks of `chunk` columns (whole `block`s), about
    `programs_per_sm` programs per SM over all rows, for a kernel that reduces each chunk, then its row."""
    blocks = triton.cdiv(vocab, block)
    parts = max(1, min(blocks, triton.cdiv(programs_per_sm * _num_sms(device), b)))
    chunk = triton.cdiv(blocks, parts) * block
    return chunk, triton.cdiv(vocab, chunk)


@triton.jit
def _noise_quarters(seed, block_start, Q: tl.constexpr):
    """The uniforms of the `4 * Q` columns from `block_start` (a multiple of 4 * Q): four quarters of Q."""
    counters = block_start // 4 + tl.arange(0, Q)
    return tl.rand4x(seed, counters)


@triton.jit
def _seeded_uniform_kernel(out_ptr, rows_ptr, seeds_ptr, vocab, stride_row, Q: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    seed = tl.load(seeds_ptr + i)
    start = tl.program_id(1) * 4 * Q
    u0, u1, u2, u3 = _noise_quarters(seed, start, Q)
    ptr = out_ptr + row * stride_row
    cols = start + tl.arange(0, Q)
    tl.store(ptr + cols, u0, mask=cols < vocab)
    tl.store(ptr + cols + Q, u1, mask=cols + Q < vocab)
    tl.store(ptr + cols + 2 * Q, u2, mask=cols + 2 * Q < vocab)
    tl.store(ptr + cols + 3 * Q, u3, mask=cols + 3 * Q < vocab)


def seeded_uniform_(out: torch.Tensor, rows: list[int], seeds: list[int]) -> None:
    """Fill `out[rows[i]]` ([B, V] fp32, CUDA) with U[0, 1) noise determined by `seeds[i]` alone."""
    if not rows:
        return
    vocab = out.shape[1]
    rows_t = torch.tensor(rows, dtype=torch.int32).to(out.device, non_blocking=True)
    seeds_t = torch.tensor(seeds, dtype=torch.int64).to(out.device, non_blocking=True)
    _seeded_uniform_kernel[(len(rows), triton.cdiv(vocab, NOISE_BLOCK))](
        out, rows_t, seeds_t, vocab, out.stride(0), Q=NOISE_BLOCK // 4, num_warps=4
    )


@triton.jit
def _race_quarter(ptr, t, cols, end, u, best, where, HAS_TEMP: tl.constexpr):
    """Fold columns `cols` (noise `u`) into the running best of logit / t - log(-log u) and its column."""
    ok = cols < end
    x = tl.load(ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
    # q = -log u ~ Exp(1), floored like the torch path; u = 0 gives q = inf, which never wins.
    q = tl.maximum(-tl.log(u), 1e-30)
    if HAS_TEMP:
        x = tl.math.div_rn(x, t)  # IEEE, as torch's `logits / temperature`
    score = x - tl.log(q)
    better = ok & (score > best)  # strict: the earliest column wins a tie, as torch.argmax does
    return tl.where(better, score, best), tl.where(better, cols, where)


@triton.jit(do_not_specialize=["base_seed"])
def _race_argmax_kernel(
    logits_ptr,
    temp_ptr,
    seeds_ptr,
    best_val_ptr,
    best_idx_ptr,
    vocab,
    stride_row,
    chunk,
    base_seed,
    HAS_TEMP: tl.constexpr,
    HAS_SEEDS: tl.constexpr,
    Q: tl.constexpr,
):
    """One (row, vocabulary chunk of whole noise blocks): the best of logit / t - log(-log u) over the
    chunk, and where it is. Each quarter of a noise block keeps its own running best; ties between them
    go to the lowest column below."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    if HAS_SEEDS:
        seed = tl.load(seeds_ptr + row)
    else:
        seed = base_seed + row
    start = part * chunk
    end = tl.minimum(start + chunk, vocab)
    if HAS_TEMP:
        t = tl.load(temp_ptr + row)
    else:
        t = 1.0
    b0 = tl.full((Q,), float("-inf"), tl.float32)
    b1, b2, b3 = b0, b0, b0
    w0 = tl.zeros((Q,), tl.int32) + start
    w1, w2, w3 = w0, w0, w0
    ptr = logits_ptr + row.to(tl.int64) * stride_row
    for off in range(start, end, 4 * Q):
        u0, u1, u2, u3 = _noise_quarters(seed, off, Q)
        cols = off + tl.arange(0, Q)
        b0, w0 = _race_quarter(ptr, t, cols, end, u0, b0, w0, HAS_TEMP)
        b1, w1 = _race_quarter(ptr, t, cols + Q, end, u1, b1, w1, HAS_TEMP)
        b2, w2 = _race_quarter(ptr, t, cols + 2 * Q, end, u2, b2, w2, HAS_TEMP)
        b3, w3 = _race_quarter(ptr, t, cols + 3 * Q, end, u3, b3, w3, HAS_TEMP)
    top = tl.maximum(
        tl.maximum(tl.max(b0, axis=0), tl.max(b1, axis=0)), tl.maximum(tl.max(b2, axis=0), tl.max(b3, axis=0))
    )
    idx = tl.minimum(
        tl.minimum(
            tl.min(tl.where(b0 == top, w0, vocab), axis=0), tl.min(tl.where(b1 == top, w1, vocab), axis=0)
        ),
        tl.minimum(
            tl.min(tl.where(b2 == top, w2, vocab), axis=0), tl.min(tl.where(b3 == top, w3, vocab), axis=0)
        ),
    )
    tl.store(best_val_ptr + row * tl.num_programs(1) + part, top)
    tl.store(best_idx_ptr + row * tl.num_programs(1) + part, tl.minimum(idx, vocab - 1))


def race_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    base_seed: int,
    row_seeds: list[int] | None = None,
    programs_per_sm: int = 8,
) -> torch.Tensor:
    """Sample one token per row of `logits` [B, V] from softmax(logits / temperature) in one pass.

    The exponential race argmax(p / q), q ~ Exp(1), taken in log space: argmax(logit / t - log q) is the
    same token (log is monotonic, and the softmax's normalizer is the same for every column), so neither
    the softmax nor the noise tensor is materialized. Row i's noise is Philox keyed by `row_seeds[i]`, or
    by `base_seed + i` without them, at the vocabulary index: the same uniforms `seeded_uniform_` draws
    for that key. Keep `base_seed` in [2^32, 2^62) so that the kernel's argument is always int64 (one
    compiled variant). `temperature` [B] fp32 (None: 1). Rows are split over several programs, about
    `programs_per_sm` per SM in all: the race is bound by Philox's chain of dependent multiplies and the
    logarithms, whose latency only other resident warps hide (with one program per row, 256 rows gave each
    SM 8 warps). The chunks' winners are reduced here. Returns int64 [B].
    """
    b, vocab = logits.shape
    assert logits.stride(1) == 1
    if b == 0:
        return torch.empty((0,), dtype=torch.long, device=logits.device)
    block = NOISE_BLOCK
    chunk, parts = _vocab_chunks(b, vocab, block, programs_per_sm, logits.device)
    best_val = torch.empty((b, parts), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((b, parts), dtype=torch.int32, device=logits.device)
    seeds = None if row_seeds is None else to_device(row_seeds, torch.int64, logits.device)
    _race_argmax_kernel[(b, parts)](
        logits,
        temperature,
        seeds,
        best_val,
        best_idx,
        vocab,
        logits.stride(0),
        chunk,
        base_seed,
        HAS_TEMP=temperature is not None,
        HAS_SEEDS=seeds is not None,
        Q=block // 4,
        num_warps=4,
    )
    if parts == 1:
        return best_idx[:, 0].long()
    return best_idx.gather(1, best_val.argmax(dim=1, keepdim=True)).squeeze(1).long()


@triton.jit(do_not_specialize=["vocab", "stride_row", "chunk"])
def _argmax_chunk_kernel(
    logits_ptr, best_val_ptr, best_idx_ptr, vocab, stride_row, chunk, BLOCK: tl.constexpr
):
    """One (row, vocabulary chunk): the chunk's largest logit and its first column; NaN (at its first
    column) where the chunk holds one, since torch.argmax takes NaN for the largest value."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    start = part * chunk
    end = tl.minimum(start + chunk, vocab)
    ptr = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    where = tl.zeros((BLOCK,), tl.int32) + start
    first_nan = tl.zeros((BLOCK,), tl.int32) + vocab
    for off in range(start, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        ok = cols < end
        x = tl.load(ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
        first_nan = tl.minimum(first_nan, tl.where(ok & (x != x), cols, vocab))
        better = ok & (x > best)  # strict: the earliest column wins a tie
        best = tl.where(better, x, best)
        where = tl.where(better, cols, where)
    top = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == top, where, vocab), axis=0)
    nan_at = tl.min(first_nan, axis=0)
    out = row * tl.num_programs(1) + part
    tl.store(best_val_ptr + out, tl.where(nan_at < vocab, float("nan"), top))
    tl.store(best_idx_ptr + out, tl.where(nan_at < vocab, nan_at, idx))


@triton.jit(do_not_specialize=["parts", "vocab"])
def _argmax_parts_kernel(best_val_ptr, best_idx_ptr, out_ptr, parts, vocab, BLOCK: tl.constexpr):
    """One row: the winner of its chunks' bests (the first NaN, else the largest, the first column on a
    tie; chunks are in column order)."""
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    ok = i < parts
    vals = tl.load(best_val_ptr + row * parts + i, mask=ok, other=float("-inf"))
    idxs = tl.load(best_idx_ptr + row * parts + i, mask=ok, other=vocab)
    is_nan = vals != vals
    nan_at = tl.min(tl.where(is_nan, idxs, vocab), axis=0)
    vals = tl.where(is_nan, float("-inf"), vals)
    top = tl.max(vals, axis=0)
    idx = tl.min(tl.where(ok & (vals == top), idxs, vocab), axis=0)
    tl.store(out_ptr + row, tl.where(nan_at < vocab, nan_at, idx).to(tl.int64))


ARGMAX_BLOCK = 1024


def greedy_argmax(logits: torch.Tensor, programs_per_sm: int = 2) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for logits [B, V] on a GPU in two small launches, the same token (the first
    column of the largest value; the first NaN if any): each row cut into chunks of whole
    `ARGMAX_BLOCK`-column blocks over about `programs_per_sm` programs per SM in all, then one program per
    row over its chunks' winners. torch's reduction took 9.3 us for one 152k-column bf16 row on an H100
    (53rd session), a step's longest kernel outside the layers and the LM head. Returns int64 [B]."""
    b, vocab = logits.shape
    assert logits.stride(1) == 1
    if b == 0:
        return torch.empty((0,), dtype=torch.long, device=logits.device)
    chunk, parts = _vocab_chunks(b, vocab, ARGMAX_BLOCK, programs_per_sm, logits.device)
    best_val = torch.empty((b, parts), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((b, parts), dtype=torch.int32, device=logits.device)
    out = torch.empty((b,), dtype=torch.long, device=logits.device)
    _argmax_chunk_kernel[(b, parts)](
        logits, best_val, best_idx, vocab, logits.stride(0), chunk, BLOCK=ARGMAX_BLOCK, num_warps=4
    )
    # sized by the most chunks a row can have (one block each): one variant per vocabulary, not per batch
    # size (whose part counts differ), so nothing compiles while serving
    most = triton.cdiv(vocab, ARGMAX_BLOCK)
    _argmax_parts_kernel[(b,)](
        best_val, best_idx, out, parts, vocab, BLOCK=max(16, triton.next_power_of_2(most)), num_warps=4
    )
    return out
