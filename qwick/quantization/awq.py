"""AWQ checkpoints (`quant_method: "awq"`, AutoAWQ's "gemm" version: Qwen's -AWQ releases).

config.json: {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm",
"modules_to_not_convert": null}. The checkpoint layout is in qwick/quantization/formats/awq.py; the layer
method (4-bit weights, activations unquantized) in qwick/quantization/int4.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from qwick.quantization.base import QuantizationConfig
from qwick.quantization.int4 import Int4LinearMethod, check_bits, is_ignored


class AwqConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int = 128, ignored: Sequence[str] = ()) -> None:
        self.group_size = group_size
        self.ignored = list(ignored)

    @classmethod
    def from_config(cls, hf_quant_config: dict) -> AwqConfig:
        check_bits("awq", hf_quant_config)
        version = str(hf_quant_config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"awq checkpoint with version={version!r}: qwick loads AutoAWQ's 'gemm' layout only"
            )
        if not hf_quant_config.get("zero_point", True):
            raise ValueError("awq checkpoint with zero_point=false: qwick loads AWQ with zero points only")
        group_size = int(hf_quant_config.get("group_size", hf_quant_config.get("q_group_size", 128)))
        ignored = hf_quant_config.get("modules_to_not_convert") or []
        return cls(group_size, ignored)

    def describe(self) -> str:
        return f"awq checkpoint (int4, group {self.group_size})"

    def linear_method(self, prefix: str, shard_names: Sequence[str]) -> Int4LinearMethod | None:
        if prefix == "lm_head":
            return None
        skipped = [is_ignored(name, self.ignored) for name in shard_names]
        if all(skipped):
            return None
        if any(skipped):
            raise ValueError(f"{prefix}: the checkpoint quantizes only some of {list(shard_names)}")
        return Int4LinearMethod("awq", self.group_size)
