"""int4 linear layers on the GPU against dequantize-then-matmul, at every linear shape of qwen2.5-7b and -14b
(and the 7b LM head, which `quantize_lm_head` makes int4), M from 1 to 4096: each M takes the path a step
of that size takes (`_apply_cuda`): one row the packed-fp16 GEMV, 2-16 rows the W4A16 kernel, 17-64 the
tiled W4A16 kernel (17: nibble dots, 64: the reshape), more the layer dequantized by Triton and then
cuBLAS. The kernels alone, with act-order and GGUF weights: tests/kernels/test_w4a16.py and
tests/kernels/test_row_gemv.py."""

from __future__ import annotations

import pytest
import torch

from qwick.layers.linear import Linear
from qwick.quantization.int4 import Int4Config
from tests.utils import QWEN_7B_14B_LINEAR_SHAPES, ROWS_1_TO_4096

pytestmark = pytest.mark.gpu

SHAPES = QWEN_7B_14B_LINEAR_SHAPES  # qwen2.5-7b then -14b: qkv, o, gate_up, down
MS = ROWS_1_TO_4096
LM_HEAD = (152064, 3584)  # qwen2.5-7b's vocabulary projection


def _layer(n: int, k: int, sym: bool, bias: bool, dtype: torch.dtype = torch.bfloat16) -> Linear:
    method = Int4Config(sym=sym).linear_method("model.layers.0.mlp.down_proj", ["x"])
    layer = Linear(k, n, bias=bias, method=method).cuda().to(dtype)
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    layer.weight.data.copy_(torch.randn(n, k, device="cuda", generator=gen) / k**0.5)
    if bias:
        layer.bias.data.normal_(generator=gen)
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.int32
    return layer


def _check(layer: Linear, ms: list[int], dtype: torch.dtype = torch.bfloat16) -> None:
    """Relative error against the dequantized weights (rounded once to `dtype`, as every path uses them)
    times x in float64: the kernels' fp32 sums and one rounding of the output to `dtype`, x's."""
    n, k = layer.output_size, layer.input_size
    w = layer.method.dense_weight(layer).to(dtype).double()
    b = layer.bias.double() if layer.bias is not None else 0
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        y = layer(x)
        assert y.shape == (m, n) and y.dtype == dtype
        ref = x.double() @ w.T + b
        rel = ((y.double() - ref).norm() / ref.norm()).item()
        assert rel < 4e-3, f"M={m}: {rel:.2e}"


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("sym", [False, True], ids=["zeros", "sym"])
def test_int4_layer_matches_dequantized_matmul(n, k, sym):
    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    _check(_layer(n, k, sym, bias=not sym), MS)


@pytest.mark.parametrize("n,k", SHAPES[:4])
def test_int4_layer_in_fp16_matches_dequantized_matmul(n, k):
    """fp16 activations (Qwen's AWQ / GPTQ-Int4 releases): 2-128 rows decode the codes in packed fp16
    math (`PackedLinearMethod.tiled_half_decode`)."""
    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    _check(_layer(n, k, sym=False, bias=True, dtype=torch.float16), MS, torch.float16)


def test_int4_lm_head_matches_dequantized_matmul():
    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    _check(_layer(*LM_HEAD, sym=False, bias=False), [1, 7, 256])
