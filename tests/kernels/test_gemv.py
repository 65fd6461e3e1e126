"""The skinny-GEMM kernel against a float64 matmul, over the decode shapes of the 7B and 14B models.

Checks: the whole output against the reference (no NaN, relative error of bf16 size); split-K reductions,
also on a second call (the tile counters reset themselves); bias; M from 1 to 16; K not a multiple of the
tile; several launch shapes.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_utils import INTERPRET, gemv_workspace, triton_device

pytestmark = [pytest.mark.gpu, pytest.mark.interpret]

# (N, K): qwen2.5-7b qkv, o, gate_up, down; qwen2.5-14b qkv, down; odd sizes
SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (7168, 5120), (5120, 13824), (1000, 900)]
if INTERPRET:
    SHAPES = [(96, 512), (40, 1100)]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_float64(n, k, m, bias):
    from qwick.kernels.gemv import GemvConfig, default_config, gemv

    dev = triton_device()
    dtype = torch.float16 if INTERPRET else torch.bfloat16
    ws = gemv_workspace(dev)
    w = torch.randn(n, k, device=dev, dtype=dtype) / k**0.5
    b = torch.randn(n, device=dev, dtype=dtype) if bias else None
    ref = None
    configs = [
        default_config(m, n, k, ws.num_sms),
        GemvConfig(16, 128, 1),
        GemvConfig(32, 256, 4),
        GemvConfig(64, 128, 8, num_stages=3),
    ]
    for cfg in configs:
        for _ in range(2):  # a second call with fresh inputs reuses the self-reset split-K counters
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = x.double() @ w.double().T + (b.double() if bias else 0)
            out = gemv(x, w, b, ws, cfg)
            assert out.shape == (m, n) and not out.isnan().any()
            assert _rel_err(out, ref) < 1e-2, (cfg, _rel_err(out, ref))
    assert int(ws.counters.abs().sum()) == 0
