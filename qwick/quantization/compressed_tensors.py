"""compressed-tensors checkpoints (llm-compressor, RedHatAI/neuralmagic "-FP8-dynamic", "-quantized.w8a8"):
`quant_method: "compressed-tensors"` with `config_groups` that say which modules (`targets`, minus `ignore`)
carry which scheme.

Supported schemes, all symmetric 8-bit (qwick/quantization/w8a8.py):
- fp8 ("float-quantized") weights per channel or per tensor, or in blocks (`strategy: "block"`,
  `block_structure: [128, 128]`, the block scales in `weight_scale`);
- int8 ("int-quantized") weights per channel or per tensor;
- activations 8-bit of the same type (run dynamic per token whatever the checkpoint's strategy says), or
  none (W8A16: weight-only).
Anything else (4-bit packed weights, asymmetric zero points, sparsity, KV-cache scales) is an error that
names the scheme.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import torch

from qwick.quantization.base import QuantizationConfig, module_matches
from qwick.quantization.w8a8 import FP8_DTYPE, W8A8LinearMethod

logger = logging.getLogger(__name__)
_EIGHT_BIT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, groups: list[tuple[list[str], dict]], ignore: list[str]) -> None:
        self.groups = groups  # (targets, W8A8LinearMethod kwargs), in config order
        self.ignore = ignore
        kinds = {"fp8" if kw["qdtype"] == FP8_DTYPE else "int8" for _, kw in groups}
        self.aliases = frozenset(kinds)

    @classmethod
    def from_config(cls, hf_quant_config: dict) -> CompressedTensorsConfig:
        qc = hf_quant_config
        if qc.get("sparsity_config"):
            raise ValueError(
                f"compressed-tensors sparsity ({_short(qc['sparsity_config'])}) is not supported"
            )
        if qc.get("kv_cache_scheme"):
            raise ValueError(
                f"compressed-tensors kv_cache_scheme ({_short(qc['kv_cache_scheme'])}): quantized KV-cache "
                "scales are not supported yet"
            )
        groups = []
        for name, group in (qc.get("config_groups") or {}).items():
            fmt = group.get("format") or qc.get("format") or "dense"
            groups.append((list(group.get("targets") or []), _scheme(name, group, fmt)))
        if not groups:
            raise ValueError("compressed-tensors config without config_groups: nothing is quantized")
        return cls(groups, list(qc.get("ignore") or []))

    def describe(self) -> str:
        kinds = sorted(self.aliases)
        return f"compressed-tensors ({', '.join(kinds)})"

    def linear_method(self, prefix: str, shard_names: Sequence[str]) -> W8A8LinearMethod | None:
        picks = [self._group_of(name) for name in shard_names]
        if len(set(picks)) > 1:
            raise ValueError(
                f"{prefix}: the checkpoint quantizes {list(shard_names)} with different schemes, which one "
                "packed layer cannot hold"
            )
        if picks[0] is None:
            return None
        return W8A8LinearMethod(checkpoint=True, **self.groups[picks[0]][1])

    def _group_of(self, name: str) -> int | None:
        if module_matches(name, self.ignore):
            return None
        for i, (targets, _) in enumerate(self.groups):
            if module_matches(name, targets):
                return i
        return None


def _scheme(name: str, group: dict, fmt: str) -> dict:
    """W8A8LinearMethod arguments for one config group, or a clear error naming the scheme."""
    w = group.get("weights") or {}
    a = group.get("input_activations")
    what = f"compressed-tensors group {name!r} (format {fmt!r}, weights {_short(w)}, activations {_short(a)})"
    if fmt not in _EIGHT_BIT_FORMATS or w.get("num_bits") != 8:
        raise ValueError(f"{what} is not supported: qwick loads 8-bit fp8/int8 schemes only")
    if w.get("type") not in ("float", "int"):
        raise ValueError(f"{what}: unknown weight type {w.get('type')!r}")
    if not w.get("symmetric", True) or (a and not a.get("symmetric", True)):
        raise ValueError(f"{what}: asymmetric quantization (zero points) is not supported")
    qdtype = FP8_DTYPE if w["type"] == "float" else torch.int8
    strategy = w.get("strategy")
    block = None
    if strategy == "block":
        block = w.get("block_structure")
        if qdtype != FP8_DTYPE or not block or len(block) != 2:
            raise ValueError(f"{what}: block-wise scales are supported for fp8 weights with [rows, columns]")
        block = (int(block[0]), int(block[1]))
    elif strategy not in ("channel", "tensor"):
        raise ValueError(f"{what}: weight strategy {strategy!r} is not supported (channel, tensor, block)")
    if a is not None and (a.get("num_bits") != 8 or a.get("type") != w["type"]):
        raise ValueError(f"{what}: activations must be 8-bit of the weights' type, or absent")
    if a is not None and not a.get("dynamic", True):
        logger.warning("%s: static activation scales; qwick quantizes activations per token instead", what)
    return {
        "qdtype": qdtype,
        "block": block,
        "scale_name": "weight_scale",
        "quantize_activations": a is not None,
    }


def _short(value) -> str:
    if not isinstance(value, dict):
        return json.dumps(value)
    keep = ("num_bits", "type", "strategy", "group_size", "block_structure", "symmetric", "dynamic", "format")
    return json.dumps({k: value[k] for k in keep if k in value})
