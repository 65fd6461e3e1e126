"""Quantized models on the GPU (CUDA graphs on): W8A8 checkpoints and on-the-fly fp8/int8, against
transformers on the dequantized weights with the same per-token activation quantization, in float32.

In float32 every step is W8A8 (the W8A16 decode GEMM serves bf16/fp16 models): int8 through `_int_mm`
(exact int32 sums, zero rows padded at decode sizes) and block fp8 through its Triton GEMM compute the
reference function up to float32 rounding, so greedy tokens are equal and logits within 1%. Per-channel fp8
goes through `_scaled_mm` with fp32 output (unit scales; the per-token and per-channel scales applied
after): logits within 5% (1.8-3.1% measured on the H200; 5.8% and 7.2% when row-wise `_scaled_mm`
wrote bf16), and two thirds of greedy tokens agree. These tiny random models are hypersensitive:
rounding each fp8 matmul's output to bf16 drops greedy agreement with the reference from 30/30 to 10/30
tokens in a CPU emulation, so small differences in the fp8 sums flip activation codes downstream.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from qwick import LLM, SamplingParams
from tests.models.test_decoder_matches_transformers import LogitsRecorder
from tests.quantization.checkpoints import (
    FP8,
    activation_group,
    add_activation_fake_quant,
    fp8_per_channel,
    int8_per_channel,
    write_quantized_checkpoint,
)
from tests.quantization.test_w8a8_checkpoints import BLOCK_SHAPES, PROMPTS
from tests.utils import hf_greedy, hf_logits, make_tiny_model

pytestmark = pytest.mark.gpu
MAX_TOKENS = 10
# name (checkpoint format or on-the-fly mode): (logits bound, greedy must be equal, least greedy agreement).
# Per-channel fp8 on the H200: 20 of 30 greedy tokens agree (2026-12-01, synchronous and async scheduling
# alike), logits 1.8-3.1% off over five runs, varying with how steps batch rows (cuBLAS picks its fp8 kernel
# by shape): Hopper's fp8 tensor cores accumulate partial sums below fp32 precision even with
# use_fast_accum=False, enough to flip a downstream activation code in these models.
CASES = {
    "ct-fp8-channel": (0.05, False, 0.6),
    "ct-int8-channel": (0.01, True, 1.0),
    "qwen-fp8-block": (0.01, True, 1.0),
    "fp8": (0.05, False, 0.6),
    "int8": (0.01, True, 1.0),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    name = request.param
    path = str(tmp_path_factory.mktemp(name))
    block = name.endswith("block")
    hf = make_tiny_model("qwen3" if block else "qwen2", path, **(BLOCK_SHAPES if block else {}))
    qdtype = torch.int8 if "int8" in name else FP8
    if name in ("fp8", "int8"):
        quantize = fp8_per_channel if name == "fp8" else int8_per_channel
        state = hf.state_dict()
        for key, tensor in state.items():
            if key.endswith("_proj.weight"):
                q, s = quantize(tensor, torch.float32)
                state[key] = q.float() * s
        hf.load_state_dict(state)
        kwargs = {"quantization": name, "quantize_lm_head": False}  # the head's: test_lm_head.py
    else:
        hf.load_state_dict(write_quantized_checkpoint(hf, path, name))
        kwargs = {}
    add_activation_fake_quant(hf, qdtype, activation_group(name))
    return name, path, hf, kwargs  # the reference runs on the CPU


def test_quantized_model_on_gpu(case):
    name, path, hf, kwargs = case
    bound, exact_greedy, least_agreement = CASES[name]
    llm = LLM(path, dtype="float32", num_gpu_blocks_override=128, block_size=4, max_model_len=256, **kwargs)
    runner = llm.llm_engine.core.runner
    assert runner.device.type == "cuda" and runner.graph_runner is not None  # captured with quantized layers
    recorder = LogitsRecorder(llm)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert runner.num_graph_replays > 0
    agree = total = 0
    for prompt, out in zip(PROMPTS, outputs):
        tokens = out.outputs[0].token_ids
        ours = torch.stack(recorder.by_request[out.request_id]).double().cpu()
        steps = slice(len(prompt) - 1, len(prompt) - 1 + MAX_TOKENS)
        ref = hf_logits(hf, prompt + tokens)[steps].double()
        rel = ((ours - ref).norm() / ref.norm()).item()
        assert rel < bound, f"{name}: logits off by {rel:.2%}"
        expected = hf_greedy(hf, prompt, MAX_TOKENS)
        if exact_greedy:
            assert tokens == expected
        agree += sum(a == b for a, b in zip(tokens, expected))
        total += MAX_TOKENS
    assert agree >= least_agreement * total, f"{name}: greedy tokens agree at {agree} of {total} steps"


@pytest.mark.parametrize("mode", ["fp8", "int8"])
@pytest.mark.parametrize("grouped", [False, True])
def test_fused_activation_codes_change_nothing(mode, grouped, tmp_path, monkeypatch):
    """bf16 model, 40-token prompts (W8A8 prefill) and decode steps (W8A8 skinny GEMM where codes come):
    the norms and SiLU-and-mul write the projections' activation codes, and the logits are bit-identical
    to quantizing the same activations in a launch of its own. `grouped`: the tiny model's down projection
    counts as long (`decode_w8a8_max_k` below its 128 inputs), so decode steps take group-scaled codes."""
    from qwick.layers.linear import QuantizedRows
    from qwick.quantization.w8a8 import W8A8LinearMethod

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    make_tiny_model("qwen2", str(tmp_path))
    prompts = [list(range(3, 43)), list(range(50, 90))]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    rows_seen = []
    real = W8A8LinearMethod.apply_quantized

    def counted(self, layer, x):
        rows_seen.append(x.x.shape[0])
        return real(self, layer, x)

    def requantized(self, layer, x):  # the same activations, quantized by the separate kernel
        return real(self, layer, QuantizedRows(x.x, *self._quantize_x(x.x, x.group), x.group))

    def run():
        llm = LLM(
            str(tmp_path), dtype="bfloat16", quantization=mode, num_gpu_blocks_override=64, max_model_len=128
        )
        recorder = LogitsRecorder(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [torch.stack(recorder.by_request[o.request_id]) for o in outs]

    groups_seen = []

    def counted_groups(self, layer, x):
        groups_seen.append(x.group)
        return counted(self, layer, x)

    if grouped:
        monkeypatch.setattr(W8A8LinearMethod, "decode_w8a8_max_k", 64)
    monkeypatch.setattr(W8A8LinearMethod, "apply_quantized", counted_groups)
    fused = run()
    assert max(rows_seen) >= 40 and min(rows_seen) <= 2  # the prefill and the decode steps took codes
    assert (W8A8LinearMethod.decode_group in groups_seen) == grouped
    monkeypatch.setattr(W8A8LinearMethod, "apply_quantized", requantized)
    separate = run()
    for a, b in zip(fused, separate):
        assert torch.equal(a, b)


def _same_logits_with_switches(
    mode: str,
    tmp_path,
    monkeypatch,
    switch: Callable[[bool], None],
    marked: Callable[[dict], bool],
    backend_flag: str | None,
    **model_overrides,
) -> None:
    """A tiny bf16 model's decode logits (CUDA graphs on) with `switch(False)`, then `switch(True)`: the
    same bits; `marked(kwargs)` holds of some skinny-GEMM launch only in the second run, and the attention
    backend's `backend_flag` (if any) is on only then. `model_overrides`: the tiny model's config."""
    from qwick.kernels import gemv as gemv_module
    from qwick.kernels.pdl import pdl_supported

    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    assert pdl_supported(torch.device("cuda")), "the chain needs a GPU with programmatic dependent launch"
    make_tiny_model("qwen2", str(tmp_path), **model_overrides)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seen = []
    real = gemv_module.gemv

    def spy(*args, **kwargs):
        seen.append(marked(kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(gemv_module, "gemv", spy)
    logits = []
    for on in (False, True):
        switch(on)
        llm = LLM(
            str(tmp_path), dtype="bfloat16", quantization=mode, num_gpu_blocks_override=64, max_model_len=128
        )
        if backend_flag is not None:
            assert getattr(llm.llm_engine.core.runner.backend, backend_flag) is on
        recorder = LogitsRecorder(llm)
        out = llm.generate([list(range(3, 23))], params, use_tqdm=False)[0]
        logits.append(torch.stack(recorder.by_request[out.request_id]))
        del llm
        assert any(seen) is on
        seen.clear()
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_pdl_norm_changes_nothing(mode, tmp_path, monkeypatch):
    """`W8A8LinearMethod.pdl_norm` (on by default) against off: one decode row's W8A8 GEMVs launch early, each
    split's first weight tile loaded before they wait, and let the next kernel in after their loops; the
    input norms after the down projections and decode attention after QKV launch early too. bf16 model,
    CUDA graphs on: the same logits bit for bit as with it off, and the GEMVs did launch early with it."""
    from qwick.quantization.w8a8 import W8A8LinearMethod

    _same_logits_with_switches(
        mode,
        tmp_path,
        monkeypatch,
        lambda on: monkeypatch.setattr(W8A8LinearMethod, "pdl_norm", on),
        lambda kw: kw.get("preload", False) and kw.get("trigger", False),
        "pdl_early_decode",
    )


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_attention_preload_chain_changes_nothing(mode, tmp_path, monkeypatch):
    """`W8A8LinearMethod.pdl_qkv_start`, `DECODE_PRELOAD` and `DECODE_TRIGGER_LATE` off, then on: the QKV
    GEMV lets decode attention in at its start, the attention reads its first key tile before it waits and
    lets o in after. bf16 model, CUDA graphs on: the same logits bit for bit, and the QKV GEMVs did
    trigger at their start in the second run."""
    from qwick.layers.attention import triton_backend
    from qwick.quantization.w8a8 import W8A8LinearMethod

    def switch(on: bool) -> None:
        monkeypatch.setattr(W8A8LinearMethod, "pdl_qkv_start", on)
        monkeypatch.setattr(triton_backend, "DECODE_PRELOAD", on)
        monkeypatch.setattr(triton_backend, "DECODE_TRIGGER_LATE", on)

    _same_logits_with_switches(
        mode, tmp_path, monkeypatch, switch, lambda kw: kw.get("trigger_at_start", False), "decode_preload"
    )


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_gated_decode_row_changes_nothing(mode, tmp_path, monkeypatch):
    """`W8A8LinearMethod.gated_decode` without, then with the mode's code type: one decode row's SiLU-and-mul
    in the W8A8 gate/up GEMV, whose last tile of each group writes the down projection's codes (on for int8
    by default, off for fp8). A tiny bf16 model with an intermediate size of 8192 (gate/up in one split),
    its down projection counted as long (group-scaled codes); CUDA graphs on. The same logits bit for bit,
    and the gated launch ran in the second run only."""
    from qwick.quantization.w8a8 import FP8_DTYPE, W8A8LinearMethod

    codes = frozenset({FP8_DTYPE if mode == "fp8" else torch.int8})
    monkeypatch.setattr(W8A8LinearMethod, "decode_w8a8_max_k", 4096)
    _same_logits_with_switches(
        mode,
        tmp_path,
        monkeypatch,
        lambda on: monkeypatch.setattr(W8A8LinearMethod, "gated_decode", codes if on else frozenset()),
        lambda kw: kw.get("gated", False) and kw.get("out_quant") is not None,
        None,
        intermediate_size=8192,
    )
