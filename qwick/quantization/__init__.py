"""Quantization methods for linear layers, looked up by name.

Torch-free on purpose: `EngineConfig` (imported by the API process) validates `quantization=` against these
names. Each entry points at a `QuantizationConfig` subclass (see `qwick/quantization/base.py`), imported
only when a model is built. The same names serve `quantization=` / `--quantization` and the
`quant_method` of a checkpoint's `quantization_config`.

To add a format, add one line (or call `register_quantization` before the engine starts).
"""

from __future__ import annotations

import importlib

# name -> "module:ClassName" of its QuantizationConfig
QUANTIZATION_METHODS: dict[str, str] = {
    "fp8": "qwick.quantization.fp8:Fp8Config",
    "int8": "qwick.quantization.int8:Int8Config",
    "compressed-tensors": "qwick.quantization.compressed_tensors:CompressedTensorsConfig",
    "awq": "qwick.quantization.awq:AwqConfig",
    "gptq": "qwick.quantization.gptq:GptqConfig",
    "int4": "qwick.quantization.int4:Int4Config",
    "gguf": "qwick.quantization.gguf:GgufConfig",
}


def register_quantization(name: str, target: str) -> None:
    """Make `name` a valid `quantization=` value and `quant_method`; `target` is "module:ClassName"."""
    QUANTIZATION_METHODS[name] = target


def quantization_names() -> list[str]:
    return sorted(QUANTIZATION_METHODS)


def get_quantization_config_cls(name: str) -> type:
    """The `QuantizationConfig` subclass registered under `name` (imports its module)."""
    try:
        target = QUANTIZATION_METHODS[name]
    except KeyError:
        raise ValueError(
            f"unknown quantization {name!r}; qwick supports: {', '.join(quantization_names())}"
        ) from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)
