"""`quantization="int4"`: an fp32/bf16 checkpoint quantized while loading (round to nearest, group 128,
asymmetric), on qwick's CPU reference path against transformers run on the RTN-dequantized weights.

Dequantization is exact and activations stay unquantized, so in float32 both compute one function: every
step's logits agree to 1e-4 and the greedy tokens are equal.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import pytest
import torch

from qwick import LLM, SamplingParams
from qwick.config import EngineConfig
from qwick.entrypoints.cli import build_parser, engine_config_from_args
from qwick.layers.linear import Linear
from qwick.quantization.base import resolve_quantization, weight_bytes
from qwick.quantization.formats import rtn
from qwick.quantization.formats.layout import dequantize
from qwick.quantization.int4 import Int4Config, RtnInt4LinearMethod
from tests.models.test_decoder_matches_transformers import LogitsRecorder, check_against_reference
from tests.quantization.formats.checkpoints import QUANTIZABLE_DIMS, QUANTIZED_LINEARS, build_awq_checkpoint
from tests.utils import hf_greedy, hf_logits, make_tiny_model

PROMPTS = [
    list(range(10, 13)),
    [(7 * i) % 300 + 5 for i in range(37)],
    [(3 * i + 1) % 300 + 5 for i in range(17)],
]
MAX_TOKENS = 10
MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _llm(path: str, dtype: str = "float32", **kwargs) -> LLM:
    """The body's tests keep the LM head in the model dtype (see test_lm_head.py)."""
    kwargs.setdefault("quantize_lm_head", False)
    return LLM(path, dtype=dtype, num_gpu_blocks_override=128, block_size=4, max_model_len=256, **kwargs)


def _rtn_reference(hf, sym: bool = False, group: int = 128, dtype: torch.dtype = torch.float32) -> None:
    """Give transformers the weights int4 RTN dequantizes to (layers whose K the group divides), from
    weights loaded in `dtype` (a bf16 model quantizes the bf16-rounded weights)."""
    state = hf.state_dict()
    for name, w in state.items():
        parts = name.split(".")
        is_linear = ".layers." in name and parts[-1] == "weight" and parts[-2] in QUANTIZED_LINEARS
        if is_linear and w.shape[1] % group == 0:
            state[name] = dequantize(rtn.quantize(w.to(dtype), group, 4, sym))
    hf.load_state_dict(state)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def int4_model(request, tmp_path_factory):
    """(checkpoint dir, transformers on the RTN-dequantized weights, the same from bf16 weights)."""
    path = str(tmp_path_factory.mktemp(f"int4-{request.param}"))
    hf = make_tiny_model(request.param, path, **QUANTIZABLE_DIMS)
    hf_bf16 = copy.deepcopy(hf)
    _rtn_reference(hf)
    _rtn_reference(hf_bf16, dtype=torch.bfloat16)
    return path, hf, hf_bf16


def test_layers_hold_packed_int4(int4_model):
    path, _, _ = int4_model
    model = _llm(path, quantization="int4", quantize_lm_head=None).llm_engine.core.runner.model
    assert model.quant_config.name == "int4" and not model.quant_config.sym
    for module in MODULES:
        layer = model.get_submodule(f"model.layers.0.{module}")
        assert isinstance(layer.method, RtnInt4LinearMethod) and layer.method.quantized
        n, k = layer.output_size, layer.input_size
        assert layer.weight.dtype == torch.int32 and tuple(layer.weight.shape) == (n, k // 8)
        assert layer.scales.dtype == torch.float16 and tuple(layer.scales.shape) == (n, k // 128)
        assert layer.zeros is None or (
            layer.zeros.dtype == torch.uint8 and layer.zeros.shape == (n, k // 128)
        )
        assert layer.method.bits == 4 and layer.method.internal_group_size == 128
    # the embeddings stay in the model dtype; the LM head is int8 by default
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.int8 and model.lm_head.method.quantized


def test_logits_match_transformers_on_rtn_weights(int4_model):
    path, hf, _ = int4_model
    llm = _llm(path, quantization="int4")
    check_against_reference(llm, hf, PROMPTS, MAX_TOKENS)


def test_export_gives_transformers_the_rtn_weights(int4_model):
    path, hf, _ = int4_model
    model = _llm(path, quantization="int4").llm_engine.core.runner.model
    exported = dict(model.checkpoint_tensors())
    expected = {
        n: t for n, t in hf.state_dict().items() if n != "lm_head.weight" or not model.tie_word_embeddings
    }
    assert set(exported) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name].float().cpu(), tensor, atol=0, rtol=0, msg=name)


def test_bfloat16_close_to_reference(int4_model):
    """bf16: the weights are rounded to bf16 before RTN, and the math runs in bf16."""
    path, _, hf = int4_model
    llm = _llm(path, "bfloat16", quantization="int4")
    recorder = LogitsRecorder(llm)
    prompt = PROMPTS[1]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    ours = torch.stack(recorder.by_request[out[0].request_id]).float().cpu()
    ref = hf_logits(hf, prompt + out[0].outputs[0].token_ids)[len(prompt) - 1 : len(prompt) + 3]
    assert ((ours - ref).norm() / ref.norm()).item() < 0.05


def test_linear_weights_take_about_a_quarter_of_bf16(int4_model):
    path, _, _ = int4_model
    plain = weight_bytes(_llm(path, "bfloat16").llm_engine.core.runner.model)
    int4 = weight_bytes(_llm(path, "bfloat16", quantization="int4").llm_engine.core.runner.model)
    ratio = plain["linear"] / int4["linear"]
    # 16 bits against 4 + 16/128 (fp16 scale) + 8/128 (zero point) bits, biases left as they are
    assert 3.5 < ratio <= 16 / (4 + 0.1875) + 1e-6, ratio
    assert int4["total"] < plain["total"]


def test_layers_whose_k_is_not_a_multiple_of_the_group_stay_unquantized(tmp_path, caplog):
    """intermediate 192: down_proj has K=192 and stays in the model dtype (logged); the others are int4."""
    path = str(tmp_path / "odd")
    hf = make_tiny_model("qwen2", path, hidden_size=256, intermediate_size=192)
    _rtn_reference(hf)
    with caplog.at_level(logging.WARNING, logger="qwick.quantization.int4"):
        llm = _llm(path, quantization="int4")
    model = llm.llm_engine.core.runner.model
    for i in range(2):
        down = model.model.layers[i].mlp.down_proj
        assert not down.method.quantized and down.weight.dtype == torch.float32
        assert f"model.layers.{i}.mlp.down_proj has 192 input features" in caplog.text
        assert model.model.layers[i].mlp.gate_up_proj.weight.dtype == torch.int32
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, PROMPTS[1], MAX_TOKENS)


def test_symmetric_variant_and_layer_method():
    """`Int4Config(sym=True)`: zero point 8 as a constant (no zeros tensor); the layer's weights are exactly
    `rtn.quantize`'s, and the plain weight is gone after processing."""
    torch.manual_seed(0)
    w = torch.randn(48, 256) * 0.05
    for sym in (False, True):
        method = Int4Config(sym=sym).linear_method("model.layers.0.mlp.down_proj", ["x"])
        layer = Linear(256, 48, bias=True, method=method)
        layer.weight.data.copy_(w)
        layer.bias.data.normal_()
        method.process_weights_after_loading(layer)
        assert layer.weight.dtype == torch.int32 and (layer.zeros is None) == sym
        names = {n for n, _ in layer.named_parameters()}
        assert names == {"weight", "scales", "bias"} | (set() if sym else {"zeros"})
        assert sym == (method.zero_point == 8)
        assert torch.equal(method.dense_weight(layer), dequantize(rtn.quantize(w, 128, 4, sym)))
        x = torch.randn(3, 256)
        ref = x @ dequantize(rtn.quantize(w, 128, 4, sym)).T + layer.bias
        torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=1e-5)
    head = Int4Config.for_unquantized_checkpoint().linear_method("lm_head", ["lm_head"])  # the default
    assert head.qdtype == torch.int8 and not isinstance(head, RtnInt4LinearMethod)


def test_cpu_int4_packs_are_made_at_startup(int4_model):
    """A bf16 int4 model on the CPU repacks its layers for the int4 kernel while starting (one 1-token
    forward), not on the first request's first token; an fp32 model, which never uses the kernel, does not."""
    from qwick.quantization.formats import cpu_int4
    from qwick.quantization.int4 import PackedLinearMethod

    if not cpu_int4.available():
        pytest.skip("this torch or CPU has no fast CPU int4 GEMM")
    path, _, _ = int4_model
    for dtype, packed in (("bfloat16", True), ("float32", False)):
        model = _llm(path, dtype, quantization="int4").llm_engine.core.runner.model
        layers = [m for m in model.modules() if isinstance(getattr(m, "method", None), PackedLinearMethod)]
        assert layers and all((getattr(m, "cpu_int4_pack", None) is not None) == packed for m in layers)


def test_cpu_decode_rows_take_the_int4_kernel(monkeypatch):
    """On the CPU, bf16 rows up to 16 go through torch's int4 GEMM (`formats.cpu_int4`) on a pack made
    once and kept; a prefill-sized input keeps the reference path; both give the reference's function."""
    from qwick.quantization.formats import cpu_int4

    if not cpu_int4.available():
        pytest.skip("this torch has no CPU int4 GEMM")
    torch.manual_seed(0)
    method = Int4Config().linear_method("model.layers.0.mlp.down_proj", ["x"])
    layer = Linear(256, 48, bias=True, method=method)
    layer.weight.data.copy_(torch.randn(48, 256) * 0.05)
    method.process_weights_after_loading(layer)
    packs, calls = [], []
    real_pack, real_matmul = cpu_int4.pack, cpu_int4.matmul
    monkeypatch.setattr(cpu_int4, "pack", lambda *a: packs.append(1) or real_pack(*a))
    monkeypatch.setattr(cpu_int4, "matmul", lambda *a: calls.append(a[0].shape[0]) or real_matmul(*a))
    for m in (1, 16, 17, 1):
        x = torch.randn(m, 256).bfloat16()
        ref = method.apply_reference(layer, x)
        y = layer(x)
        assert y.shape == (m, 48) and ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    assert calls == [1, 16, 1] and len(packs) == 1
    # Weights written in place, as `load_state_dict` does: the next decode packs them again.
    with torch.no_grad():
        layer.scales.mul_(2)
    x = torch.randn(1, 256).bfloat16()
    y, ref = layer(x), method.apply_reference(layer, x)
    assert len(packs) == 2 and ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


def test_dummy_weights_quantized_on_the_fly(tiny_qwen2_dir, tmp_path):
    path = str(tmp_path / "dummy")
    make_tiny_model("qwen2", path, **QUANTIZABLE_DIMS)
    llm = _llm(path, load_format="dummy", quantization="int4")
    layer = llm.llm_engine.core.runner.model.model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype == torch.int32
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_bad_combinations_are_clear_errors(tmp_path):
    src, awq_dir = str(tmp_path / "src"), str(tmp_path / "awq")
    make_tiny_model("qwen2", src, **QUANTIZABLE_DIMS)
    build_awq_checkpoint(src, awq_dir)
    with pytest.raises(ValueError, match="already quantized.*quantization='int4' cannot re-quantize"):
        _llm(awq_dir, quantization="int4")
    with pytest.raises(ValueError, match="unknown quantization 'int3'.*int4"):
        EngineConfig(quantization="int3")
    assert resolve_quantization("int4", None).name == "int4"


def test_cli_flag():
    for name in ("int4", "gguf"):
        args = build_parser().parse_args(["generate", "some/model", "--quantization", name])
        assert engine_config_from_args(args).quantization == name


@pytest.mark.gpu
@pytest.mark.parametrize("half2", [True, False])
def test_cuda_one_row_takes_the_f16x2_gemv(half2, monkeypatch):
    """On CUDA, one bf16 row goes through the packed-fp16 GEMV (`decode_half2`, the default) or, switched
    off, the fp32 row GEMV; 2-16 rows never take either. Both give the reference's function."""
    from qwick.kernels import row_gemv, row_gemv_half2

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(RtnInt4LinearMethod, "decode_half2", half2)
    calls = _kernels_called(
        ((row_gemv_half2, "w4_half2_gemv"), (row_gemv, "w4_row_gemv")), (1, 4, 1), monkeypatch
    )
    assert calls == ["w4_half2_gemv" if half2 else "w4_row_gemv"] * 2


def _kernels_called(kernels, rows, monkeypatch) -> list[str]:
    """Which of `kernels` ((module, function name) pairs) a CUDA int4 layer calls for inputs of each of
    `rows` rows, each output checked against the reference path's."""
    torch.manual_seed(0)
    method = Int4Config().linear_method("model.layers.0.mlp.down_proj", ["x"])
    layer = Linear(1024, 192, bias=True, method=method).cuda()
    layer.weight.data.copy_(torch.randn(192, 1024, device="cuda") * 0.05)
    method.process_weights_after_loading(layer)
    calls = []
    for mod, name in kernels:
        real = getattr(mod, name)
        monkeypatch.setattr(
            mod, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k)
        )
    for m in rows:
        x = torch.randn(m, 1024, device="cuda").bfloat16()
        ref = method.apply_reference(layer, x)
        y = layer(x)
        assert y.shape == (m, 192) and ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tiled_min_m,tiled_max_m,min_codes",
    [(17, 0, 0), (17, 64, 0), (2, 64, 0), (2, 128, 1 << 25), (2, 128, 0)],
)
def test_cuda_rows_take_the_tiled_kernel_when_on(tiled_min_m, tiled_max_m, min_codes, monkeypatch):
    """`tiled_min_m`..`tiled_max_m` rows go through `w4_tiled_matmul` (above 64 rows only layers of
    `tiled_min_codes_above_64` codes or more); 2-16 rows below that through `quant_matmul`; more rows than
    that (all of them above 16 when off) through dequantize-then-cuBLAS. Each gives the reference's
    function."""
    from qwick.kernels import w4a16

    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    monkeypatch.setattr(RtnInt4LinearMethod, "tiled_min_m", tiled_min_m)
    monkeypatch.setattr(RtnInt4LinearMethod, "tiled_max_m", tiled_max_m)
    monkeypatch.setattr(RtnInt4LinearMethod, "tiled_min_codes_above_64", min_codes)
    kernels = ((w4a16, "w4_tiled_matmul"), (w4a16, "dequantize_int4"), (w4a16, "quant_matmul"))
    calls = _kernels_called(kernels, (3, 16, 20, 64, 65, 129), monkeypatch)
    small = ["w4_tiled_matmul"] * 2 if tiled_min_m <= 3 else ["quant_matmul"] * 2
    tiled = ["w4_tiled_matmul"] * 2 if tiled_max_m else ["dequantize_int4"] * 2
    above_64 = "w4_tiled_matmul" if tiled_max_m >= 65 and min_codes <= 192 * 1024 else "dequantize_int4"
    assert calls == [*small, *tiled, above_64, "dequantize_int4"]


def test_paired_input_is_asked_only_for_one_cuda_row(monkeypatch):
    """`paired_input` on: the method asks the producer of its input for the f16x2 GEMV's operand only for
    one row on CUDA (here: a CPU row and several rows get None, as does the switch off)."""
    from qwick.layers.linear import HalfPairs

    method = Int4Config().linear_method("model.layers.0.mlp.down_proj", ["x"])
    layer = Linear(1024, 192, bias=True, method=method)
    layer.weight.data.copy_(torch.randn(192, 1024) * 0.05)
    method.process_weights_after_loading(layer)
    monkeypatch.setattr(RtnInt4LinearMethod, "paired_input", True)
    assert layer.input_quant(torch.randn(1, 1024).bfloat16()) is None  # the CPU
    if torch.cuda.is_available():
        layer = layer.cuda()
        assert layer.input_quant(torch.randn(1, 1024, device="cuda").bfloat16()) == HalfPairs(64.0)
        assert layer.input_quant(torch.randn(4, 1024, device="cuda").bfloat16()) is None
        monkeypatch.setattr(RtnInt4LinearMethod, "paired_input", False)
        assert layer.input_quant(torch.randn(1, 1024, device="cuda").bfloat16()) is None


@pytest.mark.gpu
def test_paired_input_gives_the_same_tokens(tmp_path, monkeypatch):
    """Batch-1 int4 decode with the norms and SiLU writing the GEMV's pairs (`paired_input`) against the
    GEMV pairing x itself: the same activations bit for bit, so the same greedy tokens (CUDA graphs on)."""
    off, on = _decode_with_and_without(tmp_path, monkeypatch, "paired_input")
    assert off.token_ids == on.token_ids


def _decode_with_and_without(
    tmp_path,
    monkeypatch,
    switch: str,
    logprobs: int | None = None,
    also: Callable[[bool], None] | None = None,
) -> list:
    """A tiny bf16 model's int4 greedy output for one prompt (24 tokens, CUDA graphs on) with the method's
    `switch` off, then on; `also(value)` sets any other switches that go with it, before each run."""
    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    path = str(tmp_path / "m")
    make_tiny_model("qwen2", path, **QUANTIZABLE_DIMS)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    outs = []
    for value in (False, True):
        monkeypatch.setattr(RtnInt4LinearMethod, switch, value)
        if also is not None:
            also(value)
        llm = LLM(path, quantization="int4", dtype="bfloat16", max_model_len=256, num_gpu_blocks_override=64)
        outs.append(llm.generate([list(range(5, 40))], params, use_tqdm=False)[0].outputs[0])
        del llm
    return outs


@pytest.mark.gpu
def test_gated_decode_gives_the_same_tokens(tmp_path, monkeypatch):
    """`gated_decode` on: batch-1 SiLU-and-mul in the gate/up GEMV's epilogue (`w4_half2_gated`, here at a
    one-split launch for the tiny shapes, which would split K), the same activations bit for bit as the
    separate launch, so the same greedy tokens (CUDA graphs on); and the gated kernel is what ran."""
    from qwick.kernels import row_gemv_half2 as h

    calls = []
    real = h.w4_half2_gated
    monkeypatch.setattr(h, "w4_half2_gated", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    monkeypatch.setattr(
        h, "gated_half2_config", lambda n, kw, sms: h.RowGemvConfig(32, h.tile_words_for(kw), 1)
    )
    off, on = _decode_with_and_without(tmp_path, monkeypatch, "gated_decode")
    assert off.token_ids == on.token_ids
    assert calls and set(calls) == {
        (2 * QUANTIZABLE_DIMS["intermediate_size"], QUANTIZABLE_DIMS["hidden_size"])
    }


@pytest.mark.gpu
def test_pdl_preload_gives_the_same_tokens(tmp_path, monkeypatch):
    """`pdl_preload` on: batch-1 f16x2 GEMVs of at most two tiles a split load their weights before they
    wait for the kernel before (launched early after the input norm and decode attention, CUDA graphs on):
    the same sums bit for bit, so the same greedy tokens; and the QKV and o projections did preload."""
    from qwick.kernels import row_gemv_half2 as h
    from qwick.kernels.pdl import pdl_supported

    preloaded = []
    real = h._launch

    def spy(x, weight, *args, preload=False, **kwargs):
        preloaded.append((tuple(weight.shape), preload))
        return real(x, weight, *args, preload=preload, **kwargs)

    monkeypatch.setattr(h, "_launch", spy)
    for switch in ("pdl_mlp", "pdl_down"):  # the MLP chain off: only QKV and o may preload
        monkeypatch.setattr(RtnInt4LinearMethod, switch, False)
    off, on = _decode_with_and_without(tmp_path, monkeypatch, "pdl_preload")
    assert off.token_ids == on.token_ids
    hidden = QUANTIZABLE_DIMS["hidden_size"]
    assert pdl_supported(torch.device("cuda"))
    shapes = {shape for shape, preload in preloaded if preload}
    assert (hidden, hidden) in shapes and any(n > hidden and k == hidden for n, k in shapes)  # o, qkv


@pytest.mark.gpu
def test_pdl_chain_gives_the_same_tokens(tmp_path, monkeypatch):
    """`pdl_mlp`, `pdl_down` and `pdl_norm` off, then on (the default): o lets gate/up in, gate/up lets
    down in, down lets the next layer's input norm in, QKV lets decode attention in, each GEMV once its
    programs are past their loops, each successor loading its first tiles (the norm and attention nothing)
    before it waits; the same greedy tokens as without (CUDA graphs on), and the
    launches were early ones. The down projection keeps its norm out of its launch here (as at 7b shapes,
    where `normed_half2_config` has no launch for it), so the next layer's input norm runs apart."""
    from qwick.kernels import elementwise
    from qwick.kernels import row_gemv_half2 as h
    from qwick.layers.attention import triton_backend

    launches, norms = [], []
    real, real_norm = h._launch, elementwise.rms_norm

    def spy(x, weight, bias, ws, config, pairs, gated, *args, preload=False, trigger=False, **kwargs):
        launches.append((tuple(weight.shape), gated, preload, trigger))
        early = {"preload": preload, "trigger": trigger}
        return real(x, weight, bias, ws, config, pairs, gated, *args, **early, **kwargs)

    def norm_spy(*args, early=False, **kwargs):
        norms.append(early)
        return real_norm(*args, early=early, **kwargs)

    monkeypatch.setattr(h, "_launch", spy)
    monkeypatch.setattr(elementwise, "rms_norm", norm_spy)
    monkeypatch.setattr(
        h, "gated_half2_config", lambda n, kw, sms: h.RowGemvConfig(32, h.tile_words_for(kw), 1)
    )
    hidden, inter = QUANTIZABLE_DIMS["hidden_size"], QUANTIZABLE_DIMS["intermediate_size"]
    real_normed = h.normed_half2_config
    monkeypatch.setattr(  # the down projection without the norm in its launch
        h, "normed_half2_config", lambda n, kw, sms: None if kw * 8 == inter else real_normed(n, kw, sms)
    )

    def chain(value: bool) -> None:  # every switch of the chain with pdl_mlp
        monkeypatch.setattr(RtnInt4LinearMethod, "pdl_down", value)
        monkeypatch.setattr(RtnInt4LinearMethod, "pdl_norm", value)

    attention = []
    real_decode = triton_backend.TritonAttentionBackend._decode

    def decode_spy(self, *args, **kwargs):
        attention.append(self.pdl_early_decode)
        return real_decode(self, *args, **kwargs)

    monkeypatch.setattr(triton_backend.TritonAttentionBackend, "_decode", decode_spy)
    off, on = _decode_with_and_without(tmp_path, monkeypatch, "pdl_mlp", also=chain)
    assert off.token_ids == on.token_ids
    assert ((2 * inter, hidden), True, True, True) in launches  # gate/up: early, lets down in
    assert ((hidden, inter), False, True, True) in launches  # down: early, lets the norm in
    assert True in norms and False in norms  # decode steps' input norms launched early in the second run
    assert True in attention and False in attention  # decode attention too


@pytest.mark.gpu
def test_attention_preload_chain_gives_the_same_tokens(tmp_path, monkeypatch):
    """`pdl_qkv_start`, `DECODE_PRELOAD` and `DECODE_TRIGGER_LATE` off, then on: the QKV GEMV lets decode
    attention in at its start, the attention reads its first key tile before it waits and lets o in
    after; the same greedy tokens as without (CUDA graphs on), and the QKV launches did trigger at their
    start in the second run. A tile read before QKV's output (or the cache write) was ready would not."""
    from qwick.kernels import row_gemv_half2 as h
    from qwick.layers.attention import triton_backend

    starts = []
    real = h._launch

    def spy(*args, trigger_at_start=False, **kwargs):
        starts.append(trigger_at_start)
        return real(*args, trigger_at_start=trigger_at_start, **kwargs)

    monkeypatch.setattr(h, "_launch", spy)

    def attention(value: bool) -> None:
        monkeypatch.setattr(triton_backend, "DECODE_PRELOAD", value)
        monkeypatch.setattr(triton_backend, "DECODE_TRIGGER_LATE", value)

    off, on = _decode_with_and_without(tmp_path, monkeypatch, "pdl_qkv_start", also=attention)
    assert off.token_ids == on.token_ids
    assert True in starts and False in starts


def test_pdl_roles_at_7b_shapes(monkeypatch):
    """`PackedLinearMethod._pdl` on a device with PDL: with the chain's switches off the QKV and o projections
    (at most two tiles a split) preload and nothing triggers; gate/up and down launch as before. `pdl_mlp`
    makes o trigger and gate/up preload; `pdl_down` makes gate/up trigger and down preload; `pdl_norm` makes
    QKV and down trigger (all three are on by default). A launch shape other than the default's is
    judged as it is. Never without PDL."""
    from types import SimpleNamespace

    import qwick.kernels.pdl as pdl

    method = Int4Config().linear_method("model.layers.0.self_attn.o_proj", ["x"])
    method.workspace = SimpleNamespace(num_sms=132)
    x = torch.zeros(1, 1)
    for switch in ("pdl_mlp", "pdl_down", "pdl_norm"):
        monkeypatch.setattr(RtnInt4LinearMethod, switch, False)
    shapes = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]
    qkv, o, gate_up, down = (SimpleNamespace(shape=s) for s in shapes)

    def roles() -> list[tuple[bool, bool]]:
        got = [method._pdl(x, qkv, "row"), method._pdl(x, o, "normed"), method._pdl(x, gate_up, "gated")]
        got.append(method._pdl(x, down, "row"))
        return [(r["preload"], r["trigger"]) for r in got]

    assert roles() == [(False, False)] * 4  # a CPU row: no PDL
    monkeypatch.setattr(pdl, "pdl_supported", lambda device: True)
    assert roles() == [(True, False), (True, False), (False, False), (False, False)]
    from qwick.kernels.row_gemv import RowGemvConfig

    one_split = RowGemvConfig(64, 32, 1, 8)  # o's launch in one split: 14 tiles a split, no preload
    assert method._pdl(x, o, "normed", one_split) == {"preload": False, "trigger": False}
    monkeypatch.setattr(RtnInt4LinearMethod, "pdl_mlp", True)
    assert roles() == [(True, False), (True, True), (True, False), (False, False)]
    monkeypatch.setattr(RtnInt4LinearMethod, "pdl_down", True)
    assert roles() == [(True, False), (True, True), (True, True), (True, False)]
    monkeypatch.setattr(RtnInt4LinearMethod, "pdl_norm", True)  # QKV and down let the next kernel in
    assert roles() == [(True, True)] * 4
    monkeypatch.undo()  # the defaults: the whole chain and `pdl_qkv_start`
    monkeypatch.setattr(pdl, "pdl_supported", lambda device: True)
    assert roles() == [(True, True)] * 4
    assert method.lets_next_in
    # `pdl_qkv_start`: the QKV projection, before attention, lets it in at its start; down never
    before_attention, other = (
        SimpleNamespace(precedes_attention=True),
        SimpleNamespace(precedes_attention=False),
    )
    assert method._pdl(x, qkv, "row", layer=before_attention)["trigger_at_start"]
    assert not method._pdl(x, down, "row", layer=other)["trigger_at_start"]
    monkeypatch.setattr(RtnInt4LinearMethod, "pdl_qkv_start", False)
    assert not method._pdl(x, qkv, "row", layer=before_attention)["trigger_at_start"]
    monkeypatch.setattr(RtnInt4LinearMethod, "decode_half2", False)  # no f16x2 GEMV lets anything in
    assert not method.lets_next_in


@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("early", [True, False])
def test_norms_and_decode_attention_launch_early_only_after_projections_that_let_them_in(
    tmp_path, monkeypatch, quantization, early
):
    """The input norms after a down projection and the final norm are asked to launch early exactly when
    the down projection lets the next kernel in (`lets_next_in`: with `pdl_norm`, on by default for int4
    and int8), the post-attention norms never; decode attention (`qkv_lets_next_in`, the runner's
    choice for the Triton backend) likewise after the QKV projections. An early launch after a kernel that
    never lets it in is only slower."""
    from qwick.layers.norm import RMSNorm
    from qwick.quantization.w8a8 import W8A8LinearMethod
    from qwick.runner.model_runner import qkv_lets_next_in

    monkeypatch.setattr(RtnInt4LinearMethod, "pdl_norm", early)
    monkeypatch.setattr(W8A8LinearMethod, "pdl_norm", early)
    path = str(tmp_path / "m")
    make_tiny_model("qwen2", path, **QUANTIZABLE_DIMS)
    llm = _llm(path, "float32", quantization=quantization)
    model = llm.llm_engine.core.runner.model
    names = {id(m): name for name, m in model.named_modules()}
    seen: dict[str, set[bool]] = {}
    real = RMSNorm.forward

    def spy(self, x, residual=None, quant=None, early=False):
        if residual is not None:
            seen.setdefault(names[id(self)].rsplit(".", 1)[-1], set()).add(early)
        return real(self, x, residual, quant, early)

    monkeypatch.setattr(RMSNorm, "forward", spy)
    llm.generate([list(range(5, 20))], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert seen == {"input_layernorm": {early}, "norm": {early}, "post_attention_layernorm": {False}}
    assert qkv_lets_next_in(model) is early


def test_gated_decode_stays_off_the_cpu(monkeypatch):
    """`gated_decode` on: a CPU row (and a layer that is not [gate | up]) is not gated, so the MLP runs its
    matmul and SiLU-and-mul apart, as before."""
    monkeypatch.setattr(RtnInt4LinearMethod, "gated_decode", True)
    method = Int4Config().linear_method("model.layers.0.mlp.gate_up_proj", ["x"])
    layer = Linear(256, [128, 128], method=method)
    layer.weight.data.copy_(torch.randn(256, 256) * 0.05)
    method.process_weights_after_loading(layer)
    assert layer.gated(torch.randn(1, 256).bfloat16(), None) is None
    uneven = Linear(
        256, [128, 64], method=Int4Config().linear_method("model.layers.0.mlp.gate_up_proj", ["x"])
    )
    assert uneven.gated(torch.randn(1, 256).bfloat16(), None) is None


@pytest.mark.gpu
def test_normed_decode_gives_the_same_distribution(tmp_path, monkeypatch):
    """`normed_decode` on: batch-1 residual add + RMSNorm after the o and down projections in their
    GEMV's launch (`w4_half2_normed`). The sum of squares may be added in another order than
    `rms_norm`'s, so the check is the decode steps' top log-probabilities (CUDA graphs on), within 0.05 of
    the separate launches', while the tokens agree; and the normed kernel is what ran, for o and down."""
    from qwick.kernels import row_gemv_half2 as h

    calls = []
    real = h.w4_half2_normed
    monkeypatch.setattr(h, "w4_half2_normed", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    outs = _decode_with_and_without(tmp_path, monkeypatch, "normed_decode", logprobs=3)
    hidden, inter = QUANTIZABLE_DIMS["hidden_size"], QUANTIZABLE_DIMS["intermediate_size"]
    assert calls and set(calls) == {(hidden, hidden), (hidden, inter)}  # o and down
    for step, (a, b) in enumerate(zip(outs[0].token_ids, outs[1].token_ids, strict=True)):
        if step > 0:  # steps after the first are decode steps
            top_a, top_b = outs[0].logprobs[step], outs[1].logprobs[step]
            for token in set(top_a) & set(top_b):
                assert abs(top_a[token].logprob - top_b[token].logprob) < 0.05, (step, token)
        if a != b:
            break


def test_normed_decode_stays_off_the_cpu(monkeypatch):
    """`normed_decode` on: a CPU row is not normed in the GEMV's launch (the layer runs its matmul and the
    norm apart, as before)."""
    from qwick.layers.linear import NormAfter

    monkeypatch.setattr(RtnInt4LinearMethod, "normed_decode", True)
    method = Int4Config().linear_method("model.layers.0.self_attn.o_proj", ["x"])
    layer = Linear(256, 256, method=method)
    layer.weight.data.copy_(torch.randn(256, 256) * 0.05)
    method.process_weights_after_loading(layer)
    norm = NormAfter(torch.ones(256).bfloat16(), 1e-6, torch.randn(1, 256).bfloat16())
    assert layer.normed(torch.randn(1, 256).bfloat16(), norm) is None
