"""Async scheduling's in-flight tokens: a step's input ids filled on the device from the previous step's
sampled ids, in one launch.

With async scheduling the host launches step n before step n-1's tokens reach it, so rows whose last input
is still in flight take it on the device (`ModelRunner._patch`). torch did that in three kernels (a gather,
a dtype cast, a scatter) after two index uploads, all on the stream between one step's sampler and the
next step's graph: at batch 1 about five small operations of a few us each on every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PATCH_BLOCK = 256


@triton.jit(do_not_specialize=["n"])
def _patch_kernel(ids_ptr, prev_ptr, index_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    dst = tl.load(index_ptr + i, mask=ok, other=0)
    src = tl.load(index_ptr + n + i, mask=ok, other=0)
    token = tl.load(prev_ptr + src, mask=ok, other=0)
    tl.store(ids_ptr + dst, token.to(ids_ptr.dtype.element_ty), mask=ok)


def patch_token_ids(ids: torch.Tensor, prev: torch.Tensor, index: torch.Tensor, n: int) -> None:
    """ids[index[i]] = prev[index[n + i]] for i < n: `index` holds the n destination slots of `ids` (int32 or
    int64), then the n rows of `prev` (the previous step's sampled ids) they take."""
    if not ids.is_cuda:
        ids.index_copy_(0, index[:n], prev.index_select(0, index[n:]).to(ids.dtype))
        return
    _patch_kernel[(triton.cdiv(n, PATCH_BLOCK),)](ids, prev, index, n, BLOCK=PATCH_BLOCK, num_warps=4)


def warm_up(device: torch.device) -> None:
    """Compile the kernel for both id types a step fills (graphs' int32, eager steps' int64)."""
    prev = torch.zeros(1, dtype=torch.long, device=device)
    index = torch.zeros(2, dtype=torch.long, device=device)
    for dtype in (torch.int32, torch.int64):
        patch_token_ids(torch.zeros(1, dtype=dtype, device=device), prev, index, 1)
