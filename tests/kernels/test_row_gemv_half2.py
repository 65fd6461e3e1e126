"""GPU-only checks of the f16x2 int4 GEMV's PTX paths that Triton's interpreter never runs (it emulates the
products in fp32, `EMULATE`); the kernel's other tests are in test_row_gemv.py."""

from __future__ import annotations

import pytest
import torch

from qwick.quantization.formats import rtn
from tests.triton_utils import gemv_workspace, triton_device

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 18944), (1000, 896)])
@pytest.mark.parametrize("paired", [False, True])
def test_pairs_loaded_a_word_at_a_time_give_the_same_bits(n, k, paired, monkeypatch):
    """`PAIRS_BY_WORD`: the activations' pairs loaded as four [C, 4] tiles, not one [C, 4, 4]. Bit for bit
    the outputs of the one tile, from bf16 activations paired in registers and from the producer's pairs,
    plain, launched early, with the norm in the tail and gated, at the default launch shapes, 16- and
    8-word tiles and the prefetch."""
    import qwick.kernels.row_gemv_half2 as H
    from qwick.kernels.row_gemv import RowGemvConfig
    from qwick.layers.linear import HalfPairs, NormAfter

    dev = triton_device()
    ws = gemv_workspace(dev)
    gen = torch.Generator().manual_seed(n + k)
    qw = rtn.quantize(torch.randn(n, k, generator=gen) / k**0.5, group_size=128).to(dev)
    x = (torch.randn(1, k, generator=gen) * 2).to(dev, torch.bfloat16)
    b = torch.randn(n, generator=gen).to(dev, torch.bfloat16)
    norm_w = (torch.rand(n, generator=gen) + 0.5).to(dev, torch.bfloat16)
    residual = (torch.randn(1, n, generator=gen) * 4).to(dev, torch.bfloat16)
    pairs = H.half_pairs(x) if paired else None
    kw = k // 8
    cfgs = [
        H.default_half2_config(n, kw, ws.num_sms),
        RowGemvConfig(64, H.tile_words_for(kw), 8, num_warps=8),
        RowGemvConfig(16, 16, 4),
        RowGemvConfig(16, 8, 1),
        RowGemvConfig(32, 16, 5, prefetch=True),
    ]
    gate_up = n % 16 == 0  # n rows can be read as a [gate | up] weight by 16-row tiles of one split
    runs: list[list[torch.Tensor]] = []
    for by_word in (False, True):
        monkeypatch.setattr(H, "PAIRS_BY_WORD", by_word)
        outs = []
        for cfg in cfgs:
            for early in ({}, {"preload": True, "trigger": True}):
                outs.append(H.w4_half2_gemv(x, qw, b, ws, cfg, pairs=pairs, **early))
                res = residual.clone()
                norm = NormAfter(norm_w, 1e-6, res, HalfPairs(H.X_DIV))
                normed = H.w4_half2_normed(x, qw, b, ws, norm, cfg, pairs, **early)
                outs += [res, normed.x, normed.pairs]
                if gate_up and cfg.split_k == 1 and cfg.block_n % 16 == 0:
                    gated = H.w4_half2_gated(x, qw, b, ws, cfg, pairs, HalfPairs(H.X_DIV), **early)
                    outs += [gated.x, gated.pairs]
        runs.append(outs)
    assert len(runs[0]) == len(runs[1]) >= 4 * len(cfgs)
    for new, old in zip(*runs, strict=True):
        assert torch.equal(new, old)
    assert int(ws.counters.abs().sum()) == 0
