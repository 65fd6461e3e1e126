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


@pytest.mark.parametrize("inter,k", [(48, 512), (40, 1100)] if INTERPRET else [(18944, 3584), (4864, 896)])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_gated_gemv_is_silu_and_mul_of_the_gemv(inter, k, m):
    """`gemv(..., gated=True)` on a [gate | up] weight: bit for bit `silu_and_mul` of the plain GEMV at the
    same launch shape, with a bias, at 1-16 rows, tiles of 16-64 rows, a K that is not a multiple of the
    tile, an intermediate size that is not a multiple of the tile's half (40), and the 7b and 0.5b gate/up
    projections at their default launches on GPUs."""
    from qwick.kernels.elementwise import silu_and_mul
    from qwick.kernels.gemv import GemvConfig, gated_config, gemv

    dev = triton_device()
    dtype = torch.float16 if INTERPRET else torch.bfloat16
    ws = gemv_workspace(dev)
    n = 2 * inter
    w = torch.randn(n, k, device=dev, dtype=dtype) / k**0.5
    b = torch.randn(n, device=dev, dtype=dtype)
    cfgs = [GemvConfig(32, 128, 1, num_stages=3), GemvConfig(16, 256, 1), GemvConfig(64, 128, 1)]
    if gated_config(ws, m, n, k) is not None:
        cfgs.append(gated_config(ws, m, n, k))
    for cfg in cfgs:
        x = torch.randn(m, k, device=dev, dtype=dtype)
        want = silu_and_mul(gemv(x, w, b, ws, cfg))
        got = gemv(x, w, b, ws, cfg, gated=True)
        assert got.shape == (m, inter) and torch.equal(got, want), cfg
    with pytest.raises(ValueError, match="one split"):
        gemv(x, w, b, ws, GemvConfig(32, 128, 2), gated=True)
