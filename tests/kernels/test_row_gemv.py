"""The one-row GEMV on 8-bit and 4-bit codes against float64 dequantize-then-matmul.

The bit tricks must decode every code exactly: all 256 int8 codes and all finite fp8 e4m3 codes
(subnormals, zero and negative zero included) are checked one by one, then whole products at the
qwen2.5-7b decode shapes with split-K (counters reset on a second call), bias, zero-point tensors,
symmetric int4 and act-order. With TRITON_INTERPRET=1 it runs on the CPU at small shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

from qwick.quantization.formats import gptq, rtn
from qwick.quantization.formats.layout import dequantize

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# (N, K): qwen2.5-7b qkv, o, gate_up, down; an N that is not a multiple of the tile
SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (1000, 1024)]
if INTERPRET:
    SHAPES = [(96, 512), (40, 768)]


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if INTERPRET:
        return torch.device("cpu")
    pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1)")


def _workspace(dev: torch.device):
    from qwick.kernels.gemv import GemvWorkspace

    if dev.type == "cuda":
        return GemvWorkspace(dev, max_elems=1 << 24)
    ws = GemvWorkspace.__new__(GemvWorkspace)
    ws.partials = torch.empty(1 << 20, dtype=torch.float32)
    ws.counters = torch.zeros(1 << 12, dtype=torch.int32)
    ws.num_sms = 4
    ws.configs = {}
    return ws


def _configs(kind: str, n: int, kw: int, ws, group_words: int = 16):
    from qwick.kernels.row_gemv import RowGemvConfig, default_w4_config, default_w8_config

    if kind == "w4":
        return [
            default_w4_config(n, kw, group_words, ws.num_sms),
            RowGemvConfig(32, group_words, 1),
            RowGemvConfig(16, group_words, 4, num_stages=3),
        ]
    return [default_w8_config(n, kw, ws.num_sms), RowGemvConfig(16, 16, 1), RowGemvConfig(64, 32, 4)]


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_every_8bit_code_decodes_exactly(dtype):
    """Row n of W holds code n at every position, x is all ones: y[n] = K * value(code n) * scale."""
    from qwick.kernels.row_gemv import RowGemvConfig, w8_row_gemv

    dev = _device()
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = raw.view(dtype)
    if dtype == torch.float8_e4m3fn:
        codes = codes[~codes.float().isnan()]
    k = 64
    w = codes[:, None].expand(-1, k).contiguous().to(dev)
    scale = torch.full((w.shape[0],), 0.5, dtype=torch.float32, device=dev)
    x = torch.ones(1, k, dtype=torch.float32, device=dev)
    y = w8_row_gemv(x, w, scale, None, _workspace(dev), RowGemvConfig(16, 16, 1))
    expected = codes.float() * k * 0.5
    torch.testing.assert_close(y[0].cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("bias", [False, True])
def test_w8_row_gemv_matches_float64(n, k, dtype, bias):
    from qwick.kernels.row_gemv import w8_row_gemv

    dev = _device()
    ws = _workspace(dev)
    act = torch.float16 if INTERPRET else torch.bfloat16
    if dtype == torch.int8:
        codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev)
    else:
        codes = (torch.randn(n, k, device=dev) * 100).clamp(-448, 448).to(dtype)
    scale = torch.rand(n, device=dev, dtype=torch.float32) / (k**0.5 * 100) + 1e-5
    b = torch.randn(n, device=dev, dtype=act) if bias else None
    for cfg in _configs("w8", n, k // 4, ws):
        for _ in range(2):  # a second call reuses the self-reset split-K counters
            x = torch.randn(1, k, device=dev, dtype=act)
            ref = (x.double() @ codes.double().T) * scale.double() + (b.double() if bias else 0)
            out = w8_row_gemv(x, codes, scale, b, ws, cfg)
            assert out.shape == (1, n) and out.dtype == act
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 4e-3, (cfg, err)  # the output's bf16 rounding; a wrong code is far larger
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("form", ["rtn", "gptq_sym_act_order"])
def test_w4_row_gemv_matches_dequantized_matmul(n, k, form):
    from qwick.kernels.row_gemv import w4_row_gemv, w4_row_supported

    dev = _device()
    ws = _workspace(dev)
    act = torch.float16 if INTERPRET else torch.bfloat16
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) / k**0.5
    if form == "rtn":  # asymmetric: a zero-point tensor
        qw = rtn.quantize(w, group_size=128).to(dev)
    else:  # symmetric (zero point 8) with a permuted K
        order = torch.randperm(k, generator=gen)
        qw = gptq.to_internal(**gptq.quantize(w, 128, sym=True, act_order=order)).to(dev)
    assert w4_row_supported(qw)
    w_deq = dequantize(qw).double()  # [N, K] in the input channels' order
    b = torch.randn(n, device=dev, dtype=act)
    for cfg in _configs("w4", n, k // 8, ws):
        for _ in range(2):
            x = torch.randn(1, k, device=dev, dtype=act)
            ref = x.double() @ w_deq.T + b.double()
            out = w4_row_gemv(x, qw, b, ws, cfg)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 4e-3, (cfg, err)
    assert int(ws.counters.abs().sum()) == 0
