"""The packed-fp16 batch-1 int4 GEMV (`qwick.kernels.row_gemv_half2`) against float64 dequantize-then-matmul.

Integer codes, zero points and small integer inputs with unit scales give exact integer sums (fp16 holds
them), so any wrong nibble, pair or group shows as a mismatch; then whole products at the qwen2.5-7b decode
shapes with split-K, bias, zero-point tensors, symmetric int4 with act-order, 64-, 128- and 256-wide
groups, and tiles of 8-32 words. Under TRITON_INTERPRET=1 the kernel's fp32 emulation runs on the CPU (the
interpreter runs no PTX), so the GPU run is what checks the inline assembly.
"""

from __future__ import annotations

import pytest
import torch

from qwick.quantization.formats import gptq, rtn
from qwick.quantization.formats.layout import QuantizedWeight, dequantize, pack_along_k
from tests.triton_utils import INTERPRET, gemv_workspace, triton_device

pytestmark = [pytest.mark.gpu, pytest.mark.interpret]

# (N, K): qwen2.5-7b qkv, o, gate_up, down; an N that is not a multiple of the tile, a K of 112 words
SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (1000, 896)]
if INTERPRET:
    SHAPES = [(96, 512), (40, 896)]
X_DTYPES = [torch.float16] if INTERPRET else [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("group", [64, 128, 256])
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("x_dtype", X_DTYPES)
def test_every_nibble_and_group_decodes_exactly(group, zeros, x_dtype):
    from qwick.kernels.row_gemv import RowGemvConfig
    from qwick.kernels.row_gemv_half2 import w4_half2_gemv

    dev = triton_device()
    gen = torch.Generator().manual_seed(group)
    n, k = 48, 4 * 256
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    z = torch.randint(0, 16, (n, k // group), generator=gen, dtype=torch.int32)
    weight = QuantizedWeight(
        qweight=pack_along_k(q, 4),
        scales=torch.ones(n, k // group),
        bits=4,
        group_size=group,
        zeros=z.to(torch.uint8) if zeros else None,
        zero_point=0 if zeros else 8,
    ).to(dev)
    x = torch.randint(-3, 4, (1, k), generator=gen).float()
    w = q - (z.repeat_interleave(group, dim=1) if zeros else 8)
    expected = (x.long() @ w.long().T).float().to(x_dtype)
    ws = gemv_workspace(dev)
    for cfg in (None, RowGemvConfig(16, 8, 2), RowGemvConfig(32, 16, 1)):
        y = w4_half2_gemv(x.to(dev, x_dtype), weight, None, ws, cfg)
        assert y.dtype == x_dtype and torch.equal(y.cpu(), expected), cfg


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("form", ["rtn", "gptq_sym_act_order"])
def test_w4_half2_gemv_matches_dequantized_matmul(n, k, form):
    from qwick.kernels.row_gemv import RowGemvConfig
    from qwick.kernels.row_gemv_half2 import default_half2_config, w4_half2_gemv

    dev = triton_device()
    ws = gemv_workspace(dev)
    act = torch.float16 if INTERPRET else torch.bfloat16
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) / k**0.5
    if form == "rtn":  # asymmetric: a zero-point tensor
        qw = rtn.quantize(w, group_size=128).to(dev)
    else:  # symmetric (zero point 8) with a permuted K
        order = torch.randperm(k, generator=gen)
        qw = gptq.to_internal(**gptq.quantize(w, 128, sym=True, act_order=order)).to(dev)
    w_deq = dequantize(qw).double()  # [N, K] in the input channels' order
    b = torch.randn(n, device=dev, dtype=act)
    kw = k // 8
    configs = [default_half2_config(n, kw, ws.num_sms), RowGemvConfig(32, 8, 3), RowGemvConfig(64, 16, 1)]
    for cfg in configs:
        for _ in range(2):  # a second call reuses the self-reset split-K counters
            x = torch.randn(1, k, device=dev, dtype=act) * 4
            ref = x.double() @ w_deq.T + b.double()
            out = w4_half2_gemv(x, qw, b, ws, cfg)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 4e-3, (cfg, err)
    assert int(ws.counters.abs().sum()) == 0


def test_refusals():
    from qwick.kernels.row_gemv import RowGemvConfig
    from qwick.kernels.row_gemv_half2 import tile_words_for, w4_half2_gemv

    dev = triton_device()
    qw = rtn.quantize(torch.randn(64, 896), group_size=128).to(dev)  # 112 words per row
    ws = gemv_workspace(dev)
    with pytest.raises(ValueError, match="bf16/fp16"):
        w4_half2_gemv(torch.randn(1, 896, device=dev), qw, None, ws)
    with pytest.raises(ValueError, match="do not fit"):
        w4_half2_gemv(torch.randn(1, 896, device=dev).half(), qw, None, ws, RowGemvConfig(64, 32, 1))
    assert tile_words_for(112) == 16 and tile_words_for(448) == 32 and tile_words_for(8 * 13) == 8
