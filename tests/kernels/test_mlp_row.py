"""The one-launch W8A8 MLP of one decode row (`qwick.kernels.mlp_row`) and the norm that reads its sums
(`rms_norm(clear_x=True)`).

The kernel against a float64 replica of its arithmetic (gate and up rounded to the model dtype, SiLU-and-mul
as the unfused kernels round it, h quantized per 128 channels, codes times codes): fp8 e4m3 and int8, the
qwen2.5-7b shapes and a small one; a second call into the re-zeroed accumulator gives the same bits (the
fixed-point sums do not depend on the atomics' order). The norm: the accumulator read as the layer's output
in the model dtype, the residual updated, the accumulator zero after. With TRITON_INTERPRET=1 both run on
the CPU at small shapes. The engine's use (one W8A8 decode row through `DecoderLayer`) is
tests/quantization/test_w8a8_gpu.py's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwick.quantization.w8a8 import FP8_DTYPE, quantize_per_token, quantize_per_token_group
from qwick.quantization.w8a8 import quantize_weight_per_channel as per_channel
from tests.triton_utils import INTERPRET, triton_device

# (K, I, H): qwen2.5-7b's MLP, and a small one of two programs
SHAPES = [(256, 256, 256)] if INTERPRET else [(3584, 18944, 3584), (512, 384, 768)]
DTYPE = torch.float16 if INTERPRET else torch.bfloat16  # the interpreter rounds fp32 -> bf16 toward zero
QMAX = {FP8_DTYPE: 448.0, torch.int8: 127.0}
# the interpreter truncates fp32 -> fp8 (h's codes) where the GPU rounds to nearest
QDTYPES = [torch.int8] if INTERPRET else [FP8_DTYPE, torch.int8]


def _reference(xq, xs, wgu, sgu, wd, sd, qdtype, channels: int) -> torch.Tensor:
    """float64 through the kernel's rounding points: gate and up in the model dtype, silu(gate) * up as
    the unfused kernels round it, then h's codes at one scale per `channels` channels."""
    y = ((xq.double() @ wgu.double().T) * xs.double() * sgu.double().view(1, -1)).to(DTYPE)
    gate, up = y.chunk(2, dim=1)
    h = (F.silu(gate.float()).to(DTYPE).float() * up.float()).to(DTYPE).float()
    hq, hs = quantize_per_token_group(h, qdtype, channels)
    h_deq = hq.double() * hs.double().repeat_interleave(channels, dim=1)
    return (h_deq @ wd.double().T) * sd.double().view(1, -1)


@pytest.mark.gpu
@pytest.mark.interpret
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("k,inter,hidden", SHAPES)
def test_mlp_row_matches_float64(qdtype, k, inter, hidden):
    from qwick.kernels.mlp_row import DEFAULT_CONFIG, SUM_UNIT, mlp_row_w8

    dev = triton_device()
    gen = torch.Generator().manual_seed(k + inter)
    wgu, sgu = per_channel(torch.randn(2 * inter, k, generator=gen) / k**0.5, qdtype)
    wd, sd = per_channel(torch.randn(hidden, inter, generator=gen) / inter**0.5, qdtype)
    xq, xs = quantize_per_token(torch.randn(1, k, generator=gen) * 3, qdtype)
    ref = _reference(xq, xs, wgu, sgu, wd, sd, qdtype, DEFAULT_CONFIG.channels)
    args = [t.to(dev) for t in (xq, xs, wgu, sgu.view(-1), wd, sd.view(-1))]
    sums = torch.zeros(1, hidden, device=dev, dtype=torch.int64)
    out = mlp_row_w8(*args, sums, DTYPE, QMAX[qdtype], 1e-10, preload=True)
    assert out is sums
    first = sums.clone()
    err = ((first.cpu().double() * SUM_UNIT - ref).norm() / ref.norm()).item()
    # fp32 sums in another order than float64's move gate or up by an ulp of the model dtype at times,
    # and with it an h code: far below what a wrong row, scale or channel would (errors of order 1)
    assert err < 2e-3, err
    sums.zero_()
    mlp_row_w8(*args, sums, DTYPE, QMAX[qdtype], 1e-10)  # not preloaded, atomics in another order
    assert torch.equal(sums, first)


@pytest.mark.gpu
@pytest.mark.interpret
@pytest.mark.parametrize("quantize", [False, True])
def test_norm_reads_the_sums_as_the_output_and_zeroes_them(quantize):
    from qwick.kernels.elementwise import rms_norm
    from qwick.kernels.mlp_row import SUM_UNIT
    from qwick.layers.linear import QuantizedRows, RowQuant

    dev = triton_device()
    n = 384
    gen = torch.Generator().manual_seed(3)
    sums = (torch.randn(1, n, generator=gen) * 5 / SUM_UNIT).to(dev, torch.int64)
    residual = torch.randn(1, n, generator=gen).to(dev, DTYPE)
    weight = (torch.rand(n, generator=gen) + 0.5).to(dev, DTYPE)
    quant = RowQuant(torch.int8, 127.0, 1e-10) if quantize else None
    want_res = residual.clone()
    want = rms_norm((sums.float() * SUM_UNIT).to(DTYPE), weight, 1e-6, residual=want_res, quant=quant)
    got = rms_norm(sums, weight, 1e-6, residual=residual, quant=quant, clear_x=True)
    assert torch.equal(residual, want_res)  # the rounded sums plus the residual, in the model dtype
    if quantize:
        assert isinstance(got, QuantizedRows)
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
        got, want = got.x, want.x
    assert got.dtype == DTYPE and torch.equal(got, want)
    assert not sums.any()  # zero for the next layer's sums


def test_bad_calls_are_refused_before_any_launch():
    from qwick.kernels.elementwise import rms_norm
    from qwick.kernels.mlp_row import MlpRowConfig, mlp_row_fits, mlp_row_w8

    xq = torch.zeros(1, 256, dtype=torch.int8)
    wgu, wd = torch.zeros(512, 256, dtype=torch.int8), torch.zeros(256, 256, dtype=torch.int8)
    s = torch.ones(512)
    sums = torch.zeros(1, 256, dtype=torch.int64)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        mlp_row_w8(xq, s[:1], wgu, s, wd, s[:256], sums, torch.float32, 127.0, 1e-10)
    with pytest.raises(ValueError, match="8-bit type"):
        mlp_row_w8(xq.float(), s[:1], wgu, s, wd, s[:256], sums, DTYPE, 127.0, 1e-10)
    with pytest.raises(ValueError, match="do not chain"):
        mlp_row_w8(xq, s[:1], wgu, s, wd[:, :128], s[:256], sums, DTYPE, 127.0, 1e-10)
    with pytest.raises(ValueError, match="does not tile"):
        mlp_row_w8(
            xq, s[:1], wgu, s, wd, s[:256], sums, DTYPE, 127.0, 1e-10, config=MlpRowConfig(channels=96)
        )
    assert mlp_row_fits(18944, 3584, 3584) and mlp_row_fits(13824, 5120, 5120)  # qwen2.5-7b and -14b
    assert not mlp_row_fits(4864, 896, 896)  # qwen2.5-0.5b's hidden size: the three launches
    with pytest.raises(ValueError, match="do not chain"):  # an fp32 accumulator
        mlp_row_w8(xq, s[:1], wgu, s, wd, s[:256], sums.float(), DTYPE, 127.0, 1e-10)
    with pytest.raises(ValueError, match="int64 accumulator"):
        rms_norm(sums, torch.ones(256), 1e-6, clear_x=True)
