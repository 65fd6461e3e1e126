"""Whole prompts through `F.scaled_dot_product_attention`: the prefill fast path of the Triton backend.

A row whose queries are its whole sequence (a prompt, nothing cached before it) attends only to its own
keys and values, which the layer has in hand before they are written to the paged cache. On the H200
torch's SDPA picks cuDNN's attention for such rows, which ran a 2048-token qwen2.5-7b layer in 78.6 us
against 127 us for the paged extend kernel (BENCHMARKS.md, tenth session of 12-01).

cuDNN builds an execution plan for every new sequence length (37-58 ms each), and nearly every prompt a
server sees has a new length. So each prompt is padded up to a multiple of `bucket` tokens (zeros after
its end: under the causal mask no real query sees them, and the padded queries' outputs are dropped), and
`warm_up` plans every bucket once at startup. Torch-only, so CPUs test it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from qwick.layers.attention.backend import AttentionMetadata


def padded_length(num_tokens: int, bucket: int) -> int:
    return -(-num_tokens // bucket) * bucket


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
    bucket: int = 1,
) -> None:
    """out[s:s+n] = causal attention of each row's own queries, keys and values ([tokens, heads, dim]; a
    whole prompt, nothing cached, k already rotated), each row padded to a multiple of `bucket` tokens.
    Key/value heads stay grouped (`enable_gqa`): cuDNN takes them as they are (76 us against 112 us for
    repeating them to the query heads first, 2048 tokens on the H200)."""
    for start, n in rows:
        length = padded_length(n, bucket)
        # Contiguous copies, padded with zeros after the prompt's end: cuDNN's plans are keyed by strides
        # too, and q, k, v arrive as views of one QKV output (or not, after q/k norms).
        parts = [F.pad(t[start : start + n], (0, 0, 0, 0, 0, length - n)).contiguous() for t in (q, k, v)]
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in parts)  # [1, heads, length, dim]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        out[start : start + n] = o[0, :, :n].transpose(0, 1)


def warm_up(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    min_tokens: int,
    max_tokens: int,
    bucket: int,
) -> int:
    """Run `causal_prefill_sdpa` once at every padded length a prompt of `min_tokens`..`max_tokens` can
    take, so that cuDNN plans each now and not on a user's prompt. Returns the number of lengths."""
    lengths = range(padded_length(min_tokens, bucket), padded_length(max_tokens, bucket) + 1, bucket)
    for n in lengths:
        q = torch.zeros(n, num_heads, head_dim, dtype=dtype, device=device)
        k = torch.zeros(n, num_kv_heads, head_dim, dtype=dtype, device=device)
        causal_prefill_sdpa(q, k, k, torch.empty_like(q), [(0, n)], head_dim**-0.5, bucket)
    return len(lengths)
