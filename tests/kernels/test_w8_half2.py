"""The batch-1 W8A8 GEMV in packed fp16 (`qwick.kernels.w8_half2`) against float64 products of the codes.

Small integer codes with unit scales give exact sums (every partial sum of 16 products is an integer fp16
holds), checked for equality in fp8 and int8, with every code position of a word; then random weights
and activations quantized as the layers quantize them (per channel, per token or per group of columns)
at the qwen2.5-7b decode shapes, with split-K (counters reset on a second call) and bias. Under
TRITON_INTERPRET=1 the kernel computes its products in fp32 (the interpreter runs no PTX), so the GPU
run is what checks the inline assembly.
"""

from __future__ import annotations

import pytest
import torch

from qwick.kernels.row_gemv import RowGemvConfig
from qwick.quantization.w8a8 import (
    FP8_DTYPE,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_per_channel,
)
from tests.triton_utils import INTERPRET, gemv_workspace, triton_device

pytestmark = [pytest.mark.gpu, pytest.mark.interpret]

SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (1000, 1040)]
if INTERPRET:
    SHAPES = [(96, 512), (40, 1040)]
QDTYPES = [FP8_DTYPE, torch.int8]


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_small_integer_codes_sum_exactly(qdtype):
    from qwick.kernels.w8_half2 import w8_half2_gemv

    dev = triton_device()
    gen = torch.Generator().manual_seed(1)
    n, k = 48, 1024
    w = torch.randint(-7, 8, (n, k), generator=gen).float()
    x = torch.randint(-7, 8, (1, k), generator=gen).float()
    ones_n = torch.ones(n, device=dev)
    ws = gemv_workspace(dev)
    # the interpreter rounds fp32 -> bf16 toward zero, so bf16 outputs are checked on GPUs only
    for out_dtype in [torch.float32] + ([] if INTERPRET else [torch.bfloat16]):
        expected = (x.double() @ w.double().T).float().to(out_dtype)
        for cfg in (None, RowGemvConfig(32, 8, 4), RowGemvConfig(16, 32, 1)):
            y = w8_half2_gemv(
                x.to(dev, qdtype), torch.ones(1, 1, device=dev), w.to(dev, qdtype), ones_n, None, ws,
                out_dtype, config=cfg,
            )  # fmt: skip
            assert torch.equal(y.cpu(), expected), (out_dtype, cfg)
    # per-group activation scales: 2 for the second half of K
    xs = torch.tensor([[1.0, 2.0]], device=dev)
    y = w8_half2_gemv(x.to(dev, qdtype), xs, w.to(dev, qdtype), ones_n, None, ws, torch.float32, x_group=512)
    x2 = x.clone()
    x2[:, 512:] *= 2
    assert torch.equal(y.cpu(), (x2.double() @ w.double().T).float())


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("grouped", [False, True])
def test_matches_the_codes_product(n, k, qdtype, grouped):
    from qwick.kernels.w8_half2 import default_w8_half2_config, w8_half2_gemv

    dev = triton_device()
    gen = torch.Generator().manual_seed(n + k)
    wq, wscale = quantize_weight_per_channel(torch.randn(n, k, generator=gen) / k**0.5, qdtype)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    group = 208 if k == 1040 else 512
    ws = gemv_workspace(dev)
    out_dtype = torch.float16 if INTERPRET else torch.bfloat16  # the interpreter's bf16 rounds toward zero
    configs = [default_w8_half2_config(n, k // 4, ws.num_sms, group // 4 if grouped else 0)]
    configs += [RowGemvConfig(32, 4, 3), RowGemvConfig(64, 4, 1)]
    for cfg in configs:
        for _ in range(2):  # a second call reuses the self-reset split-K counters
            x = torch.randn(1, k, generator=gen) * 3
            xq, xs = quantize_per_token_group(x, qdtype, group) if grouped else quantize_per_token(x, qdtype)
            cols = torch.arange(k) // group
            xd = xq.double() * (xs[:, cols] if grouped else xs).double()
            ref = xd @ (wq.double() * wscale.double()).T + b.double()
            out = w8_half2_gemv(
                xq.to(dev), xs.to(dev), wq.to(dev), wscale.view(-1).to(dev), b.to(dev), ws, out_dtype,
                x_group=group if grouped else None, config=cfg,
            )  # fmt: skip
            err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
            assert err < 4e-3, (cfg, err)
    assert int(ws.counters.abs().sum()) == 0


def test_refusals():
    from qwick.kernels.w8_half2 import w8_half2_gemv

    dev = triton_device()
    ws = gemv_workspace(dev)
    w = torch.zeros(64, 512, dtype=torch.int8, device=dev)
    one = torch.ones(1, 1, device=dev)
    with pytest.raises(ValueError, match="codes of the weight's type"):
        w8_half2_gemv(
            torch.zeros(1, 512, device=dev).to(FP8_DTYPE),
            one,
            w,
            torch.ones(64, device=dev),
            None,
            ws,
            torch.bfloat16,
        )
    with pytest.raises(ValueError, match="do not fit"):
        w8_half2_gemv(
            w[:1],
            one,
            w,
            torch.ones(64, device=dev),
            None,
            ws,
            torch.bfloat16,
            config=RowGemvConfig(64, 24, 1),
        )
