"""8-bit checkpoints in the layouts real ones ship in (compressed-tensors fp8/int8 per channel, Qwen and
compressed-tensors 128x128 block fp8, per-tensor fp8 with static input scales), and `quantization="fp8"` /
`"int8"` on an unquantized checkpoint: qwick's CPU reference path against transformers on the dequantized
weights.

The tight check gives transformers the same per-token activation quantization (forward pre-hooks that
quantize-dequantize every linear input): both then compute one function, so in float32 the logits of every
step agree to 1e-4 and greedy tokens are equal. The loose check is against the plain dequantized model:
what W8A8's activation rounding costs on these random tiny models (relative logit error below 15% for
fp8, whose e4m3 values carry 3 mantissa bits, and 5% for int8; measured 3-10% and 2%).
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from qwick import LLM, SamplingParams
from tests.models.test_decoder_matches_transformers import LogitsRecorder
from tests.quantization.checkpoints import (
    FORMATS,
    FP8,
    activation_group,
    add_activation_fake_quant,
    fp8_per_channel,
    int8_per_channel,
    write_quantized_checkpoint,
)
from tests.utils import hf_greedy, hf_logits, make_tiny_model

# Block-wise checkpoints need packed shards of whole 128-row blocks (as in every real model): q 256,
# k/v 128, gate/up 384 rows. hidden 320 leaves partial blocks along K (qkv, gate/up) and N (o, down).
BLOCK_SHAPES = dict(
    hidden_size=320, intermediate_size=384, num_attention_heads=2, num_key_value_heads=1, head_dim=128
)
PROMPTS = [
    list(range(10, 13)),
    [(7 * i) % 300 + 5 for i in range(37)],
    [(3 * i + 1) % 300 + 5 for i in range(17)],
]
MAX_TOKENS = 10
LOOSE_BOUND = {FP8: 0.15, torch.int8: 0.05}  # relative logit error against the plain dequantized model
SCALE_NAMES = {
    "ct-fp8-channel": "weight_scale",
    "ct-int8-channel": "weight_scale",
    "qwen-fp8-block": "weight_scale_inv",
    "ct-fp8-block": "weight_scale",
    "fp8-per-tensor-static": "weight_scale",
}


def _llm(path: str, dtype: str = "float32", **kwargs) -> LLM:
    return LLM(path, dtype=dtype, num_gpu_blocks_override=128, block_size=4, max_model_len=256, **kwargs)


def _qdtype(fmt: str) -> torch.dtype:
    return torch.int8 if "int8" in fmt else FP8


@pytest.fixture(scope="module", params=list(FORMATS))
def checkpoint(request, tmp_path_factory):
    """(format, checkpoint dir, transformers on the dequantized weights, the same with W8A8 activations)."""
    fmt = request.param
    path = str(tmp_path_factory.mktemp(fmt))
    block = fmt.endswith("block")
    hf = make_tiny_model("qwen3" if block else "qwen2", path, **(BLOCK_SHAPES if block else {}))
    hf.load_state_dict(write_quantized_checkpoint(hf, path, fmt))
    hf_w8a8 = copy.deepcopy(hf)
    add_activation_fake_quant(hf_w8a8, _qdtype(fmt), activation_group(fmt))
    return fmt, path, hf, hf_w8a8


def run_and_compare(llm: LLM, hf_w8a8, hf_plain=None) -> float:
    """Greedy tokens and every step's logits against transformers with W8A8 activations (tight); returns the
    worst relative logit error against the plain dequantized model."""
    recorder = LogitsRecorder(llm)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    worst = 0.0
    for prompt, out in zip(PROMPTS, outputs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(hf_w8a8, prompt, MAX_TOKENS), f"greedy tokens differ for {prompt[:4]}"
        ours = torch.stack(recorder.by_request[out.request_id]).cpu()
        steps = slice(len(prompt) - 1, len(prompt) - 1 + MAX_TOKENS)
        torch.testing.assert_close(ours, hf_logits(hf_w8a8, prompt + tokens)[steps], atol=1e-4, rtol=0)
        if hf_plain is not None:
            ref = hf_logits(hf_plain, prompt + tokens)[steps]
            worst = max(worst, ((ours - ref).norm() / ref.norm()).item())
    return worst


def test_format_is_detected(checkpoint):
    fmt, path, _, _ = checkpoint
    model = _llm(path).llm_engine.core.runner.model
    expected = "compressed-tensors" if fmt.startswith("ct-") else "fp8"
    assert model.quant_config.name == expected
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.method.quantized and qkv.weight.dtype == _qdtype(fmt)
    assert qkv.method.block == ((128, 128) if fmt.endswith("block") else None)
    head = model.lm_head or model.model.embed_tokens
    assert head.weight.dtype == torch.float32  # the LM head and embeddings stay unquantized


def test_scales_are_packed_by_shard(checkpoint):
    """q/k/v and gate/up scales land in their shard's rows (row blocks for block scales); per-tensor scales
    fill their shard's rows."""
    fmt, path, _, _ = checkpoint
    model = _llm(path).llm_engine.core.runner.model
    tensors = load_file(f"{path}/model.safetensors")
    name = SCALE_NAMES[fmt]
    for module, parts in (("self_attn.qkv_proj", "qkv"), ("mlp.gate_up_proj", ("gate", "up"))):
        layer = model.get_submodule(f"model.layers.1.{module}")
        prefix = f"model.layers.1.{module.split('.')[0]}"
        expected, codes = [], []
        for part, rows in zip(parts, layer.output_sizes):
            scale = tensors[f"{prefix}.{part}_proj.{name}"].float()
            expected.append(
                scale.reshape(1, 1).expand(rows, 1)
                if scale.numel() == 1
                else scale.reshape(-1, scale.shape[-1])
            )
            codes.append(tensors[f"{prefix}.{part}_proj.weight"])
        assert torch.equal(getattr(layer, name), torch.cat(expected))
        assert torch.equal(layer.weight.view(torch.uint8), torch.cat(codes).view(torch.uint8))


def test_logits_match_transformers(checkpoint):
    fmt, path, hf, hf_w8a8 = checkpoint
    worst = run_and_compare(_llm(path), hf_w8a8, hf)
    bound = LOOSE_BOUND[_qdtype(fmt)]
    assert worst < bound, f"W8A8 moved the logits by {worst:.1%} against the dequantized weights"


def test_bfloat16_reference_path(checkpoint):
    """The CPU default dtype runs every format. bf16 activations round differently before they are quantized,
    which flips some 8-bit codes, so on these random models the logits move by up to ~12% (block fp8; 1.6%
    unquantized); the layer tests check the bf16 matmul itself tightly."""
    _, path, _, hf_w8a8 = checkpoint
    llm = _llm(path, "bfloat16")
    recorder = LogitsRecorder(llm)
    prompt = PROMPTS[1]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    ours = torch.stack(recorder.by_request[out[0].request_id]).float()
    ref = hf_logits(hf_w8a8, prompt + out[0].outputs[0].token_ids)[len(prompt) - 1 : len(prompt) + 3]
    assert ((ours - ref).norm() / ref.norm()).item() < 0.2


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_on_the_fly_quantization_matches_transformers(mode, tmp_path):
    """`quantization="fp8"/"int8"` on an fp32 checkpoint: per-channel absmax weights, per-token
    activations."""
    path = str(tmp_path / "plain")
    hf = make_tiny_model("qwen2", path)
    quantize = fp8_per_channel if mode == "fp8" else int8_per_channel
    state = hf.state_dict()
    for name, tensor in state.items():
        if name.endswith("_proj.weight"):
            q, s = quantize(tensor, torch.float32)
            state[name] = q.float() * s
    hf.load_state_dict(state)
    hf_w8a8 = copy.deepcopy(hf)
    add_activation_fake_quant(hf_w8a8, _qdtype(mode))
    llm = _llm(path, quantization=mode, quantize_lm_head=False)  # the head's: test_lm_head.py
    layer = llm.llm_engine.core.runner.model.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == _qdtype(mode) and layer.weight_scale.shape == (64, 1)
    worst = run_and_compare(llm, hf_w8a8, hf)
    assert worst < LOOSE_BOUND[_qdtype(mode)]


def test_export_gives_transformers_the_dequantized_weights(checkpoint):
    """`checkpoint_tensors` (what `--compare-transformers` runs on) dequantizes and leaves scales out."""
    _, path, hf, _ = checkpoint
    model = _llm(path).llm_engine.core.runner.model
    exported = dict(model.checkpoint_tensors())
    expected = {
        n: t for n, t in hf.state_dict().items() if n != "lm_head.weight" or not model.tie_word_embeddings
    }
    assert set(exported) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name].float(), tensor, atol=0, rtol=1e-6, msg=name)


def test_dummy_weights_of_a_quantized_checkpoint(checkpoint):
    """`load_format="dummy"` on a quantized config: random weights go through the format's quantization."""
    fmt, path, _, _ = checkpoint
    llm = _llm(path, load_format="dummy")
    layer = llm.llm_engine.core.runner.model.model.layers[0].mlp.gate_up_proj
    scale = getattr(layer, SCALE_NAMES[fmt])
    assert layer.weight.dtype == _qdtype(fmt) and layer.weight.float().abs().max() > 100
    assert (scale > 0).all() and torch.isfinite(scale).all()
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_dummy_weights_quantized_on_the_fly_are_the_unquantized_ones(tiny_qwen2_dir):
    """One seed gives a bf16 and an fp8 model the same random weights (up to fp8 rounding), so their outputs
    can be compared on machines with no checkpoint."""
    plain = _llm(tiny_qwen2_dir, load_format="dummy").llm_engine.core.runner.model
    fp8 = _llm(tiny_qwen2_dir, load_format="dummy", quantization="fp8").llm_engine.core.runner.model
    w = plain.model.layers[1].self_attn.qkv_proj.weight
    layer = fp8.model.layers[1].self_attn.qkv_proj
    assert layer.weight.dtype == FP8
    deq = layer.method.dense_weight(layer)
    assert ((deq - w).abs() <= w.abs() * 2**-4 + layer.weight_scale * 2**-10 + 1e-9).all()
