"""GPTQ tensors (Qwen's -GPTQ-Int4 format): packing, the zero-minus-one convention, act-order g_idx."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwick.quantization.formats import gptq
from qwick.quantization.formats.layout import dequantize
from qwick.quantization.formats.reference import dequant_matmul
from tests.quantization.formats.refs import (
    dequant_groups,
    gptq_pack_rows,
    gptq_pack_zeros,
    rtn_reference,
)


def test_known_words():
    """Rows 0..7 holding 0..7 pack into 0x76543210; symmetric zero 8 is stored 7 (0x77777777) in v1."""
    q = torch.arange(8, dtype=torch.uint8).view(8, 1).expand(8, 8).t().contiguous()  # [N=8, K=8]
    zeros = torch.full((8, 1), 8, dtype=torch.uint8)
    packed = gptq.pack(q, zeros, torch.ones(8, 1), torch.zeros(8, dtype=torch.int64))
    assert packed["qweight"].tolist() == [[0x76543210] * 8]
    assert packed["qzeros"].tolist() == [[0x77777777]]  # 2004318071, as in Qwen's GPTQ-Int4 files
    v2 = gptq.pack(q, zeros, torch.ones(8, 1), torch.zeros(8, dtype=torch.int64), zero_offset=0)
    assert v2["qzeros"].tolist() == [[np.int32(np.uint32(0x88888888)).item()]]
    assert torch.equal(gptq.unpack(**packed)[1], zeros)
    assert torch.equal(gptq.unpack(**v2, zero_offset=0)[1], zeros)


def _random_parts(n: int, k: int, g: int, shuffled: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (n, k // g), generator=gen, dtype=torch.uint8)  # 0 included
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 1e-4).to(torch.float16)
    g_idx = torch.arange(k) // g
    if shuffled:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return q, zeros, scales, g_idx


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("offset", [1, 0])
def test_pack_matches_autogptq_loops_and_round_trips(shuffled, offset):
    q, zeros, scales, g_idx = _random_parts(40, 384, 128, shuffled)
    packed = gptq.pack(q, zeros, scales, g_idx, zero_offset=offset)
    assert packed["qweight"].shape == (48, 40) and packed["qweight"].dtype == torch.int32
    assert packed["qzeros"].shape == (3, 5) and packed["qzeros"].dtype == torch.int32
    assert packed["scales"].shape == (3, 40) and packed["scales"].dtype == torch.float16
    assert packed["g_idx"].dtype == torch.int32
    assert np.array_equal(packed["qweight"].numpy(), gptq_pack_rows(q.t().numpy()))
    assert np.array_equal(packed["qzeros"].numpy(), gptq_pack_zeros(zeros.t().numpy(), offset))
    uq, uz, us, ug = gptq.unpack(**packed, zero_offset=offset)
    assert torch.equal(uq, q) and torch.equal(uz, zeros) and torch.equal(us, scales)
    assert torch.equal(ug, g_idx)


@pytest.mark.parametrize("shuffled", [False, True])
def test_dequantize_equals_float_reference(shuffled):
    q, zeros, scales, g_idx = _random_parts(24, 256, 128, shuffled, seed=5)
    checkpoint = {
        "qweight": torch.from_numpy(gptq_pack_rows(q.t().numpy())),
        "qzeros": torch.from_numpy(gptq_pack_zeros(zeros.t().numpy(), 1)),
        "scales": scales.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }
    expect = dequant_groups(
        q.numpy().astype(np.int64), zeros.numpy().astype(np.int64), scales.numpy(), g_idx.numpy()
    )
    assert np.array_equal(gptq.dequantize(**checkpoint).numpy(), expect)
    if not shuffled:  # checkpoints without g_idx: consecutive groups
        del checkpoint["g_idx"]
        assert np.array_equal(gptq.dequantize(**checkpoint).numpy(), expect)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_quantize_equals_independent_rtn(sym, act_order):
    torch.manual_seed(7)
    n, k, g = 32, 512, 128
    w = torch.randn(n, k) * 0.02
    order = torch.randperm(k) if act_order else None
    packed = gptq.quantize(w, g, sym=sym, act_order=order)
    g_idx = packed["g_idx"].long()
    if act_order:
        assert not bool((g_idx[1:] >= g_idx[:-1]).all())  # non-monotonic, as desc_act checkpoints are
    assert torch.equal(torch.bincount(g_idx), torch.full((k // g,), g))
    cols = np.arange(k) if order is None else order.numpy()
    rq, rz, rs = rtn_reference(w.numpy()[:, cols], g, sym)
    expect = np.empty((n, k), dtype=np.float32)
    expect[:, cols] = dequant_groups(rq, rz, rs, np.arange(k) // g)
    dq = gptq.dequantize(**packed)
    assert np.array_equal(dq.numpy(), expect)
    scale_per_elem = packed["scales"].float()[g_idx].t()
    assert bool(((w - dq).abs() <= scale_per_elem / 2 * (1 + 1e-6)).all())
    if sym:
        assert bool((packed["qzeros"] == 0x77777777).all())


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_to_internal_preserves_values(sym, act_order):
    torch.manual_seed(11)
    w = torch.randn(48, 384)
    packed = gptq.quantize(w, 128, sym=sym, act_order=torch.randperm(384) if act_order else None)
    internal = gptq.to_internal(**packed)
    assert internal.group_size == 128 and internal.shape == (48, 384)
    assert (internal.perm is not None) == act_order
    assert (internal.zeros is None and internal.zero_point == 8) if sym else internal.zeros is not None
    reference = gptq.dequantize(**packed)
    assert torch.equal(dequantize(internal), reference)
    if act_order:  # stored columns are grouped: each run of 128 has one group index
        g_sorted = packed["g_idx"].long()[internal.perm]
        assert torch.equal(g_sorted, torch.arange(384) // 128)
    x = torch.randn(5, 384, dtype=torch.float64)
    out = dequant_matmul(x, internal)
    torch.testing.assert_close(out, x @ reference.double().T, rtol=1e-12, atol=1e-12)


def test_v1_zero_point_zero_round_trips():
    """Asymmetric zero 0 is stored as 15 in v1 and read back as (15 + 1) mod 16."""
    q = torch.randint(0, 16, (8, 128), dtype=torch.uint8)
    zeros = torch.zeros(8, 1, dtype=torch.uint8)
    packed = gptq.pack(q, zeros, torch.ones(8, 1), torch.zeros(128, dtype=torch.int64))
    assert packed["qzeros"].tolist() == [[-1]]  # all nibbles 15
    assert torch.equal(gptq.unpack(**packed)[1], zeros)


def test_zero_offset_from_config():
    assert gptq.zero_offset(gptq.quantization_config()) == 1
    assert gptq.zero_offset(gptq.quantization_config(v2=True)) == 0
    with pytest.raises(ValueError):
        gptq.zero_offset({"checkpoint_format": "marlin"})
    config = gptq.quantization_config(desc_act=True, sym=False)
    assert config["quant_method"] == "gptq" and config["bits"] == 4 and config["group_size"] == 128
    assert config["desc_act"] is True and config["sym"] is False


def test_unequal_groups_are_rejected():
    q, zeros, scales, _ = _random_parts(8, 256, 128, False)
    g_idx = torch.zeros(256, dtype=torch.int64)
    g_idx[:10] = 1  # 246 channels in group 0, 10 in group 1
    with pytest.raises(ValueError, match="equal groups"):
        gptq.to_internal(**gptq.pack(q, zeros, scales, g_idx))
