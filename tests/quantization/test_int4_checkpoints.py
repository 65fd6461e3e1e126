"""AWQ ("gemm") and GPTQ (v1/v2, sym/asym, desc_act) checkpoints on qwick's CPU reference path
(dequantize, then matmul) against transformers run on the weights the checkpoint dequantizes to.

Dequantization is exact (fp16 scales, 4-bit codes) and activations stay unquantized, so in float32 both
compute the same function: every step's logits agree to 1e-4 and greedy tokens are equal.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from qwick import LLM, SamplingParams
from tests.models.test_decoder_matches_transformers import LogitsRecorder, check_against_reference
from tests.quantization.formats.checkpoints import (
    QUANTIZABLE_DIMS,
    build_awq_checkpoint,
    build_gptq_checkpoint,
)
from tests.utils import hf_logits, make_tiny_model

PROMPTS = [
    list(range(10, 13)),
    [(7 * i) % 300 + 5 for i in range(37)],
    [(3 * i + 1) % 300 + 5 for i in range(17)],
]
MAX_TOKENS = 10
VARIANTS = {
    "awq": lambda src, dst: build_awq_checkpoint(src, dst),
    "gptq-v1-sym": lambda src, dst: build_gptq_checkpoint(src, dst),
    "gptq-v1-desc-act": lambda src, dst: build_gptq_checkpoint(src, dst, desc_act=True),
    "gptq-v2-asym": lambda src, dst: build_gptq_checkpoint(src, dst, sym=False, v2=True),
}


def _llm(path: str, dtype: str = "float32", **kwargs) -> LLM:
    return LLM(path, dtype=dtype, num_gpu_blocks_override=128, block_size=4, max_model_len=256, **kwargs)


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    """(variant, checkpoint dir, transformers on the dequantized weights)."""
    variant = request.param
    src = str(tmp_path_factory.mktemp(f"{variant}-src"))
    dst = str(tmp_path_factory.mktemp(variant))
    hf = make_tiny_model("qwen2", src, **QUANTIZABLE_DIMS)
    reference = VARIANTS[variant](src, dst)
    missing, unexpected = hf.load_state_dict(reference, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return variant, dst, hf


def test_format_is_detected(checkpoint):
    variant, path, _ = checkpoint
    model = _llm(path).llm_engine.core.runner.model
    assert model.quant_config.name == variant.split("-")[0]
    for module in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        layer = model.get_submodule(f"model.layers.0.{module}")
        assert layer.method.quantized
        assert layer.weight.dtype == torch.int32 and layer.weight.shape[1] * 8 == layer.input_size
        assert not hasattr(layer, "qweight") and not hasattr(layer, "qzeros")  # checkpoint layout freed
        assert (layer.perm is not None) == (variant == "gptq-v1-desc-act")
    head = model.lm_head or model.model.embed_tokens
    assert head.weight.dtype == torch.float32


def test_logits_match_transformers(checkpoint):
    _, path, hf = checkpoint
    llm = _llm(path)
    check_against_reference(llm, hf, PROMPTS, MAX_TOKENS)


def test_export_gives_transformers_the_dequantized_weights(checkpoint):
    _, path, hf = checkpoint
    model = _llm(path).llm_engine.core.runner.model
    exported = dict(model.checkpoint_tensors())
    expected = {
        n: t for n, t in hf.state_dict().items() if n != "lm_head.weight" or not model.tie_word_embeddings
    }
    assert set(exported) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name].float(), tensor, atol=0, rtol=0, msg=name)


def test_bfloat16_reference_path(checkpoint):
    _, path, hf = checkpoint
    llm = _llm(path, "bfloat16")
    recorder = LogitsRecorder(llm)
    prompt = PROMPTS[1]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    ours = torch.stack(recorder.by_request[out[0].request_id]).float()
    ref = hf_logits(hf, prompt + out[0].outputs[0].token_ids)[len(prompt) - 1 : len(prompt) + 3]
    assert ((ours - ref).norm() / ref.norm()).item() < 0.05


def _rewrite_quant_config(path: str, **changes) -> None:
    config_path = os.path.join(path, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"].update(changes)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("gptq-err-src"))
    make_tiny_model("qwen2", src, **QUANTIZABLE_DIMS)
    return src


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"bits": 8}, "bits=8.*4-bit"),
        ({"bits": 3}, "bits=3.*4-bit"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"quant_method": "hqq"}, "quant_method='hqq'.*cannot load"),
    ],
)
def test_unsupported_configs_are_clear_errors(gptq_dir, tmp_path, changes, message):
    dst = str(tmp_path / "ckpt")
    build_gptq_checkpoint(gptq_dir, dst)
    _rewrite_quant_config(dst, **changes)
    with pytest.raises(ValueError, match=message):
        _llm(dst)


def test_awq_rejects_other_bit_widths_and_versions(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "awq")
    make_tiny_model("qwen2", src, **QUANTIZABLE_DIMS)
    build_awq_checkpoint(src, dst)
    _rewrite_quant_config(dst, bits=8)
    with pytest.raises(ValueError, match="bits=8.*4-bit"):
        _llm(dst)
    _rewrite_quant_config(dst, bits=4, version="gemv")
    with pytest.raises(ValueError, match="'gemm'"):
        _llm(dst)


def test_awq_and_gptq_are_registered():
    from qwick.quantization.base import checkpoint_names

    assert {"awq", "gptq"} <= set(checkpoint_names())
