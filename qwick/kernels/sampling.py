"""Per-request seeded uniform noise for the sampler, on the GPU, in one launch for all seeded rows.

A seeded row must draw the same noise whatever else is in the batch. On the CPU the sampler reseeds one
torch.Generator per row (a launch or two per row); at 256 seeded rows on a GPU that is ~500 tiny launches a
step. Here each row's uniforms come from Philox (`tl.rand`) keyed by the row's 63-bit step seed and the
vocabulary index: a pure function of (seed, position, token), computed for every seeded row at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _seeded_uniform_kernel(out_ptr, rows_ptr, seeds_ptr, vocab, stride_row, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    seed = tl.load(seeds_ptr + i)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    u = tl.rand(seed, cols)
    tl.store(out_ptr + row * stride_row + cols, u, mask=mask)


def seeded_uniform_(out: torch.Tensor, rows: list[int], seeds: list[int]) -> None:
    """Fill `out[rows[i]]` ([B, V] fp32, CUDA) with U[0, 1) noise determined by `seeds[i]` alone."""
    if not rows:
        return
    vocab = out.shape[1]
    rows_t = torch.tensor(rows, dtype=torch.int32).to(out.device, non_blocking=True)
    seeds_t = torch.tensor(seeds, dtype=torch.int64).to(out.device, non_blocking=True)
    block = 4096
    _seeded_uniform_kernel[(len(rows), triton.cdiv(vocab, block))](
        out, rows_t, seeds_t, vocab, out.stride(0), BLOCK=block, num_warps=8
    )
