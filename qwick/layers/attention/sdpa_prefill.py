"""Whole prompts through `F.scaled_dot_product_attention`: the prefill fast path of the Triton backend.

A row whose queries are its whole sequence (a prompt, nothing cached before it) attends only to its own
keys and values, which the layer has in hand before they are written to the paged cache. torch's SDPA
(flash attention on GPUs) runs such rows faster than a paged kernel that reads them back from the cache.
Torch-only, so CPUs test it.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from qwick.layers.attention.backend import AttentionMetadata


def whole_prompt_rows(
    md: AttentionMetadata, extend_rows: Sequence[tuple[int, int]], min_tokens: int
) -> list[tuple[int, int]] | None:
    """(first token, length) of each of `extend_rows` ((row, query tokens) pairs), when every one is a whole
    sequence (no cached tokens before its queries) of at least `min_tokens`; otherwise None."""
    starts = []
    start = 0
    for n in md.query_lens_cpu:
        starts.append(start)
        start += n
    rows = []
    for i, n in extend_rows:
        if n < min_tokens or md.seq_lens_cpu[i] != n:
            return None
        rows.append((starts[i], n))
    return rows


def causal_prefill_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    rows: list[tuple[int, int]],
    scale: float,
) -> None:
    """out[s:s+n] = causal attention of each row's own queries, keys and values ([tokens, heads, dim]; a
    whole prompt, nothing cached), through `F.scaled_dot_product_attention`.

    Key/value heads stay grouped (`enable_gqa`), with no copies repeating them to the query heads. On CUDA
    only flash attention runs (math as a fallback for shapes it cannot take): torch would pick cuDNN on
    Hopper, which is faster per call (76 against ~140 us at 2048 tokens) but builds an execution plan for
    every new prompt length, 37-58 ms each on the H200 (`benchmarks/sdpa_new_lengths.py`), and nearly
    every prompt a server sees has a new length."""
    backends = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]) if q.is_cuda else nullcontext()
    with backends:
        for start, n in rows:
            o = F.scaled_dot_product_attention(
                q[start : start + n].transpose(0, 1).unsqueeze(0),  # [1, heads, n, dim]
                k[start : start + n].transpose(0, 1).unsqueeze(0),
                v[start : start + n].transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[start : start + n] = o.squeeze(0).transpose(0, 1)
