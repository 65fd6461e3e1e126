"""`quantize_lm_head`: the on-the-fly modes (fp8, int8, int4) quantize the LM head too, in untied and tied
models (a tied head becomes its own quantized copy of the embedding, which stays as it was), and the option
is refused where it cannot apply. Left unset, int4 makes the head int8 (W8A8) instead of int4 ("int4-head8").
(GGUF's kept head blocks: tests/quantization/test_gguf_kept_quantized.py.)

The oracle is transformers on the weights qwick holds, dequantized (`checkpoint_tensors`, with the tied
head untied into its own matrix), with the 8-bit modes' per-token activation rounding applied to every
linear input, the LM head's included. For int4 (no activation rounding) every step's logits agree to 1e-4.
With 8-bit activations, float32 rounding differences of ~1e-7 between the two can move an activation across
a code boundary and a logit by ~0.02, so there the model is held to greedy tokens, and the head itself, on
the hidden states it was given while generating, to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, Qwen2ForCausalLM

from qwick import LLM, SamplingParams
from qwick.config import EngineConfig
from qwick.quantization.fp8 import Fp8Config
from tests.models.test_decoder_matches_transformers import check_against_reference
from tests.quantization.checkpoints import (
    FP8,
    add_activation_fake_quant,
    fake_quant_activations,
    write_quantized_checkpoint,
)
from tests.utils import hf_greedy, make_tiny_model

PROMPTS = [list(range(10, 13)), [(7 * i) % 300 + 5 for i in range(23)]]
# case -> (quantization, quantize_lm_head, the head's stored weight dtype)
CASES = {
    "fp8": ("fp8", True, FP8),
    "int8": ("int8", True, torch.int8),
    "int4": ("int4", True, torch.int32),
    "int4-head8": ("int4", None, torch.int8),  # int4's default head
}
CODES = {"fp8": FP8, "int8": torch.int8, "int4": None}  # the activation codes of each mode's body
# Relative error of the head's dequantized weight against the embedding it came from (random weights of
# std 0.08): e4m3 keeps 3 mantissa bits, int8 per channel ~7, int4 RTN in groups of 128 ~3.
HEAD_ERROR = {FP8: (0.01, 0.06), torch.int8: (1e-4, 0.01), torch.int32: (0.02, 0.15)}


def _tiny(tmp_path, tied: bool) -> str:
    """A tiny Qwen2 checkpoint whose hidden size (the head's K) is one whole int4 group."""
    path = str(tmp_path / "model")
    make_tiny_model("qwen2", path, tie_word_embeddings=tied, hidden_size=128)
    return path


def _llm(path: str, mode: str | None, lm_head: bool | None = True) -> LLM:
    return LLM(
        path,
        dtype="float32",
        num_gpu_blocks_override=64,
        block_size=4,
        max_model_len=128,
        quantization=mode,
        quantize_lm_head=lm_head,
    )


def _reference(model, path: str, mode: str, head_codes: torch.dtype) -> Qwen2ForCausalLM:
    """transformers on `model`'s dequantized weights, the head untied, activations rounded as qwick does:
    every linear input in the 8-bit modes (W8A8), the head's where it is 8-bit."""
    state = {name: t.float().cpu() for name, t in model.checkpoint_tensors()}
    state["lm_head.weight"] = model.lm_head.method.dense_weight(model.lm_head).float().cpu()
    config = AutoConfig.from_pretrained(path)
    config.tie_word_embeddings = False
    hf = Qwen2ForCausalLM(config).eval()
    hf.load_state_dict(state)
    if CODES[mode] is not None:
        add_activation_fake_quant(hf, CODES[mode])
    if head_codes != torch.int32:
        hf.lm_head.register_forward_pre_hook(
            lambda _m, args: (fake_quant_activations(args[0], head_codes, None),)
        )
    return hf


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("case", list(CASES))
def test_quantized_lm_head_matches_transformers(case, tied, tmp_path):
    mode, lm_head, head_codes = CASES[case]
    path = _tiny(tmp_path, tied)
    checkpoint = load_file(f"{path}/model.safetensors")
    llm = _llm(path, mode, lm_head)
    model = llm.llm_engine.core.runner.model
    head = model.lm_head
    assert head is not None and head.method.quantized and head.weight.dtype == head_codes
    # The embedding lookups keep the checkpoint's values; the head holds their (or its own) quantized copy.
    embed = checkpoint["model.embed_tokens.weight"]
    assert torch.equal(model.model.embed_tokens.weight.cpu(), embed)
    source = embed if tied else checkpoint["lm_head.weight"]
    error = (head.method.dense_weight(head).float().cpu() - source).norm() / source.norm()
    low, high = HEAD_ERROR[head_codes]
    assert low < error.item() < high, f"the head's weight is {error:.2%} off the matrix it quantizes"
    reference = _reference(model, path, mode, head_codes)
    if head_codes == torch.int32:  # no activation rounding anywhere
        check_against_reference(llm, reference, PROMPTS, max_tokens=8)
        return
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: seen.append((hidden.clone(), compute_logits(hidden))) or seen[-1][1]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 8)
    for hidden, logits in seen:
        expected = reference.lm_head(hidden.float())  # the hook rounds the activations as W8A8 does
        torch.testing.assert_close(logits.float(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_head_stays_unquantized_by_default(tied, tmp_path):
    path = _tiny(tmp_path, tied)
    model = _llm(path, "int8", lm_head=False).llm_engine.core.runner.model
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    if tied:  # the embedding itself serves as the head
        assert model.lm_head is None and model.model.embed_tokens.weight.dtype == torch.float32
    else:
        assert not model.lm_head.method.quantized and model.lm_head.weight.dtype == torch.float32


def test_quantize_lm_head_is_refused_where_it_cannot_apply(tiny_qwen2_dir, tmp_path):
    with pytest.raises(ValueError, match="quantize_lm_head needs quantization="):  # before any loading
        EngineConfig(model=tiny_qwen2_dir, quantize_lm_head=True)
    path = str(tmp_path / "fp8-checkpoint")
    write_quantized_checkpoint(make_tiny_model("qwen2", path), path, "ct-fp8-channel")
    with pytest.raises(ValueError, match="applies to quantization=.*compressed-tensors"):
        _llm(path, "fp8")  # a quantized checkpoint keeps its head as it ships
    assert Fp8Config.for_unquantized_checkpoint().can_quantize_lm_head  # fp8 on the fly: yes
    assert not Fp8Config(checkpoint=True).can_quantize_lm_head  # an fp8 checkpoint's config: no


# On the GPU in float32 (every step W8A8, as in tests/quantization/test_w8a8_gpu.py, CUDA graphs on):
# (relative logit bound, least greedy agreement) against the same oracle. fp8's tensor cores accumulate
# below fp32 precision, which flips downstream activation codes in these tiny random models; with the head
# an fp8 matmul too, the logits were 5.1-5.2% off on the H200 (2026-12-01), against 1.8-3.1% for the same
# models with a float head (tests/quantization/test_w8a8_gpu.py).
GPU_CASES = {"fp8": (0.08, 0.6), "int8": (0.01, 1.0), "int4": (0.01, 0.9), "int4-head8": (0.01, 0.9)}


@pytest.mark.gpu
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_quantized_lm_head_on_gpu(case, tied, tmp_path):
    from tests.models.test_decoder_matches_transformers import LogitsRecorder
    from tests.utils import hf_logits

    mode, lm_head, head_codes = CASES[case]
    path = _tiny(tmp_path, tied)
    llm = _llm(path, mode, lm_head)
    runner = llm.llm_engine.core.runner
    head = runner.model.lm_head
    assert runner.device.type == "cuda" and head.method.quantized and head.weight.dtype == head_codes
    reference = _reference(runner.model, path, mode, head_codes)
    bound, least_agreement = GPU_CASES[case]
    recorder = LogitsRecorder(llm)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    agree = 0
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        tokens = out.outputs[0].token_ids
        ours = torch.stack(recorder.by_request[out.request_id]).double().cpu()
        ref = hf_logits(reference, prompt + tokens)[len(prompt) - 1 : len(prompt) + 9].double()
        rel = ((ours - ref).norm() / ref.norm()).item()
        assert rel < bound, f"{case}: logits off by {rel:.2%}"
        agree += sum(a == b for a, b in zip(tokens, hf_greedy(reference, prompt, 10)))
    assert runner.num_graph_replays > 0
    assert agree >= least_agreement * 10 * len(PROMPTS), f"greedy tokens agree at {agree} steps"
