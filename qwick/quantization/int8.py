"""INT8 W8A8: `quantization="int8"` quantizes an unquantized checkpoint while loading (per-output-channel
symmetric weight scales, dynamic per-token activation scales). INT8 checkpoints come as compressed-tensors
(qwick/quantization/compressed_tensors.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qwick.quantization.base import QuantizationConfig
from qwick.quantization.w8a8 import W8A8LinearMethod


class Int8Config(QuantizationConfig):
    name = "int8"
    can_quantize_lm_head = True
    default_lm_head = "int8"  # an 8-bit head: +0.1% perplexity (BENCHMARKS.md)

    @classmethod
    def for_unquantized_checkpoint(cls) -> Int8Config:
        return cls()

    def describe(self) -> str:
        return "int8 (quantized while loading, per-channel weight scales)"

    def linear_method(self, prefix: str, shard_names: Sequence[str]) -> W8A8LinearMethod | None:
        if prefix == "lm_head" and self.lm_head_format() is None:
            return None
        return W8A8LinearMethod(torch.int8, checkpoint=False)
