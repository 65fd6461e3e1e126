"""The one-row GEMV on 8-bit codes (`qwick.kernels.row_gemv_w8`) against float64 codes-times-x (its use
for one fp8 decode row in `W8A8LinearMethod`: tests/kernels/test_w8a8_kernels.py and
tests/quantization/test_w8a8_layer.py).

fp8 e4m3 and int8 codes, bias or none, split-K with a split that gets no tile of K (counters reset on a
second call), the register prefetch, N not a multiple of the tile and K of 128-code tiles; launched early
with its first tiles preloaded (`preload`), the same bits; every int8 code converted exactly. With
TRITON_INTERPRET=1 the kernel runs on the CPU at small shapes.
"""

from __future__ import annotations

import pytest
import torch

from qwick.kernels.row_gemv import RowGemvConfig
from qwick.quantization.w8a8 import FP8_DTYPE, quantize_weight_per_channel
from tests.triton_utils import INTERPRET, gemv_workspace, triton_device

pytestmark = [pytest.mark.gpu, pytest.mark.interpret]

# (N, K): qwen2.5-7b's o projection and a ragged N with 128-code tiles (K = 896: qwen2.5-0.5b's hidden size)
SHAPES = [(3584, 3584), (1000, 896)] if not INTERPRET else [(40, 512), (24, 384)]
X_DTYPE = torch.float32 if INTERPRET else torch.bfloat16  # the interpreter rounds fp32 -> bf16 toward zero


def _configs(n: int, k: int, ws):
    from qwick.kernels.row_gemv_w8 import default_w8_row_config, w8_row_block_k

    bk = w8_row_block_k(k)
    return [
        None,  # the default
        default_w8_row_config(n, k, ws.num_sms),
        RowGemvConfig(32, bk, 1),
        RowGemvConfig(16, bk, 2, prefetch=True),
        RowGemvConfig(16, 128, 4),  # at K = 384, the fourth split has no tile
    ]


@pytest.mark.parametrize("qdtype", [FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", SHAPES)
def test_row_gemv_matches_float64(qdtype, bias, n, k):
    from qwick.kernels.row_gemv_w8 import w8_row_gemv

    dev = triton_device()
    ws = gemv_workspace(dev)
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) / k**0.5
    codes, scale = quantize_weight_per_channel(w, qdtype)
    x = torch.randn(1, k, generator=gen).to(X_DTYPE)
    b = torch.randn(n, generator=gen).to(X_DTYPE) if bias else None
    ref = (x.double() @ codes.double().T) * scale.double().view(1, -1)
    if b is not None:
        ref = ref + b.double()
    codes, scale, x = codes.to(dev), scale.to(dev), x.to(dev)
    b = b.to(dev) if b is not None else None
    for cfg in _configs(n, k, ws):
        for _ in range(2):  # the second call finds the split-K counters reset
            y = w8_row_gemv(x, codes, scale, b, ws, cfg)
            assert y.shape == (1, n) and y.dtype == x.dtype
            err = ((y.double().cpu() - ref).norm() / ref.norm()).item()
            assert err < 4e-3, (cfg, err)
            # its first two tiles loaded before the wait (launched early on a GPU with PDL): the same bits
            assert torch.equal(w8_row_gemv(x, codes, scale, b, ws, cfg, preload=True), y), cfg


def test_every_int8_code_is_its_value():
    """int8 codes become fp32 through their float bits on a GPU (`_int8_f32_asm`): each of the 256 values,
    -128 included (symmetric quantization never writes it), in every byte of a word, against float64 sums
    at fp32 precision, where one code off by one moves a sum by ~0.5."""
    from qwick.kernels.row_gemv_w8 import w8_row_gemv

    dev = triton_device()
    ws = gemv_workspace(dev)
    n, k = 64, 256
    codes = ((torch.arange(k)[None, :] + 7 * torch.arange(n)[:, None]) % 256 - 128).to(torch.int8)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0))
    scale = torch.ones(n)
    ref = x.double() @ codes.double().T
    for cfg in (RowGemvConfig(16, 256, 1), RowGemvConfig(32, 128, 2)):
        y = w8_row_gemv(x.to(dev), codes.to(dev), scale.to(dev), None, ws, cfg)
        torch.testing.assert_close(y.double().cpu(), ref, rtol=0, atol=1e-3, msg=str(cfg))


def test_row_gemv_rejects_what_it_cannot_take():
    from qwick.kernels.row_gemv_w8 import w8_row_gemv

    dev = triton_device()
    ws = gemv_workspace(dev)
    codes, scale = quantize_weight_per_channel(torch.randn(32, 256), FP8_DTYPE)
    codes, scale = codes.to(dev), scale.to(dev)
    x = torch.randn(1, 256, dtype=X_DTYPE, device=dev)
    with pytest.raises(ValueError, match="needs x"):
        w8_row_gemv(torch.randn(2, 256, dtype=X_DTYPE, device=dev), codes, scale, None, ws)
    with pytest.raises(ValueError, match="must be float8_e4m3fn or int8"):
        w8_row_gemv(x, codes.float(), scale, None, ws)
    with pytest.raises(ValueError, match="scale must be fp32"):
        w8_row_gemv(x, codes, scale.half(), None, ws)
    with pytest.raises(ValueError, match="multiple of the tile depth"):
        w8_row_gemv(x, codes, scale, None, ws, RowGemvConfig(16, 512, 1))
    odd, odd_scale = quantize_weight_per_channel(torch.randn(32, 200), FP8_DTYPE)
    with pytest.raises(ValueError, match="multiple of 128"):
        w8_row_gemv(torch.randn(1, 200, dtype=X_DTYPE, device=dev), odd.to(dev), odd_scale.to(dev), None, ws)
