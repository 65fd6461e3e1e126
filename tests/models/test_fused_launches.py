"""The decoder's fused-launch hooks (`Linear.normed`, `Linear.gated`): where a linear method runs the norm
after a projection, or SiLU-and-mul, in the projection's own launch, the decoder must hand it the right
norm, residual and next layer, skip the norm it ran, and give the same model.

The GPU kernels behind them (int4's `w4_half2_normed` and `w4_half2_gated`) are tested in
tests/kernels/test_row_gemv.py and tests/quantization/test_int4_on_the_fly.py. Here, on the CPU, every
linear method is given PyTorch versions of the two hooks with the arithmetic of the separate layers, so the
fused model must produce the same tokens and log-probabilities bit for bit, and the hooks must have run for
every o and down projection (the last down one with the model's final norm) and every gate/up one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwick import LLM, SamplingParams
from qwick.layers.linear import LinearMethod, NormAfter
from qwick.layers.norm import RMSNorm
from tests.utils import make_tiny_model

LAYERS = 2


def _norm(norm: NormAfter, y: torch.Tensor) -> torch.Tensor:
    """What `RMSNorm.forward_native(y, residual)` computes, with `norm.residual` updated in place."""
    h = y + norm.residual
    norm.residual.copy_(h)
    ref = RMSNorm(h.shape[-1], norm.eps)
    ref.weight.data = norm.weight
    return ref.forward_native(h)


def _run(path: str) -> tuple[list[int], list[float]]:
    llm = LLM(path, dtype="float32", max_model_len=128, num_gpu_blocks_override=64, block_size=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    out = llm.generate([list(range(5, 30)), [7, 8, 9]], params, use_tqdm=False)
    return [t for o in out for t in o.outputs[0].token_ids], [
        lp.logprob for o in out for step in o.outputs[0].logprobs for lp in step.values()
    ]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("fused") / "m")
    make_tiny_model("qwen2", path, num_hidden_layers=LAYERS)
    return path


def test_fused_norms_and_gate_give_the_same_model(tiny_path, monkeypatch):
    plain = _run(tiny_path)
    calls = []

    def normed(self, layer, x, norm):
        calls.append("normed")
        return _norm(norm, self.apply(layer, x))

    def gated(self, layer, x, quant):
        calls.append("gated")
        gate, up = self.apply(layer, x).chunk(2, dim=-1)
        return F.silu(gate) * up

    monkeypatch.setattr(LinearMethod, "apply_normed", normed)
    monkeypatch.setattr(LinearMethod, "apply_gated", gated)
    fused = _run(tiny_path)
    assert fused == plain
    # Per forward and layer: gate/up gated, o and down normed.
    forwards = calls.count("gated") // LAYERS
    assert forwards > 0 and calls.count("normed") == 2 * forwards * LAYERS


def test_fused_hooks_get_the_layers_norms(tiny_path, monkeypatch):
    """The norm each hook is handed: the o projection its layer's post-attention norm, the down projection
    the next layer's input norm, the last layer's down projection the model's final norm."""
    llm = LLM(tiny_path, dtype="float32", max_model_len=128, num_gpu_blocks_override=64, block_size=4)
    model = llm.llm_engine.core.runner.model.model
    seen = []

    def normed(self, layer, x, norm):
        seen.append((layer, norm.weight))
        return _norm(norm, self.apply(layer, x))

    monkeypatch.setattr(LinearMethod, "apply_normed", normed)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1), use_tqdm=False)
    layers = model.layers
    want = []
    for i, layer in enumerate(layers):
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        want += [
            (layer.self_attn.o_proj, layer.post_attention_layernorm.weight),
            (layer.mlp.down_proj, nxt.weight),
        ]
    assert [(a is b, c is d) for (a, c), (b, d) in zip(seen, want, strict=True)] == [(True, True)] * len(want)


@pytest.mark.gpu
def test_bf16_gated_decode_gives_the_same_tokens(tiny_path, monkeypatch):
    """On a GPU, `CudaLinearMethod.gated_decode` on: bf16 decode steps of 1-2 rows run SiLU-and-mul in
    the gate/up skinny GEMM's epilogue (`gemv(..., gated=True)`), the same bits as the separate launch,
    so the same greedy tokens (CUDA graphs on); and the gated launch is what ran."""
    from qwick.kernels import gemv as g
    from qwick.layers.linear import CudaLinearMethod

    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    real = g.gemv
    gated_rows = []
    monkeypatch.setattr(
        g,
        "gemv",
        lambda x, *a, gated=False, **k: (
            (gated and gated_rows.append(x.shape[0])) or real(x, *a, gated=gated, **k)
        ),
    )
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(CudaLinearMethod, "gated_decode", on)
        llm = LLM(tiny_path, dtype="bfloat16", max_model_len=128, num_gpu_blocks_override=64)
        out = llm.generate([list(range(5, 30)), [7, 8, 9]], params, use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in out])
        del llm
    assert outs[0] == outs[1]
    assert gated_rows and set(gated_rows) <= set(range(1, 17))


def test_only_the_qkv_projections_precede_attention(tiny_path):
    """`Linear.precedes_attention` (a one-row QKV GEMV may let decode attention in at its start,
    `pdl_qkv_start`): set on every layer's QKV projection and on no other linear layer (the LM head too)."""
    from qwick.layers.linear import Linear

    llm = LLM(tiny_path, dtype="float32", max_model_len=128, num_gpu_blocks_override=64, block_size=4)
    marked = {
        name
        for name, m in llm.llm_engine.core.runner.model.named_modules()
        if isinstance(m, Linear) and m.precedes_attention
    }
    assert marked == {f"model.layers.{i}.self_attn.qkv_proj" for i in range(LAYERS)}
