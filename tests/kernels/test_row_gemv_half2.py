"""The packed-fp16 batch-1 int4 GEMV (`qwick.kernels.row_gemv_half2`) against float64 dequantize-then-matmul.

Small integer activations with unit scales make every product and every fp16 partial sum exact, so the
nibble pairing, the shifts and the zero points are checked for equality; real weights at the qwen2.5-7b
decode shapes within the tolerance of an fp16 sum of 32 products and a bf16 output. Under
TRITON_INTERPRET=1 the kernel runs its fp32 emulation of the PTX (small shapes).
"""

from __future__ import annotations

import pytest
import torch

from qwick.quantization.formats import gptq, rtn
from qwick.quantization.formats.layout import QuantizedWeight, dequantize, pack_along_k
from tests.triton_utils import INTERPRET, gemv_workspace, triton_device

pytestmark = [pytest.mark.gpu, pytest.mark.interpret]

SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (1000, 1024)]
if INTERPRET:
    SHAPES = [(96, 512), (40, 768)]
# the interpreter rounds fp32 -> bf16 toward zero, so bf16 outputs are checked on GPUs only
X_DTYPES = [torch.float16] + ([] if INTERPRET else [torch.bfloat16])


@pytest.mark.parametrize("x_dtype", X_DTYPES + [torch.float32])
def test_pairs_are_the_fp16_activations_in_nibble_order(x_dtype):
    from qwick.kernels.row_gemv_half2 import X_DIV, half2_pairs

    dev = triton_device()
    x = (torch.randn(1, 8 * 300, generator=torch.Generator().manual_seed(1)) * 50).to(x_dtype)
    got = half2_pairs(x.to(dev)).cpu()
    xf = (x.float().reshape(-1, 8) / X_DIV).half()
    want = torch.stack([xf[:, :4], xf[:, 4:]], dim=-1).contiguous().view(torch.int32).reshape(-1, 4)
    assert torch.equal(got, want)


@pytest.mark.parametrize("group", [64, 128, 256])
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("x_dtype", X_DTYPES)
def test_every_nibble_pair_decodes_exactly(group, zeros, x_dtype):
    """Codes 0-15 at every position, zero points 0-15, unit scales, x in -3..3: each fp16 partial sum is
    exact (a multiple of 1/64 below 32), so any wrong pairing, shift or zero point shows as a mismatch."""
    from qwick.kernels.row_gemv_half2 import w4_half2_gemv

    dev = triton_device()
    gen = torch.Generator().manual_seed(group)
    n, k = 48, 4 * group
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
    y = w4_half2_gemv(x.to(dev, x_dtype), weight, None, gemv_workspace(dev))
    assert y.dtype == x_dtype and torch.equal(y.cpu(), expected)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("form", ["rtn", "gptq_sym_act_order"])
def test_w4_half2_gemv_matches_dequantized_matmul(n, k, form):
    from qwick.kernels.row_gemv import RowGemvConfig, default_w4_config
    from qwick.kernels.row_gemv_half2 import w4_half2_gemv

    dev = triton_device()
    ws = gemv_workspace(dev)
    act = X_DTYPES[-1]
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) / k**0.5
    if form == "rtn":  # asymmetric: a zero-point tensor
        qw = rtn.quantize(w, group_size=128).to(dev)
    else:  # symmetric (zero point 8) with a permuted K
        order = torch.randperm(k, generator=gen)
        qw = gptq.to_internal(**gptq.quantize(w, 128, sym=True, act_order=order)).to(dev)
    w_deq = dequantize(qw).double()
    b = torch.randn(n, device=dev, dtype=act)
    configs = [
        default_w4_config(n, k // 8, 16, ws.num_sms),
        RowGemvConfig(32, 16, 4),
        RowGemvConfig(128, 16, 2),
    ]
    for cfg in configs:
        for _ in range(2):  # split-K counters reset themselves
            x = (torch.randn(1, k, device=dev) * 4).to(act)
            ref = x.double() @ w_deq.T + b.double()
            out = w4_half2_gemv(x, qw, b, ws, cfg)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 5e-3, (cfg, err)
    assert int(ws.counters.abs().sum()) == 0


def test_prefetch_and_mismatched_tiles_are_refused():
    from qwick.kernels.row_gemv import RowGemvConfig
    from qwick.kernels.row_gemv_half2 import w4_half2_gemv

    dev = triton_device()
    qw = rtn.quantize(torch.randn(64, 256), group_size=128).to(dev)
    x = torch.randn(1, 256, device=dev).half()
    with pytest.raises(ValueError, match="one group deep"):
        w4_half2_gemv(x, qw, None, gemv_workspace(dev), RowGemvConfig(64, 16, 1, prefetch=True))
    with pytest.raises(ValueError, match="one group deep"):
        w4_half2_gemv(x, qw, None, gemv_workspace(dev), RowGemvConfig(64, 8, 1))
