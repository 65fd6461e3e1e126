"""GPTQ checkpoints (`quant_method: "gptq"`, as AutoGPTQ / GPTQModel write them: Qwen's -GPTQ-Int4 releases).

config.json: {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": ..., "sym": ...,
optional "checkpoint_format": "gptq" (v1, zero points stored minus one) | "gptq_v2"}. Symmetric and
asymmetric, with or without act-order (desc_act: q/k/v and gate/up must share their g_idx, as GPTQ gives
them). The layout is in qwick/quantization/formats/gptq.py; the layer method in qwick/quantization/int4.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from qwick.quantization.base import QuantizationConfig
from qwick.quantization.formats.gptq import zero_offset
from qwick.quantization.int4 import Int4LinearMethod, check_bits, is_ignored


class GptqConfig(QuantizationConfig):
    name = "gptq"

    def __init__(
        self,
        group_size: int = 128,
        *,
        desc_act: bool = False,
        sym: bool = True,
        zero_offset: int = 1,
        ignored: Sequence[str] = (),
    ) -> None:
        self.group_size = group_size
        self.desc_act = desc_act
        self.sym = sym
        self.zero_offset = zero_offset
        self.ignored = list(ignored)

    @classmethod
    def from_config(cls, hf_quant_config: dict) -> GptqConfig:
        check_bits("gptq", hf_quant_config)
        if hf_quant_config.get("dynamic"):
            raise ValueError("gptq checkpoint with per-module 'dynamic' overrides: not supported by qwick")
        return cls(
            int(hf_quant_config.get("group_size", 128)),
            desc_act=bool(hf_quant_config.get("desc_act", False)),
            sym=bool(hf_quant_config.get("sym", True)),
            zero_offset=zero_offset(hf_quant_config),  # rejects unknown checkpoint_format values
            ignored=hf_quant_config.get("modules_to_not_convert") or [],
        )

    def describe(self) -> str:
        fmt = "v1" if self.zero_offset else "v2"
        kind = "sym" if self.sym else "asym"
        order = ", desc_act" if self.desc_act else ""
        return f"gptq {fmt} checkpoint (int4 {kind}, group {self.group_size}{order})"

    def linear_method(self, prefix: str, shard_names: Sequence[str]) -> Int4LinearMethod | None:
        if prefix == "lm_head":
            return None
        skipped = [is_ignored(name, self.ignored) for name in shard_names]
        if all(skipped):
            return None
        if any(skipped):
            raise ValueError(f"{prefix}: the checkpoint quantizes only some of {list(shard_names)}")
        return Int4LinearMethod("gptq", self.group_size, zero_offset=self.zero_offset, desc_act=self.desc_act)
