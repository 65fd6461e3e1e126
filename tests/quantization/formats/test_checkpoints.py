"""The tiny AWQ / GPTQ checkpoints the loader tests will use are in the exact released formats."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from qwick.quantization.formats import awq, gptq
from tests.quantization.formats.checkpoints import (
    QUANTIZABLE_DIMS,
    build_awq_checkpoint,
    build_gptq_checkpoint,
)
from tests.utils import make_tiny_model


@pytest.fixture(scope="module")
def float_model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-qwen2-quantizable"))
    make_tiny_model("qwen2", path, **QUANTIZABLE_DIMS)
    return path


def _read_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _original(model_dir: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(model_dir, "model.safetensors"))


def test_awq_checkpoint(float_model_dir, tmp_path):
    out = str(tmp_path / "awq")
    reference = build_awq_checkpoint(float_model_dir, out)
    config = _read_config(out)
    assert config["quantization_config"] == awq.quantization_config(128)
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    tensors = load_file(os.path.join(out, "model.safetensors"))
    original = _original(float_model_dir)
    prefix = "model.layers.0.mlp.down_proj"  # [256, 512]
    assert (
        tensors[f"{prefix}.qweight"].shape == (512, 32) and tensors[f"{prefix}.qweight"].dtype == torch.int32
    )
    assert tensors[f"{prefix}.qzeros"].shape == (4, 32) and tensors[f"{prefix}.qzeros"].dtype == torch.int32
    assert (
        tensors[f"{prefix}.scales"].shape == (4, 256) and tensors[f"{prefix}.scales"].dtype == torch.float16
    )
    assert f"{prefix}.weight" not in tensors and "model.layers.0.self_attn.q_proj.bias" in tensors
    assert tensors["model.embed_tokens.weight"].dtype == torch.float16
    for name, t in original.items():
        assert name in reference
        if name.endswith("proj.weight"):
            prefix = name[: -len(".weight")]
            parts = {key: tensors[f"{prefix}.{key}"] for key in ("qweight", "qzeros", "scales")}
            assert torch.equal(awq.dequantize(**parts), reference[name])
            bound = parts["scales"].float().t().repeat_interleave(128, dim=1) / 2
            assert bool(((t - reference[name]).abs() <= bound * (1 + 1e-6)).all()), name
        else:
            assert torch.equal(reference[name], t.half().float())


@pytest.mark.parametrize("desc_act,sym,v2", [(False, True, False), (True, True, False), (True, False, True)])
def test_gptq_checkpoint(float_model_dir, tmp_path, desc_act, sym, v2):
    out = str(tmp_path / "gptq")
    reference = build_gptq_checkpoint(float_model_dir, out, desc_act=desc_act, sym=sym, v2=v2)
    qc = _read_config(out)["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["desc_act"], qc["sym"]) == (
        "gptq",
        4,
        128,
        desc_act,
        sym,
    )
    offset = gptq.zero_offset(qc)
    assert offset == (0 if v2 else 1)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    prefix = "model.layers.1.self_attn.k_proj"  # [128, 256]
    assert tensors[f"{prefix}.qweight"].shape == (32, 128)
    assert tensors[f"{prefix}.qzeros"].shape == (2, 16)
    assert tensors[f"{prefix}.scales"].shape == (2, 128)
    assert tensors[f"{prefix}.g_idx"].shape == (256,) and tensors[f"{prefix}.g_idx"].dtype == torch.int32
    g_idx = tensors[f"{prefix}.g_idx"].long()
    assert bool((g_idx[1:] >= g_idx[:-1]).all()) != desc_act
    if sym and not v2:
        assert bool((tensors[f"{prefix}.qzeros"] == 0x77777777).all())
    if desc_act:  # layers reading the same input share the act-order permutation (one per fused layer)
        layer = "model.layers.1"
        for shard in ("self_attn.q_proj", "self_attn.v_proj"):
            assert torch.equal(tensors[f"{layer}.{shard}.g_idx"], tensors[f"{prefix}.g_idx"])
        assert torch.equal(tensors[f"{layer}.mlp.gate_proj.g_idx"], tensors[f"{layer}.mlp.up_proj.g_idx"])
        assert not torch.equal(tensors[f"{layer}.self_attn.o_proj.g_idx"], tensors[f"{prefix}.g_idx"])
    original = _original(float_model_dir)
    for name in original:
        if name.endswith("proj.weight"):
            prefix = name[: -len(".weight")]
            parts = {key: tensors[f"{prefix}.{key}"] for key in ("qweight", "qzeros", "scales", "g_idx")}
            assert torch.equal(gptq.dequantize(**parts, zero_offset=offset), reference[name])
            internal = gptq.to_internal(**parts, zero_offset=offset)
            assert (internal.perm is not None) == desc_act
            err = (original[name] - reference[name]).abs().max()
            assert err <= parts["scales"].float().max() / 2 * (1 + 1e-6)
