"""Tiny AWQ and GPTQ checkpoints in the exact on-disk formats of Qwen's -AWQ / -GPTQ-Int4 releases.

For loader tests: quantize a tiny float checkpoint's decoder linears (q/k/v/o, gate/up/down) by round to
nearest, write {prefix}.qweight / .qzeros / .scales (/ .g_idx) in fp16 safetensors next to a config.json
that carries the `quantization_config` AutoAWQ / AutoGPTQ write, and return the float32 state dict the
checkpoint dequantizes to: load it into a transformers model to get the reference a quantized qwick model
must match.

    from tests.utils import make_tiny_model
    from tests.quantization.formats.checkpoints import QUANTIZABLE_DIMS, build_awq_checkpoint

    make_tiny_model("qwen2", src, **QUANTIZABLE_DIMS)   # in-features multiples of 128, two groups
    reference = build_awq_checkpoint(src, dst)
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from qwick.quantization.formats import awq, gptq

# Overrides for `tests.utils.make_tiny_model` so that every linear has K a multiple of 128 (two groups or
# more: hidden 256, intermediate 512) and N a multiple of 8, as group size 128 needs.
QUANTIZABLE_DIMS = dict(hidden_size=256, intermediate_size=512)
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_quantized(name: str) -> bool:
    parts = name.split(".")
    return ".layers." in name and parts[-1] == "weight" and parts[-2] in QUANTIZED_LINEARS


def _load_state(model_dir: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no safetensors in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def _write(src: str, dst: str, tensors: dict[str, torch.Tensor], quant_config: dict) -> None:
    os.makedirs(dst, exist_ok=True)
    for path in glob.glob(os.path.join(src, "*")):
        name = os.path.basename(path)
        if os.path.isfile(path) and not name.endswith((".safetensors", ".bin")) and name != "config.json":
            shutil.copy(path, os.path.join(dst, name))
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["dtype"] = "float16"  # the released checkpoints are fp16 around the int4 weights
    config["quantization_config"] = quant_config
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        os.path.join(dst, "model.safetensors"),
        metadata={"format": "pt"},
    )


def _build(src: str, dst: str, quant_config: dict, quantize, dequantize) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, t in _load_state(src).items():
        if _is_quantized(name):
            prefix = name[: -len(".weight")]
            packed = quantize(name, t)
            for key, value in packed.items():
                tensors[f"{prefix}.{key}"] = value
            reference[name] = dequantize(packed)
        else:
            tensors[name] = t.to(torch.float16)
            reference[name] = tensors[name].to(torch.float32)
    _write(src, dst, tensors, quant_config)
    return reference


def build_awq_checkpoint(tiny_model_dir: str, out_dir: str, group_size: int = 128) -> dict[str, torch.Tensor]:
    """Write an AutoAWQ "gemm" checkpoint of `tiny_model_dir` to `out_dir`; return what it dequantizes to."""
    return _build(
        tiny_model_dir,
        out_dir,
        awq.quantization_config(group_size),
        lambda name, w: awq.quantize(w, group_size),
        lambda packed: awq.dequantize(**packed),
    )


def build_gptq_checkpoint(
    tiny_model_dir: str,
    out_dir: str,
    group_size: int = 128,
    *,
    desc_act: bool = False,
    sym: bool = True,
    v2: bool = False,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Write an AutoGPTQ checkpoint (GPTQModel's v2 with `v2`) of `tiny_model_dir`; return its dequantization.

    With `desc_act`, each input gets a random channel order (standing in for GPTQ's Hessian order), so
    g_idx is a non-monotonic group index as in act-order checkpoints. As in real ones, layers that read the
    same input (q/k/v, gate/up: the Hessian is the input's) share it, so fused QKV / gate-up layers have one.
    """
    gen = torch.Generator().manual_seed(seed)
    offset = 0 if v2 else 1
    orders: dict[str, torch.Tensor] = {}

    def quantize(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        order = None
        if desc_act:
            module = name.split(".")[-2]
            same_input = "qkv" if module in ("q_proj", "k_proj", "v_proj") else module
            same_input = "gate_up" if module in ("gate_proj", "up_proj") else same_input
            key = name.rsplit(".", 2)[0] + "." + same_input
            order = orders.setdefault(key, torch.randperm(w.shape[1], generator=gen))
        return gptq.quantize(w, group_size, sym=sym, act_order=order, zero_offset=offset)

    return _build(
        tiny_model_dir,
        out_dir,
        gptq.quantization_config(group_size, desc_act=desc_act, sym=sym, v2=v2),
        quantize,
        lambda packed: gptq.dequantize(**packed, zero_offset=offset),
    )
