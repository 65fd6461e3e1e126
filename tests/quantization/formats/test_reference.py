"""`dequant_matmul`, the CPU path and the kernels' oracle: x @ W.T on the exactly dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwick.quantization.formats import awq, gptq, rtn
from qwick.quantization.formats.layout import dequantize
from qwick.quantization.formats.reference import dequant_matmul


def _weights():
    torch.manual_seed(0)
    w = torch.randn(40, 256) * 0.05
    yield "rtn", rtn.quantize(w), w
    yield "awq", awq.to_internal(**awq.quantize(w)), w
    yield "gptq-act-order", gptq.to_internal(**gptq.quantize(w, act_order=torch.randperm(256))), w


@pytest.mark.parametrize("name,qw,w", list(_weights()), ids=lambda v: v if isinstance(v, str) else "")
def test_matches_float64_matmul_on_dequantized_weight(name, qw, w):
    x = torch.randn(2, 3, 256, dtype=torch.float64)
    bias = torch.randn(40, dtype=torch.float64)
    dq = dequantize(qw).double()  # original channel order
    out = dequant_matmul(x, qw, bias)
    assert out.shape == (2, 3, 40)
    torch.testing.assert_close(out, x @ dq.T + bias, rtol=1e-12, atol=1e-12)
    # and it is a good approximation of the float layer (int4 g128 on a Gaussian weight)
    rel = ((out - (x @ w.double().T + bias)).norm() / (x @ w.double().T).norm()).item()
    assert rel < 0.15, rel


def test_low_precision_activations_use_rounded_weights():
    torch.manual_seed(1)
    qw = gptq.to_internal(**gptq.quantize(torch.randn(32, 256), act_order=torch.randperm(256)))
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    assert qw.perm is not None
    out = dequant_matmul(x, qw)
    assert out.dtype == torch.bfloat16
    expect = F.linear(x[:, qw.perm], dequantize(qw, torch.bfloat16, original_order=False))
    assert torch.equal(out, expect)
