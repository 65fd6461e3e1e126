"""The batch-1 GEMVs that make their own input (`qwick.kernels.fused_gemv`) against the unfused layers in
float64: RMSNorm (residual add included) or SiLU-and-mul in PyTorch, then the matmul; bf16 / fp16
weights, 8-bit weights with unquantized activations (W8A16) and codes times codes (W8A8). The residual
the norm hands on is `x + residual` bit for bit; split-K launch shapes, a second call (the counters reset
themselves), a bias, K not a multiple of the tile.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwick.layers.linear import RowQuant
from qwick.layers.norm import RMSNorm
from qwick.quantization.w8a8 import (
    FP8_DTYPE,
    qmax,
    quantize_per_token_group,
    quantize_weight_per_channel,
)
from tests.triton_utils import INTERPRET, gemv_workspace, triton_device

pytestmark = [pytest.mark.gpu, pytest.mark.interpret]

# (N, K): qwen2.5-7b qkv, gate/up and down; small odd shapes under the interpreter
NORM_SHAPES = [(96, 512), (40, 1100)] if INTERPRET else [(4608, 3584), (37888, 3584), (7168, 5120)]
SILU_SHAPES = [(96, 1024), (40, 1100)] if INTERPRET else [(3584, 18944), (5120, 13824)]
WEIGHTS = ["16-bit", "fp8-w8a16", "int8-w8a16", "int8-w8a8"]
if not INTERPRET:  # the interpreter's fp32 -> fp8 conversion is wrong near powers of two (31.1 -> 16)
    WEIGHTS.append("fp8-w8a8")


def _dtype() -> torch.dtype:
    return torch.float32 if INTERPRET else torch.bfloat16


def _weights(form: str, n: int, k: int, dev: torch.device, gen: torch.Generator):
    """(weight, weight_scale, quant, its float64 dequantized form) for a weight form of `WEIGHTS`."""
    w = torch.randn(n, k, generator=gen, device=dev) / k**0.5
    if form == "16-bit":
        w = w.to(_dtype())
        return w, None, None, w.double()
    qdtype = FP8_DTYPE if form.startswith("fp8") else torch.int8
    wq, ws = quantize_weight_per_channel(w, qdtype)
    quant = RowQuant(qdtype, qmax(qdtype), 1e-10) if form.endswith("w8a8") else None
    return wq, ws, quant, wq.double() * ws.double()


def _configs(ws, n: int, k: int, weight: torch.Tensor, quant: RowQuant | None):
    from qwick.kernels.gemv import GemvConfig

    default = ws.config_for(1, n, k, weight.element_size(), quant is not None)
    return [default, GemvConfig(32, 128, 1), GemvConfig(16, 256, 4), GemvConfig(64, 128, 8, num_stages=3)]


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("form", WEIGHTS)
@pytest.mark.parametrize("n,k", NORM_SHAPES)
@pytest.mark.parametrize("residual", [True, False])
def test_norm_gemv_matches_norm_then_matmul(form, n, k, residual):
    from qwick.kernels.fused_gemv import norm_gemv

    dev = triton_device()
    dtype = _dtype()
    ws = gemv_workspace(dev)
    gen = torch.Generator(device=dev).manual_seed(n + k)
    w, wscale, quant, w_ref = _weights(form, n, k, dev, gen)
    bias = torch.randn(n, generator=gen, device=dev).to(dtype)
    norm = RMSNorm(k, 1e-6).to(dev)
    norm.weight.data = (torch.rand(k, generator=gen, device=dev) + 0.5).to(dtype)
    tol = 1e-5 if INTERPRET else 5e-3
    for cfg in _configs(ws, n, k, w, quant):
        for _ in range(2):
            x = torch.randn(1, k, generator=gen, device=dev).to(dtype) * 3
            res = torch.randn(1, k, generator=gen, device=dev).to(dtype) if residual else None
            x_before = x.clone()
            y, h = norm_gemv(x, res, norm.weight, norm.eps, w, ws, wscale, bias, quant, cfg)
            if residual:
                normed, h_ref = norm.forward_native(x, res)
                assert torch.equal(h, h_ref) and h.data_ptr() not in (x.data_ptr(), res.data_ptr())
            else:
                normed, h_ref = norm.forward_native(x), x
                assert h is x
            assert torch.equal(x, x_before)
            if quant is None:  # transformers' arithmetic
                ref = normed.double() @ w_ref.T + bias.double()
            else:  # h * g in codes with a scale per tile, times the row's rstd
                hd = h_ref.double()
                rstd = (hd.pow(2).mean(-1, keepdim=True) + norm.eps).rsqrt()
                codes, scales = quantize_per_token_group(
                    (hd * norm.weight.double()).float(), quant.dtype, cfg.block_k
                )
                x_deq = codes.double() * scales.double().repeat_interleave(cfg.block_k, dim=1)[:, :k]
                ref = (x_deq * rstd) @ w_ref.T + bias.double()
            assert y.shape == (1, n) and y.dtype == dtype and torch.isfinite(y).all()
            assert _rel_err(y, ref) < tol, (cfg, _rel_err(y, ref))
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.parametrize("form", WEIGHTS)
@pytest.mark.parametrize("n,k", SILU_SHAPES)
def test_silu_gemv_matches_silu_then_matmul(form, n, k):
    from qwick.kernels.fused_gemv import silu_gemv

    dev = triton_device()
    dtype = _dtype()
    ws = gemv_workspace(dev)
    gen = torch.Generator(device=dev).manual_seed(n * k)
    w, wscale, quant, w_ref = _weights(form, n, k, dev, gen)
    bias = torch.randn(n, generator=gen, device=dev).to(dtype)
    tol = 1e-5 if INTERPRET else 5e-3
    for cfg in _configs(ws, n, k, w, quant):
        for _ in range(2):
            # columns of growing size: the per-tile scales of the codes differ from a per-row one
            x = torch.randn(1, 2 * k, generator=gen, device=dev) * torch.linspace(0.2, 4, 2 * k, device=dev)
            x = x.to(dtype)
            gate, up = x.chunk(2, dim=-1)
            act = F.silu(gate) * up
            if quant is None:
                ref = act.double() @ w_ref.T + bias.double()
            else:
                codes, scales = quantize_per_token_group(act, quant.dtype, cfg.block_k)
                x_deq = codes.double() * scales.double().repeat_interleave(cfg.block_k, dim=1)[:, :k]
                ref = x_deq @ w_ref.T + bias.double()
            y = silu_gemv(x, w, ws, wscale, bias, quant, cfg)
            assert y.shape == (1, n) and y.dtype == dtype and torch.isfinite(y).all()
            assert _rel_err(y, ref) < tol, (cfg, _rel_err(y, ref))
    assert int(ws.counters.abs().sum()) == 0
