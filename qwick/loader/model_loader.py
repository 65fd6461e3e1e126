"""From a user's `model` argument to a loaded model: resolve where it lives, read its config, build, load.

`model` may be None (the built-in demo model), a Hugging Face model directory, a `.gguf` file, or a Hub id.
GGUF files (the demo included) are converted once into a cached Hugging Face directory, so every source
ends up as a directory with config.json, safetensors and tokenizer files.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
from transformers import AutoConfig, PretrainedConfig

from qwick.layers.linear import select_linear_method
from qwick.loader.weights import fill_dummy_weights, iterate_safetensors
from qwick.models.decoder import DecoderForCausalLM
from qwick.models.registry import resolve_model_class
from qwick.quantization.base import resolve_quantization

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass
class ResolvedModel:
    path: str  # a Hugging Face-style directory
    name: str  # the name to report (and serve under)
    source: str  # "demo", "dir", "gguf" or "hub"


def resolve_model(model: str | None, revision: str | None = None) -> ResolvedModel:
    if model is None:
        from qwick.loader.demo import DEMO_MODEL_NAME, demo_model_path

        return ResolvedModel(demo_model_path(), DEMO_MODEL_NAME, "demo")
    expanded = os.path.expanduser(model)
    if os.path.isfile(expanded):
        from qwick.loader.gguf import gguf_to_hf_dir

        return ResolvedModel(gguf_to_hf_dir(expanded), os.path.basename(expanded), "gguf")
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise FileNotFoundError(f"model directory {expanded} has no config.json")
        return ResolvedModel(expanded, model, "dir")
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return ResolvedModel(_download_from_hub(model, revision), model, "hub")
    raise FileNotFoundError(
        f"model {model!r} is neither a local directory, a .gguf file, nor a Hugging Face Hub id (org/name)"
    )


def _download_from_hub(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except Exception as exc:  # network errors come in many types; all mean the same to the user
        raise OSError(
            f"could not fetch {repo_id!r} from the Hugging Face Hub ({type(exc).__name__}: {exc}). "
            "Without network access, pass a local model directory or .gguf file instead."
        ) from exc


def load_config(path: str) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(path)
    except ValueError as exc:  # transformers does not know the model_type
        raise ValueError(f"cannot read the model config in {path}: {exc}") from exc


def resolve_dtype(dtype: str, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        # bf16 halves the bytes each decode step streams from memory; only worth it with native bf16 math.
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    config_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype, torch.bfloat16)
    if config_dtype in (None, torch.float32):
        return torch.bfloat16
    return config_dtype


def cpu_has_native_bf16() -> bool:
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check and check())


def derive_max_model_len(config: PretrainedConfig, requested: int | None) -> int:
    limit = getattr(config, "max_position_embeddings", None) or 4096
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} is larger than the model's max_position_embeddings={limit}"
        )
    return requested


def build_model(
    config: PretrainedConfig,
    path: str | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    quantize_lm_head: bool | None = None,
) -> DecoderForCausalLM:
    """Build the model for `config` on `device`, fill it (checkpoint or dummy), prepare its weights.

    `quantization`: a registered name (qwick.quantization) or None; the checkpoint's own
    `quantization_config` is detected either way. `quantize_lm_head`: the on-the-fly modes quantize the LM
    head too (None: the mode's default).
    """
    model_cls = resolve_model_class(config)
    quant_config = resolve_quantization(
        quantization, config, None if load_format == "dummy" else path, quantize_lm_head=quantize_lm_head
    )
    start = time.perf_counter()
    torch_default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = model_cls(config, max_len, quant_config)
    finally:
        torch.set_default_dtype(torch_default)
    # rotary tables stay fp32: transformers computes cos/sin in fp32 too
    model.model.rotary.to(device=device, dtype=torch.float32)
    if load_format == "dummy":
        fill_dummy_weights(model, seed)
    else:
        weights = iterate_safetensors(path) if quant_config is None else quant_config.checkpoint_weights(path)
        loaded = model.load_weights(weights)
        expected = {n for n, _ in model.named_parameters()}
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint in {path} lacks weights: {', '.join(sorted(missing)[:8])}")
    model.process_weights_after_loading(select_linear_method(device, dtype))
    if quant_config is not None and device.type == "cuda":
        torch.cuda.empty_cache()  # give back the plain weights quantized on the fly, before KV sizing
    model.eval()
    logger.info("Built %s (%s, %s) in %.1fs", model_cls.__name__, dtype, device, time.perf_counter() - start)
    if quant_config is not None:
        from qwick.quantization.base import log_quantized, warn_slow_on_cpu

        head_format = quant_config.lm_head_format()
        head = "" if head_format is None else f"; LM head in {head_format}"
        log_quantized(model, quant_config.describe() + head)
        if device.type == "cpu":
            warn_slow_on_cpu(model)
    return model
