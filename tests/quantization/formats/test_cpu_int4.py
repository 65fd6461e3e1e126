"""4-bit weights through torch's CPU int4 GEMM: the same function as the reference on every 4-bit form
(zero points, one zero point for all, GGUF Q4_K mins, act-order), used only where it is fast."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from qwick.quantization.formats import awq, cpu_int4, gguf_quant, gptq, rtn
from qwick.quantization.formats.layout import dequantize
from qwick.quantization.formats.reference import dequant_matmul

pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason="this torch has no CPU int4 GEMM")
N, K = 48, 512


def _q4_k(n: int, k: int) -> gguf_quant.QuantizedWeight:
    """Random Q4_K blocks with small positive super-block scale and min (fp16 at bytes 0 and 2)."""
    rng = np.random.default_rng(3)
    block, type_size = gguf.GGML_QUANT_SIZES[QT.Q4_K]
    data = rng.integers(0, 256, size=(n * k // block, type_size), dtype=np.uint8)
    data[:, 0:2] = np.full((len(data), 1), 0.002, np.float16).view(np.uint8)
    data[:, 2:4] = np.full((len(data), 1), 0.001, np.float16).view(np.uint8)
    return gguf_quant.repack(data.reshape(n, -1), QT.Q4_K, (n, k))


def _weights():
    torch.manual_seed(0)
    w = torch.randn(N, K) * 0.05
    yield "rtn", rtn.quantize(w, 128)
    yield "rtn-sym-g32", rtn.quantize(w, 32, sym=True)
    yield "awq", awq.to_internal(**awq.quantize(w))
    yield "gptq-act-order", gptq.to_internal(**gptq.quantize(w, act_order=torch.randperm(K)))
    yield "gguf-q4_k", _q4_k(N, K)


@pytest.mark.parametrize("name,qw", list(_weights()), ids=lambda v: v if isinstance(v, str) else "")
def test_same_function_as_the_reference(name, qw):
    """In float32 the kernel's scale and zero are exact: the reference up to summation order. In bf16
    they are rounded once, like a bf16 weight: within bf16 rounding of the float64 product."""
    x = torch.randn(3, K)
    bias = torch.randn(N)
    exact = x.double() @ dequantize(qw).double().T + bias.double()
    y32 = cpu_int4.matmul(x, cpu_int4.pack(qw, torch.float32), bias)
    torch.testing.assert_close(y32.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    xb = x.bfloat16()
    assert cpu_int4.supports(qw, xb)
    yb = cpu_int4.matmul(xb, cpu_int4.pack(qw, torch.bfloat16), bias.bfloat16())
    ref = dequant_matmul(xb, qw, bias.bfloat16())
    exact_b = xb.double() @ dequantize(qw).double().T + bias.double()
    assert yb.dtype == torch.bfloat16
    err, ref_err = ((t.double() - exact_b).norm() / exact_b.norm() for t in (yb, ref))
    assert err < 1e-2 and err < 3 * ref_err + 1e-3, (err, ref_err)


def test_only_where_it_is_fast():
    qw = rtn.quantize(torch.randn(N, K), 128)
    rows = lambda m, dtype=torch.bfloat16: torch.zeros(m, K, dtype=dtype)  # noqa: E731
    assert cpu_int4.supports(qw, rows(1)) and cpu_int4.supports(qw, rows(16))
    assert not cpu_int4.supports(qw, rows(17))  # prefill: the time grows with the rows
    assert not cpu_int4.supports(qw, rows(1, torch.float32))  # 20-40x slower than bf16 in the kernel
    assert not cpu_int4.supports(qw, rows(1, torch.float16))
    assert not cpu_int4.supports(rtn.quantize(torch.randn(40, K), 128), rows(1))  # N % 16
    assert not cpu_int4.supports(rtn.quantize(torch.randn(N, K), 128, bits=8), rows(1))
    assert not cpu_int4.supports(
        rtn.quantize(torch.randn(N, 96), 16), torch.zeros(1, 96, dtype=torch.bfloat16)
    )
