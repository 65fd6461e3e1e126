"""PyTorch reference attention over the paged KV cache. Runs on CPU and GPU; the oracle for kernels.

Decode rows (one query token) are batched into one masked SDPA call; rows with several query tokens
(prefill, chunked prefill, prefill after a prefix-cache hit) run one SDPA call each with an explicit causal
mask offset by the cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwick.layers.attention.backend import AttentionBackend, AttentionMetadata


def _context_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, seq_lens: torch.Tensor | int, sliding_window: int | None
) -> torch.Tensor:
    """True where a query at `q_pos` may attend a key at `k_pos` (causal, in range, inside the window)."""
    mask = (k_pos <= q_pos) & (k_pos < seq_lens)
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache = kv_cache[0]
        v_cache = kv_cache[1]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v.to(v_cache.dtype))

        out = torch.empty_like(q)
        query_lens = metadata.query_lens_cpu
        decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
        if decode_rows:
            self._decode(q, out, k_cache, v_cache, metadata, decode_rows, scale, sliding_window)
        start = 0
        for i, n in enumerate(query_lens):
            if n > 1:
                self._extend(q, out, k_cache, v_cache, metadata, i, start, scale, sliding_window)
            start += n
        return out

    def _gather(self, cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """[rows, blocks] block ids -> [rows, kv_heads, blocks * block_size, head_dim]."""
        rows, blocks = tables.shape
        x = cache[tables.long()]  # [rows, blocks, block_size, kv_heads, head_dim]
        return x.reshape(rows, blocks * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)

    def _decode(self, q, out, k_cache, v_cache, md: AttentionMetadata, rows, scale, sliding_window):
        bs = md.block_size
        max_len = max(md.seq_lens_cpu[i] for i in rows)
        idx = torch.tensor(rows, device=q.device)
        token_idx = md.query_start_loc[idx].long()
        tables = md.block_tables[idx, : (max_len + bs - 1) // bs]
        keys = self._gather(k_cache, tables)
        values = self._gather(v_cache, tables)
        seq_lens = md.seq_lens[idx].long().view(-1, 1, 1, 1)
        k_pos = torch.arange(keys.shape[2], device=q.device).view(1, 1, 1, -1)
        mask = _context_mask(seq_lens - 1, k_pos, seq_lens, sliding_window)
        query = q[token_idx].unsqueeze(2)  # [rows, heads, 1, head_dim]
        o = F.scaled_dot_product_attention(
            query, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[token_idx] = o.squeeze(2)

    def _extend(self, q, out, k_cache, v_cache, md: AttentionMetadata, row, start, scale, sliding_window):
        n = md.query_lens_cpu[row]
        seq_len = md.seq_lens_cpu[row]
        bs = md.block_size
        tables = md.block_tables[row : row + 1, : (seq_len + bs - 1) // bs]
        keys = self._gather(k_cache, tables)[:, :, :seq_len]
        values = self._gather(v_cache, tables)[:, :, :seq_len]
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device).view(-1, 1)
        k_pos = torch.arange(seq_len, device=q.device).view(1, -1)
        mask = _context_mask(q_pos, k_pos, seq_len, sliding_window)
        query = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        o = F.scaled_dot_product_attention(
            query, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[start : start + n] = o[0].transpose(0, 1)
