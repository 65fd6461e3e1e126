"""The attention layer a model holds: KV-cache binding and dispatch to the step's backend."""

from __future__ import annotations

import torch
from torch import nn

from qwick.forward_context import get_forward_context
from qwick.layers.attention.backend import AttentionBackend, OutputRows
from qwick.layers.rotary import RopeStep


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # Bound by the model runner once the KV pool exists.
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        # fp8 KV-cache scales (stored value = x / scale): 1.0 unless the checkpoint has k_scale / v_scale.
        # Plain floats, passed to the kernels as arguments (so CUDA graphs capture them as constants).
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: RopeStep | None = None,
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """q/k/v: [tokens, heads * head_dim] (k, v with kv heads) -> [tokens, heads * head_dim].

        `rope`: the step's rotary embedding, applied to q and k first (by the backend, which may fuse it
        with the KV write). `output_rows`: every token's keys and values are cached, but only these tokens'
        outputs are returned ([len(output_rows), heads * head_dim])."""
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError("attention layer has no KV cache bound; run the model through ModelRunner")
        tokens = q.shape[0]
        out = self.backend.forward(
            q.view(tokens, self.num_heads, self.head_dim),
            k.view(tokens, self.num_kv_heads, self.head_dim),
            v.view(tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            get_forward_context().attn_metadata,
            scale=self.scale,
            sliding_window=self.sliding_window,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            rope=rope,
            output_rows=output_rows,
        )
        return out.view(out.shape[0], self.num_heads * self.head_dim)
