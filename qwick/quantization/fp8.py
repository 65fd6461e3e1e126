"""FP8 W8A8: `quantization="fp8"` on an unquantized checkpoint, and checkpoints with `quant_method: "fp8"`.

Checkpoints: Qwen/Qwen3-*-FP8 and DeepSeek-style block-wise ones (`weight_block_size: [128, 128]`, e4m3
weights with `weight_scale_inv` per block), and the older per-tensor layout (`weight_scale` per tensor,
kept per output channel here so packed q/k/v keep their own scales). On-the-fly: per-output-channel scales.
Activations: dynamic, per token (and per 128-column group with block weights). See qwick/quantization/w8a8.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from qwick.quantization.base import QuantizationConfig, module_matches
from qwick.quantization.w8a8 import FP8_DTYPE, W8A8LinearMethod

logger = logging.getLogger(__name__)


class Fp8Config(QuantizationConfig):
    name = "fp8"
    can_quantize_lm_head = True  # on the fly; a checkpoint's config turns it off (`__init__`)
    default_lm_head = "fp8"  # an 8-bit head: +0.1% perplexity (BENCHMARKS.md)

    def __init__(
        self, *, checkpoint: bool, block: tuple[int, int] | None = None, ignored: Sequence[str] = ()
    ) -> None:
        self.checkpoint = checkpoint
        self.can_quantize_lm_head = not checkpoint  # a checkpoint's head stays as it ships
        self.block = block
        self.ignored = list(ignored)

    @classmethod
    def from_config(cls, hf_quant_config: dict) -> Fp8Config:
        fmt = hf_quant_config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoint with fmt={fmt!r}: qwick loads e4m3 fp8 weights only")
        block = hf_quant_config.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or any(int(b) <= 0 for b in block):
                raise ValueError(f"fp8 checkpoint with weight_block_size={block!r}: expected [rows, columns]")
            bk = int(block[1])
            if bk & (bk - 1) or bk < 16:
                raise ValueError(f"fp8 block width {bk} is not a power of two of at least 16")
            block = (int(block[0]), bk)
        if hf_quant_config.get("activation_scheme") == "static":
            logger.warning(
                "fp8 checkpoint with static activation scales: qwick quantizes activations per token "
                "instead (input_scale is not used)"
            )
        ignored = [*(hf_quant_config.get("modules_to_not_convert") or [])]
        ignored += hf_quant_config.get("ignored_layers") or []
        return cls(checkpoint=True, block=block, ignored=ignored)

    @classmethod
    def for_unquantized_checkpoint(cls) -> Fp8Config:
        return cls(checkpoint=False)

    def describe(self) -> str:
        if not self.checkpoint:
            return "fp8 (quantized while loading, per-channel weight scales)"
        if self.block:
            return f"fp8 checkpoint ({self.block[0]}x{self.block[1]} block scales)"
        return "fp8 checkpoint (per-tensor/per-channel weight scales)"

    def linear_method(self, prefix: str, shard_names: Sequence[str]) -> W8A8LinearMethod | None:
        if prefix == "lm_head" and self.lm_head_format() is None:  # stays in the model dtype, as in vLLM
            return None
        skipped = [_ignored(name, self.ignored) for name in shard_names]
        if all(skipped):
            return None
        if any(skipped):
            raise ValueError(f"{prefix}: the checkpoint quantizes only some of {list(shard_names)}")
        return W8A8LinearMethod(
            FP8_DTYPE,
            checkpoint=self.checkpoint,
            block=self.block,
            scale_name="weight_scale_inv" if self.block else "weight_scale",
        )


def _ignored(name: str, patterns: Sequence[str]) -> bool:
    """`modules_to_not_convert` holds module names or their parents (e.g. "model.embed_tokens")."""
    return module_matches(name, patterns) or any(name.startswith(p + ".") for p in patterns)
