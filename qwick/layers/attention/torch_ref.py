"""PyTorch reference attention over the paged KV cache. Runs on CPU and GPU; the oracle for kernels.

Decode rows (one query token) are batched into one masked SDPA call; rows with several query tokens
(prefill, chunked prefill, prefill after a prefix-cache hit) run one SDPA call each with an explicit causal
mask offset by the cached context. Which cache slots each row reads, and the masks, are worked out once
per step (`_plan`) and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from qwick.layers.attention.backend import (
    FP8_KV_DTYPE,
    AttentionBackend,
    AttentionMetadata,
    is_fp8_kv,
    kv_layout_of,
    quantize_kv,
)

if TYPE_CHECKING:
    from qwick.layers.rotary import RopeStep


def _context_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, seq_lens: torch.Tensor | int, sliding_window: int | None
) -> torch.Tensor:
    """True where a query at `q_pos` may attend a key at `k_pos` (causal, in range, inside the window)."""
    mask = (k_pos <= q_pos) & (k_pos < seq_lens)
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


@dataclass
class _Group:
    """Rows attended in one SDPA call: their query tokens, the cache slots they read, and the mask."""

    token_idx: torch.Tensor | slice  # query tokens in the flat batch
    slots: torch.Tensor  # [rows, context] flat cache slot of each key position
    q_pos: torch.Tensor  # [rows, 1, queries, 1] position of each query
    k_pos: torch.Tensor  # [1, 1, 1, context]
    seq_lens: torch.Tensor  # [rows, 1, 1, 1]
    is_decode: bool  # several rows of one query each, or one row of several queries
    masks: dict  # sliding_window -> mask, built on first use


def _slots(tables: torch.Tensor, block_size: int) -> torch.Tensor:
    offsets = torch.arange(block_size, device=tables.device, dtype=torch.int64)
    return (tables.long().unsqueeze(-1) * block_size + offsets).flatten(1)


def _dequantize(raw: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """fp8 cache bytes -> `dtype` values times the layer's scale (every e4m3 value is exact in fp16/bf16)."""
    x = raw.view(FP8_KV_DTYPE).to(dtype)
    return x * scale if scale != 1.0 else x


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def _plan(self, md: AttentionMetadata) -> list[_Group]:
        if "groups" in md.plan:
            return md.plan["groups"]
        device, bs = md.slot_mapping.device, md.block_size
        groups: list[_Group] = []
        decode_rows = [i for i, n in enumerate(md.query_lens_cpu) if n == 1]
        if decode_rows:
            max_len = max(md.seq_lens_cpu[i] for i in decode_rows)
            idx = torch.tensor(decode_rows, device=device)
            seq_lens = md.seq_lens[idx].long().view(-1, 1, 1, 1)
            tables = md.block_tables[idx, : (max_len + bs - 1) // bs]
            slots = _slots(tables, bs)
            k_pos = torch.arange(slots.shape[1], device=device).view(1, 1, 1, -1)
            groups.append(
                _Group(md.query_start_loc[idx].long(), slots, seq_lens - 1, k_pos, seq_lens, True, {})
            )
        start = 0
        for i, (n, seq_len) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
            if n > 1:
                tables = md.block_tables[i : i + 1, : (seq_len + bs - 1) // bs]
                slots = _slots(tables, bs)[:, :seq_len]
                q_pos = torch.arange(seq_len - n, seq_len, device=device).view(1, 1, -1, 1)
                k_pos = torch.arange(seq_len, device=device).view(1, 1, 1, -1)
                groups.append(
                    _Group(slice(start, start + n), slots, q_pos, k_pos, torch.tensor(seq_len), False, {})
                )
            start += n
        md.plan["groups"] = groups
        return groups

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
        if rope is not None:
            q, k = rope.apply(q, k)
        if (layout := kv_layout_of(kv_cache)) != self.kv_layout:
            raise ValueError(f"the torch backend reads an {self.kv_layout} KV cache, got {layout}")
        if is_fp8_kv(kv_cache.dtype):  # copies and gathers run on the bytes (uint8), which any device has
            k = quantize_kv(k, k_scale).view(torch.uint8)
            v = quantize_kv(v, v_scale).view(torch.uint8)
        k_flat, v_flat = self._flat_cache(kv_cache, k.shape[1], k.shape[2])
        k_flat.index_copy_(0, metadata.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, metadata.slot_mapping, v.to(v_flat.dtype))
        return q

    @staticmethod
    def _flat_cache(
        kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's keys and values as [slots, kv_heads, head_dim] (fp8 caches as their bytes)."""
        if is_fp8_kv(kv_cache.dtype):
            kv_cache = kv_cache.view(torch.uint8)
        return kv_cache[0].view(-1, num_kv_heads, head_dim), kv_cache[1].view(-1, num_kv_heads, head_dim)

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
    ) -> torch.Tensor:
        fp8 = is_fp8_kv(kv_cache.dtype)
        k_flat, v_flat = self._flat_cache(kv_cache, kv_cache.shape[3], kv_cache.shape[4])
        out = torch.empty_like(q)
        for group in self._plan(metadata):
            mask = group.masks.get(sliding_window)
            if mask is None:
                mask = _context_mask(group.q_pos, group.k_pos, group.seq_lens, sliding_window)
                group.masks[sliding_window] = mask
            keys = k_flat[group.slots].transpose(1, 2)  # [rows, kv_heads, context, head_dim]
            values = v_flat[group.slots].transpose(1, 2)
            if fp8:
                keys = _dequantize(keys, q.dtype, k_scale)
                values = _dequantize(values, q.dtype, v_scale)
            else:
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            query = q[group.token_idx]  # [rows, heads, head_dim]
            if group.is_decode:  # one query per row
                o = F.scaled_dot_product_attention(
                    query.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
                )
                out[group.token_idx] = o.squeeze(2)
            else:  # one row, many queries
                o = F.scaled_dot_product_attention(
                    query.transpose(0, 1)[None], keys, values, attn_mask=mask, scale=scale, enable_gqa=True
                )
                out[group.token_idx] = o[0].transpose(0, 1)
        return out
