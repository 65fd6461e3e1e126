"""Rotary position embeddings (NeoX / rotate-half layout, as Qwen and Llama checkpoints use).

The inverse frequencies of every scaled variant (linear, dynamic NTK, YaRN, Llama 3, LongRoPE) come from
transformers' own `ROPE_INIT_FUNCTIONS`, so they agree with the reference by construction. cos/sin are
tabulated once for all positions up to the model's length and gathered by position each step.

Dynamic NTK: transformers rescales per call from the current sequence length; like vLLM we fix the scaling
once for `max_model_len` (none when it is within the original context), so cached keys stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def _inv_freq(config: PretrainedConfig, head_dim: int, max_len: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}"
        )
    if rope_type == "dynamic":
        original = params.get("original_max_position_embeddings") or config.max_position_embeddings
        return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=max_len if max_len > original else None)
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


class RotaryEmbedding(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, max_len: int) -> None:
        super().__init__()
        # Tabulated on the CPU whatever the target device, so every device gets bit-identical tables.
        inv_freq, scaling = _inv_freq(config, head_dim, max_len)
        inv_freq = inv_freq.to("cpu")
        positions = torch.arange(max_len, dtype=torch.float, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)
        self.max_len = max_len

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeStep:
        """What every layer of this step needs to rotate its q and k (built once per step).

        On CUDA the layers rotate in place with a kernel that gathers cos/sin by position itself; elsewhere
        cos/sin are gathered here once, shaped [tokens, 1, head_dim] to broadcast over heads.
        """
        if positions.is_cuda:
            return RopeStep(positions, self.cos_cache, self.sin_cache)
        cos = self.cos_cache[positions].to(dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(dtype).unsqueeze(1)
        return RopeStep(positions, self.cos_cache, self.sin_cache, cos, sin)


@dataclass
class RopeStep:
    positions: torch.Tensor
    cos_cache: torch.Tensor  # fp32 tables [max_len, head_dim]
    sin_cache: torch.Tensor
    cos: torch.Tensor | None = None  # gathered for the PyTorch path
    sin: torch.Tensor | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]; rotated (in place on CUDA)."""
        if self.cos is None:
            from qwick.kernels.elementwise import rotary_in_place

            rotary_in_place(q, k, self.positions, self.cos_cache, self.sin_cache)
            return q, k
        return apply_rotary(q, k, self.cos, self.sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]; NeoX (rotate-half) layout."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
