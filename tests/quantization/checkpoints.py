"""Tiny quantized checkpoints in the exact layouts real ones ship in, and the references to check them with.

Each builder quantizes a tiny random transformers model's linear layers (not the LM head, not the
embeddings) the way the format's producer does, writes config.json with the `quantization_config` real
checkpoints carry, and returns the dequantized weights: what transformers runs as the reference.
The quantizers here are written independently of qwick's.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# RedHatAI/Qwen2.5-7B-Instruct-FP8-dynamic (llm-compressor FP8_DYNAMIC): fp8 weights per channel, bf16 scales.
CT_FP8_DYNAMIC = {
    "config_groups": {
        "group_0": {
            "input_activations": {
                "actorder": None,
                "block_structure": None,
                "dynamic": True,
                "group_size": None,
                "num_bits": 8,
                "observer": None,
                "observer_kwargs": {},
                "strategy": "token",
                "symmetric": True,
                "type": "float",
            },
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": None,
                "num_bits": 8,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "channel",
                "symmetric": True,
                "type": "float",
            },
        }
    },
    "format": "float-quantized",
    "global_compression_ratio": 1.46,
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

# RedHatAI/Qwen2.5-7B-Instruct-quantized.w8a8 (llm-compressor W8A8 int8): int8 weights per channel.
CT_INT8_W8A8 = {
    "config_groups": {
        "group_0": {
            "input_activations": {
                "block_structure": None,
                "dynamic": True,
                "group_size": None,
                "num_bits": 8,
                "observer": "memoryless",
                "observer_kwargs": {},
                "strategy": "token",
                "symmetric": True,
                "type": "int",
            },
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "block_structure": None,
                "dynamic": False,
                "group_size": None,
                "num_bits": 8,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "channel",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "int-quantized",
    "global_compression_ratio": 1.24,
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

# Qwen/Qwen3-8B-FP8: 128x128 block-wise fp8, scales in `weight_scale_inv` (they multiply).
QWEN_FP8_BLOCK = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}

# llm-compressor FP8_BLOCK: the same blocks under compressed-tensors, scales in `weight_scale`.
CT_FP8_BLOCK = {
    "config_groups": {
        "group_0": {
            "format": "float-quantized",
            "input_activations": {
                "dynamic": True,
                "group_size": 128,
                "num_bits": 8,
                "strategy": "group",
                "symmetric": True,
                "type": "float",
            },
            "targets": ["Linear"],
            "weights": {
                "block_structure": [128, 128],
                "dynamic": False,
                "num_bits": 8,
                "strategy": "block",
                "symmetric": True,
                "type": "float",
            },
        }
    },
    "format": "float-quantized",
    "ignore": ["lm_head"],
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

# vLLM's / AutoFP8's per-tensor fp8 with static activation scales (e.g. neuralmagic/*-FP8 of 2024).
FP8_PER_TENSOR_STATIC = {"quant_method": "fp8", "activation_scheme": "static"}


def fp8_per_channel(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(dim=1, keepdim=True) * (1.0 / 448.0)).to(scale_dtype)
    q = (w / scale.float()).clamp(-448, 448).to(FP8)
    return q, scale


def int8_per_channel(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(dim=1, keepdim=True) * (1.0 / 127.0)).to(scale_dtype)
    q = torch.round(w / scale.float()).clamp(-127, 127).to(torch.int8)
    return q, scale


def fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().max() / 448.0
    return (w / scale).clamp(-448, 448).to(FP8), scale.reshape(())


def fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales [ceil(N/128), ceil(K/128)]; edge blocks cover what is left."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    scale = torch.empty(nb, kb)
    q = torch.empty(n, k, dtype=FP8)
    for i in range(nb):
        for j in range(kb):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            scale[i, j] = tile.abs().max() / 448.0
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / scale[i, j]).to(FP8)
    return q, scale


def dequant_block(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    full = scale.repeat_interleave(block, 0)[: q.shape[0]].repeat_interleave(block, 1)[:, : q.shape[1]]
    return q.float() * full


FORMATS = {  # name -> the `quantization_config` its config.json carries
    "ct-fp8-channel": CT_FP8_DYNAMIC,
    "ct-int8-channel": CT_INT8_W8A8,
    "qwen-fp8-block": QWEN_FP8_BLOCK,
    "ct-fp8-block": CT_FP8_BLOCK,
    "fp8-per-tensor-static": FP8_PER_TENSOR_STATIC,
}


def quantize_linear(fmt: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Checkpoint tensors of one linear weight in format `fmt` (names relative to the module), and the
    dequantized weight they stand for."""
    if fmt == "ct-fp8-channel":
        q, s = fp8_per_channel(w, torch.bfloat16)
        return {"weight": q, "weight_scale": s}, q.float() * s.float()
    if fmt == "ct-int8-channel":
        q, s = int8_per_channel(w, torch.float32)
        zero = torch.zeros_like(s, dtype=torch.int8)  # older compressed-tensors wrote symmetric zero points
        return {"weight": q, "weight_scale": s, "weight_zero_point": zero}, q.float() * s
    if fmt in ("qwen-fp8-block", "ct-fp8-block"):
        q, s = fp8_block(w)
        name = "weight_scale_inv" if fmt == "qwen-fp8-block" else "weight_scale"
        return {"weight": q, name: s}, dequant_block(q, s)
    if fmt == "fp8-per-tensor-static":
        q, s = fp8_per_tensor(w)
        return {"weight": q, "weight_scale": s, "input_scale": torch.tensor(0.05)}, q.float() * s
    raise KeyError(fmt)


def activation_group(fmt: str) -> int | None:
    """Activations are quantized per token and per 128-column group under block weights."""
    return 128 if fmt.endswith("block") else None


def write_quantized_checkpoint(hf_model, path: str, fmt: str) -> dict[str, torch.Tensor]:
    """Overwrite `path` (a saved tiny model) with `fmt`'s quantized weights; return the dequantized state
    dict (fp32) for transformers."""
    tensors: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, param in hf_model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in LINEAR_LEAVES:
            parts, deq = quantize_linear(fmt, param.float())
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
            dequantized[name] = deq
        else:
            tensors[name] = param.detach().clone().contiguous()
            dequantized[name] = param.detach().float()
    if getattr(hf_model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(path, f))
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = FORMATS[fmt]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dequantized


def fake_quant_activations(x: torch.Tensor, qdtype: torch.dtype, group: int | None) -> torch.Tensor:
    """quantize-then-dequantize x per token (and per `group` columns), symmetric absmax, in fp32."""
    qmax = 448.0 if qdtype == FP8 else 127.0
    shape = x.shape
    xf = x.float().reshape(-1, shape[-1])
    if group is not None:
        k = shape[-1]
        pad = (-k) % group
        xf = torch.nn.functional.pad(xf, (0, pad)).reshape(xf.shape[0], -1, group)
    # absmax * fp32(1 / qmax): what torch's `absmax / qmax` does on CUDA, the definition qwick uses everywhere
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) * (1.0 / qmax)
    q = xf / scale
    q = q.round() if qdtype == torch.int8 else q
    q = q.clamp(-qmax, qmax).to(qdtype).float() * scale
    if group is not None:
        q = q.reshape(q.shape[0], -1)[:, : shape[-1]]
    return q.reshape(shape).to(x.dtype)


def add_activation_fake_quant(hf_model, qdtype: torch.dtype, group: int | None = None) -> None:
    """Make transformers quantize the inputs of every linear layer but the LM head, as W8A8 does."""
    for name, module in hf_model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in LINEAR_LEAVES:
            module.register_forward_pre_hook(
                lambda _m, args: (fake_quant_activations(args[0], qdtype, group),)
            )
