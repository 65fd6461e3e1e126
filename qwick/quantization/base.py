"""A quantization format, to the engine: a `QuantizationConfig` that hands each linear layer its method.

A config comes from one of two places:
- the checkpoint: `quantization_config` in config.json names a `quant_method` ("compressed-tensors", "fp8",
  ...); `QuantizationConfig.from_config` reads the rest (schemes, block sizes, ignored modules);
- the user, on an unquantized checkpoint: `quantization="fp8"` quantizes the bf16/fp16/fp32 weights while
  loading (`for_unquantized_checkpoint`).

The model asks `linear_method(prefix, shard_names)` for every linear layer it builds and gets a
`LinearMethod` (qwick/layers/linear.py) or None (leave the layer unquantized). The model file never knows
which format it runs.

Adding a format (W8A8 in qwick/quantization/w8a8.py is the worked example):
1. a `QuantizationConfig` subclass: `from_config` for its checkpoints, `for_unquantized_checkpoint` if it
   can quantize bf16 weights while loading, `linear_method`;
2. a `LinearMethod` subclass with `quantized = True`: `create_weights` registers the checkpoint's tensors
   as parameters, marked for packed q/k/v and gate/up shards with `output_dim` (1 for [in, out] layouts),
   `rows_per_entry` (outputs per entry: a scale block's height, the outputs packed in one int32) and
   `per_tensor_ok`; `load_extra` takes tensors it does not keep; `process_weights_after_loading` repacks;
   `apply` runs the matmul (a CPU reference path too); `dense_weight` dequantizes, for exports to
   transformers; `load_dense` (optional) writes a plain weight, for `load_format="dummy"`;
3. its name in `QUANTIZATION_METHODS` (qwick/quantization/__init__.py).

A format that reads more than config.json (GGUF kept quantized, qwick/quantization/gguf.py) overrides
`for_model_dir` (it gets the checkpoint directory) and `checkpoint_weights` (the tensors to load).
"""

from __future__ import annotations

import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from qwick.quantization import QUANTIZATION_METHODS, get_quantization_config_cls, quantization_names

if TYPE_CHECKING:
    from qwick.layers.linear import LinearMethod

logger = logging.getLogger(__name__)


class QuantizationConfig(ABC):
    name: ClassVar[str]
    # Other `quantization=` values that mean this checkpoint's format (e.g. "fp8" for compressed-tensors fp8).
    aliases: frozenset[str] = frozenset()
    # Whether `quantize_lm_head` is honoured: the on-the-fly configs that quantize a plain LM head, and GGUF
    # (which keeps the file's head blocks), set it; an instance may turn it off (an fp8 checkpoint's).
    can_quantize_lm_head: bool = False
    # The LM head's format when `quantize_lm_head` is left unset (None: the model dtype): the on-the-fly
    # modes make it 8-bit (int4 too, in int8).
    default_lm_head: ClassVar[str | None] = None
    quantize_lm_head: bool | None = None  # as asked (`resolve_quantization`); read through `lm_head_format`

    def lm_head_format(self) -> str | None:
        """The LM head's format as `linear_method` builds it (None: the model dtype): the body's when asked
        for, `default_lm_head` when left unset."""
        if not self.can_quantize_lm_head or self.quantize_lm_head is False:
            return None
        return self.name if self.quantize_lm_head else self.default_lm_head

    @classmethod
    def from_config(cls, hf_quant_config: dict) -> QuantizationConfig:
        """The config of a checkpoint whose `quantization_config` has `quant_method` == `cls.name`."""
        raise ValueError(f"qwick cannot load checkpoints quantized with {cls.name!r}")

    @classmethod
    def for_unquantized_checkpoint(cls) -> QuantizationConfig:
        """Quantize an unquantized checkpoint's weights while loading (`quantization=NAME`)."""
        raise ValueError(
            f"quantization={cls.name!r} needs a checkpoint already quantized in that format; this one has "
            "no quantization_config. On-the-fly quantization of bf16/fp16/fp32 weights: "
            f"{', '.join(on_the_fly_names())}"
        )

    @classmethod
    def for_model_dir(cls, path: str | None) -> QuantizationConfig:
        """`quantization=NAME` on the unquantized checkpoint in `path` (None: random weights). Formats that
        read the checkpoint's own files (GGUF kept quantized) override this; the others need no path."""
        return cls.for_unquantized_checkpoint()

    def checkpoint_weights(self, path: str) -> Iterator[tuple[str, Any]]:
        """(name, tensor) pairs to load into the model built with this config: the safetensors in `path`.
        A format may substitute tensors it reads elsewhere (GGUF blocks for the dequantized weights)."""
        from qwick.loader.weights import iterate_safetensors

        return iterate_safetensors(path)

    @abstractmethod
    def linear_method(self, prefix: str, shard_names: Sequence[str]) -> LinearMethod | None:
        """The method of the linear layer `prefix` (a Hugging Face module name), or None: unquantized.

        `shard_names` are the checkpoint modules packed into it (q/k/v_proj for a qkv_proj), or [prefix].
        """

    def describe(self) -> str:
        return self.name


def _overriding(method: str) -> list[str]:
    """Registered names whose config class implements the classmethod `method`."""
    base = getattr(QuantizationConfig, method).__func__
    names = quantization_names()
    return [n for n in names if getattr(get_quantization_config_cls(n), method).__func__ is not base]


def on_the_fly_names() -> list[str]:
    """The registered formats that can quantize an unquantized checkpoint while loading."""
    return _overriding("for_unquantized_checkpoint")


def checkpoint_names() -> list[str]:
    """The registered formats that load checkpoints quantized in them."""
    return _overriding("from_config")


def checkpoint_quant_config(hf_config) -> dict | None:
    """The checkpoint's `quantization_config` as a dict, or None for an unquantized checkpoint."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    return qc


def detect(hf_config) -> QuantizationConfig | None:
    """The quantization a checkpoint's config.json declares, or None. Unsupported formats are an error that
    names what the checkpoint is."""
    qc = checkpoint_quant_config(hf_config)
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")  # "compressed_tensors" in some
    if method not in QUANTIZATION_METHODS:
        summary = json.dumps({k: v for k, v in qc.items() if not isinstance(v, (dict, list))})[:300]
        raise ValueError(
            f"the checkpoint is quantized with quant_method={method or None!r} ({summary}), which qwick "
            f"cannot load; supported checkpoint formats: {', '.join(checkpoint_names())}"
        )
    return get_quantization_config_cls(method).from_config(qc)


def resolve_quantization(
    requested: str | None, hf_config, model_path: str | None = None, *, quantize_lm_head: bool | None = None
) -> QuantizationConfig | None:
    """The config to build the model with, from `quantization=` and the checkpoint's own config.

    `model_path`: the checkpoint directory (None for random weights), for formats that read its files.
    `quantize_lm_head`: the LM head quantized too, which the modes that quantize (or repack) weights while
    loading offer; a quantized checkpoint's head stays as it ships. None: the mode's default
    (`default_lm_head`)."""
    config = _resolve(requested, hf_config, model_path)
    if quantize_lm_head and (config is None or not config.can_quantize_lm_head):
        what = "no quantization" if config is None else config.describe()
        raise ValueError(
            f"quantize_lm_head applies to quantization={'|'.join(lm_head_names())} (weights quantized or "
            f"repacked while loading); this model runs {what}"
        )
    if config is not None:
        config.quantize_lm_head = quantize_lm_head
    return config


def lm_head_names() -> list[str]:
    """The registered formats that can include the LM head (`quantize_lm_head`)."""
    return [n for n in quantization_names() if get_quantization_config_cls(n).can_quantize_lm_head]


def _resolve(requested: str | None, hf_config, model_path: str | None) -> QuantizationConfig | None:
    if requested == "none":
        requested = None
    if requested is not None:
        get_quantization_config_cls(requested)  # an unknown name fails here, before the checkpoint is read
    found = detect(hf_config)
    if found is None:
        if requested is None:
            return None
        return get_quantization_config_cls(requested).for_model_dir(model_path)
    if requested is not None and requested != found.name and requested not in found.aliases:
        raise ValueError(
            f"the checkpoint is already quantized ({found.describe()}); quantization={requested!r} cannot "
            "re-quantize it: leave quantization unset to run it as it is"
        )
    return found


def module_matches(name: str, patterns: Sequence[str]) -> bool:
    """compressed-tensors / llm-compressor matching: an exact module name, "re:REGEX" (re.match), the class
    name "Linear" (every linear layer), or a dotted suffix of the name."""
    for pattern in patterns:
        if pattern == "Linear" or pattern == name:
            return True
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name.endswith("." + pattern):
            return True
    return False


def weight_bytes(model) -> dict[str, int]:
    """Bytes of parameters: all of them, and those of the decoder's linear layers (codes, scales, biases;
    the LM head, unquantized unless `quantize_lm_head`, is left out)."""
    from qwick.layers.linear import Linear

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    linears = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name != "lm_head":
            linears += sum(p.numel() * p.element_size() for p in module.parameters())
    return {"total": total, "linear": linears}


def warn_slow_on_cpu(model) -> None:
    """Say so when a model on the CPU holds fp8 weights: no CPU kernel reads them, so every matmul first
    converts all of its codes to the activation dtype (the reference path). The demo model decodes at 722
    ms per step that way on this project's 2-core machine, against ~33 ms in bf16 and 20-27 ms in int8 or
    int4, which have CPU kernels."""
    from qwick.layers.linear import Linear
    from qwick.quantization.w8a8 import FP8_DTYPE, W8A8LinearMethod

    fp8 = sum(
        isinstance(m, Linear) and isinstance(m.method, W8A8LinearMethod) and m.method.qdtype == FP8_DTYPE
        for m in model.modules()
    )
    if fp8:
        logger.warning(
            "%d linear layers hold fp8 weights, which no CPU kernel reads: each matmul converts its codes "
            "first, so decoding is ~20x slower than with bf16 weights on a CPU; int8 and int4 have CPU "
            "kernels",
            fp8,
        )


def log_quantized(model, config_name: str) -> None:
    """One log line: how many linear layers run which method, and the weights' memory."""
    from qwick.layers.linear import Linear

    kinds: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            method = module.method
            key = method.describe() if hasattr(method, "describe") else "unquantized"
            kinds[key] = kinds.get(key, 0) + 1
    sizes = weight_bytes(model)
    logger.info(
        "Quantization %s: %s; weights %.1f MiB (decoder linear layers %.1f MiB)",
        config_name,
        "; ".join(f"{n} {'layer' if n == 1 else 'layers'} {k}" for k, n in kinds.items()),
        sizes["total"] / 2**20,
        sizes["linear"] / 2**20,
    )
