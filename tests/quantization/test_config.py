"""Choosing a quantization: names, detection from config.json, the per-layer method, clear errors, the CLI."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from qwick.config import EngineConfig
from qwick.entrypoints.cli import build_parser, engine_config_from_args, main
from qwick.quantization.base import detect, resolve_quantization
from qwick.quantization.int4 import RtnInt4LinearMethod
from qwick.quantization.w8a8 import FP8_DTYPE
from tests.quantization.checkpoints import (
    CT_FP8_BLOCK,
    CT_FP8_DYNAMIC,
    CT_INT8_W8A8,
    FP8_PER_TENSOR_STATIC,
    QWEN_FP8_BLOCK,
)

QKV = ("model.layers.0.self_attn.qkv_proj", [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"])
DOWN = ("model.layers.0.mlp.down_proj", ["model.layers.0.mlp.down_proj"])


def _hf(quantization_config=None):
    return SimpleNamespace(quantization_config=quantization_config)


@pytest.mark.parametrize(
    "qc,name,qdtype,block,scale_name",
    [
        (CT_FP8_DYNAMIC, "compressed-tensors", FP8_DTYPE, None, "weight_scale"),
        (CT_INT8_W8A8, "compressed-tensors", torch.int8, None, "weight_scale"),
        (CT_FP8_BLOCK, "compressed-tensors", FP8_DTYPE, (128, 128), "weight_scale"),
        (QWEN_FP8_BLOCK, "fp8", FP8_DTYPE, (128, 128), "weight_scale_inv"),
        (FP8_PER_TENSOR_STATIC, "fp8", FP8_DTYPE, None, "weight_scale"),
    ],
)
def test_checkpoint_formats_are_detected(qc, name, qdtype, block, scale_name):
    config = detect(_hf(qc))
    assert config.name == name
    method = config.linear_method(*QKV)
    assert method.quantized and method.checkpoint and method.quantize_activations
    assert (method.qdtype, method.block, method.scale_name) == (qdtype, block, scale_name)
    assert config.linear_method("lm_head", ["lm_head"]) is None


def test_unquantized_checkpoint():
    assert detect(_hf()) is None
    assert resolve_quantization(None, _hf()) is None
    assert resolve_quantization("none", _hf()) is None
    for name, qdtype in (("fp8", FP8_DTYPE), ("int8", torch.int8)):
        config = resolve_quantization(name, _hf())
        method = config.linear_method(*DOWN)
        assert method.qdtype == qdtype and not method.checkpoint
        assert config.linear_method("lm_head", ["lm_head"]).qdtype == qdtype  # an 8-bit head by default
        config = resolve_quantization(name, _hf(), quantize_lm_head=False)
        assert config.linear_method("lm_head", ["lm_head"]) is None  # the LM head stays in the model dtype
    int4 = resolve_quantization("int4", _hf())  # the head in int8 by default, in int4 when asked, or plain
    assert int4.lm_head_format() == "int8"
    assert int4.linear_method("lm_head", ["lm_head"]).qdtype == torch.int8
    assert isinstance(int4.linear_method(*DOWN), RtnInt4LinearMethod)
    int4 = resolve_quantization("int4", _hf(), quantize_lm_head=True)
    assert int4.lm_head_format() == "int4"
    assert isinstance(int4.linear_method("lm_head", ["lm_head"]), RtnInt4LinearMethod)
    int4 = resolve_quantization("int4", _hf(), quantize_lm_head=False)
    assert int4.lm_head_format() is None and int4.linear_method("lm_head", ["lm_head"]) is None


def test_compressed_tensors_targets_and_ignore():
    qc = copy.deepcopy(CT_FP8_DYNAMIC)
    qc["config_groups"]["group_0"]["targets"] = [r"re:.*mlp\.(gate|up|down)_proj$"]
    qc["ignore"] = ["lm_head", "model.layers.1.mlp.down_proj"]
    config = detect(_hf(qc))
    assert config.linear_method(*QKV) is None
    assert config.linear_method(*DOWN) is not None
    assert config.linear_method("model.layers.1.mlp.down_proj", ["model.layers.1.mlp.down_proj"]) is None
    qc["config_groups"]["group_0"]["targets"] = [r"re:.*q_proj$"]  # q quantized, k/v not: cannot pack
    with pytest.raises(ValueError, match="different schemes"):
        detect(_hf(qc)).linear_method(*QKV)


def test_weight_only_scheme():
    qc = copy.deepcopy(CT_INT8_W8A8)
    qc["config_groups"]["group_0"]["input_activations"] = None  # W8A16
    method = detect(_hf(qc)).linear_method(*DOWN)
    assert method.qdtype == torch.int8 and not method.quantize_activations


def test_requested_quantization_must_match_the_checkpoint():
    assert resolve_quantization("fp8", _hf(CT_FP8_DYNAMIC)).name == "compressed-tensors"
    assert resolve_quantization("compressed-tensors", _hf(CT_FP8_DYNAMIC)).name == "compressed-tensors"
    with pytest.raises(ValueError, match="already quantized"):
        resolve_quantization("int8", _hf(QWEN_FP8_BLOCK))
    with pytest.raises(ValueError, match="needs a checkpoint already quantized.*fp8, int4, int8"):
        resolve_quantization("compressed-tensors", _hf())


def _ct_group(weights, activations=None, fmt="pack-quantized", **extra):
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}
        },
        **extra,
    }


INT4_WEIGHTS = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}
INT8_ASYM = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": False}
FP8_CHANNEL = CT_FP8_DYNAMIC["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
    "qc,message",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'.*load_in_4bit"),
        (_ct_group(INT4_WEIGHTS), "format 'pack-quantized'.*\"num_bits\": 4.*8-bit fp8/int8 schemes only"),
        (_ct_group(INT8_ASYM, fmt="int-quantized"), "asymmetric"),
        (_ct_group(FP8_CHANNEL, fmt="float-quantized", kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
        (_ct_group(FP8_CHANNEL, fmt="float-quantized", sparsity_config={"format": "sparse-24"}), "sparsity"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "e4m3"),
    ],
)
def test_unsupported_checkpoints_say_what_they_are(qc, message):
    with pytest.raises(ValueError, match=message):
        detect(_hf(qc))


def test_engine_config_names():
    assert EngineConfig(quantization="fp8").quantization == "fp8"
    assert EngineConfig(quantization="none").quantization is None
    with pytest.raises(
        ValueError, match="unknown quantization 'fp4'.*awq, compressed-tensors, fp8, gguf, gptq, int4, int8"
    ):
        EngineConfig(quantization="fp4")


def test_cli_flag(capsys):
    args = build_parser().parse_args(["generate", "some/model", "--quantization", "int8"])
    assert engine_config_from_args(args).quantization == "int8"
    args = build_parser().parse_args(["serve", "--quantization", "fp8"])
    assert engine_config_from_args(args).quantization == "fp8"
    with pytest.raises(SystemExit):
        main(["generate", "--quantization", "fp4"])
    assert "invalid choice: 'fp4'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--quantization" in capsys.readouterr().out


def test_cli_generates_with_quantization(tiny_qwen2_dir, capsys):
    args = ["generate", tiny_qwen2_dir, "--prompt", "hello", "--max-tokens", "4", "--quantization", "fp8"]
    args += ["--num-gpu-blocks-override", "64", "--max-model-len", "256"]
    assert main(args) == 0
    assert "4 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("mode,warned", [("fp8", True), ("int8", False), (None, False)])
def test_fp8_on_a_cpu_says_it_is_slow(tiny_qwen2_dir, caplog, mode, warned):
    """fp8 weights have no CPU kernel (each matmul converts every code): the load says so, once."""
    from qwick import LLM

    with caplog.at_level("WARNING", logger="qwick.quantization.base"):
        LLM(tiny_qwen2_dir, quantization=mode, num_gpu_blocks_override=16, max_model_len=64)
    messages = [r.getMessage() for r in caplog.records if "no CPU kernel" in r.getMessage()]
    assert len(messages) == (1 if warned else 0)
    if warned:
        assert messages[0].startswith("9 linear layers hold fp8 weights")  # the LM head's too
