"""The kernels' layout (`QuantizedWeight`: ints packed along K) and round-to-nearest int4 quantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwick.quantization.formats import layout, rtn
from qwick.quantization.formats.layout import QuantizedWeight, dequantize, pack_along_k, unpack_along_k
from tests.quantization.formats.refs import rtn_reference


def test_pack_along_k_known_words():
    q4 = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 15, 0, 0, 0, 0, 0, 0, 15]], dtype=torch.uint8)
    words = pack_along_k(q4, 4)
    assert words.dtype == torch.int32
    assert words.view(torch.int32).tolist() == [[0x76543210, np.int32(np.uint32(0xF000000F)).item()]]
    q8 = torch.tensor([[1, 2, 3, 4, 255, 0, 0, 128]], dtype=torch.uint8)
    assert pack_along_k(q8, 8).tolist() == [[0x04030201, np.int32(np.uint32(0x800000FF)).item()]]


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip(bits):
    q = torch.randint(0, 1 << bits, (37, 64), dtype=torch.uint8)
    packed = pack_along_k(q, bits)
    assert packed.shape == (37, 64 * bits // 32)
    assert torch.equal(unpack_along_k(packed, bits), q)


def test_pack_rejects_out_of_range():
    with pytest.raises(ValueError):
        pack_along_k(torch.full((1, 8), 16), 4)
    with pytest.raises(ValueError):
        pack_along_k(torch.zeros(1, 12, dtype=torch.uint8), 4)


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rtn_matches_independent_reference(sym, dtype):
    torch.manual_seed(0)
    w = (torch.randn(24, 384) * 0.05).to(dtype)
    w[0, :128] = 0.0  # an all-zero group
    w[1, 128:256] = w[1, 128:256].abs() + 0.01  # all positive: zero point 0 (asym)
    w[2, :128] = -0.25  # constant negative group
    q, zeros, scales = rtn.quantize_groups(w, 128, sym=sym)
    rq, rz, rs = rtn_reference(w.float().numpy(), 128, sym)
    assert np.array_equal(scales.numpy(), rs)
    assert np.array_equal(zeros.numpy().astype(np.int64), rz)
    assert np.array_equal(q.numpy().astype(np.int64), rq)
    if not sym:
        assert int(zeros[1, 1]) == 0


@pytest.mark.parametrize("sym", [False, True])
def test_rtn_error_bound(sym):
    """|w - dq| <= scale / 2 for every element (the scale is rounded up to fp16, so the range fits)."""
    torch.manual_seed(1)
    w = torch.randn(64, 512) * torch.logspace(-4, 1, 64).unsqueeze(1)
    qw = rtn.quantize(w, 128, sym=sym)
    dq = dequantize(qw)
    bound = qw.scales.float().repeat_interleave(128, dim=1) / 2
    assert bool(((w - dq).abs() <= bound * (1 + 1e-6)).all())
    assert torch.equal(dequantize(rtn.quantize(torch.zeros(2, 128))), torch.zeros(2, 128))


def test_rtn_quantize_layout():
    w = torch.randn(16, 256)
    asym = rtn.quantize(w)
    assert asym.qweight.shape == (16, 32) and asym.scales.dtype == torch.float16
    assert asym.zeros is not None and asym.zeros.dtype == torch.uint8 and asym.zeros.shape == (16, 2)
    sym = rtn.quantize(w, sym=True)
    assert sym.zeros is None and sym.zero_point == 8
    q, zeros, scales = rtn.quantize_groups(w, 128)
    manual = ((q.float().view(16, 2, 128) - zeros.float().unsqueeze(-1)) * scales.float().unsqueeze(-1)).view(
        16, 256
    )
    assert torch.equal(dequantize(asym), manual)


def test_dequantize_modes_and_perm():
    q = torch.randint(0, 16, (4, 64), dtype=torch.uint8)
    scales = torch.rand(4, 2) + 0.5
    mins = torch.rand(4, 2)
    packed = pack_along_k(q, 4)
    with_mins = QuantizedWeight(packed, scales, bits=4, group_size=32, mins=mins)
    expect = q.float() * scales.repeat_interleave(32, 1) - mins.repeat_interleave(32, 1)
    assert torch.equal(dequantize(with_mins), expect)
    const = QuantizedWeight(packed, scales.half(), bits=4, group_size=32, zero_point=8)
    assert torch.equal(dequantize(const), (q.float() - 8) * scales.half().float().repeat_interleave(32, 1))
    perm = torch.randperm(64)
    permuted = QuantizedWeight(packed, scales.half(), bits=4, group_size=32, zero_point=8, perm=perm)
    stored = dequantize(permuted, original_order=False)
    restored = dequantize(permuted)
    assert torch.equal(restored[:, perm], stored)
    assert dequantize(const, torch.bfloat16).dtype == torch.bfloat16


def test_quantized_weight_validation():
    packed = torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(ValueError):
        QuantizedWeight(packed, torch.ones(4, 3), bits=4, group_size=32)  # K=64 has 2 groups
    with pytest.raises(ValueError):
        QuantizedWeight(packed, torch.ones(4, 2), bits=3, group_size=32)
    with pytest.raises(ValueError):
        QuantizedWeight(
            packed, torch.ones(4, 2), bits=4, group_size=32, zeros=torch.zeros(4, 2), mins=torch.zeros(4, 2)
        )
    qw = QuantizedWeight(packed, torch.ones(4, 2), bits=4, group_size=32)
    assert qw.shape == (4, 64) and qw.nbytes == 4 * 8 * 4 + 4 * 2 * 4
    assert layout.compact_zeros(torch.full((3, 2), 8))[0] is None


def test_concat_n_fuses_shards():
    torch.manual_seed(3)
    a, b, c = (torch.randn(n, 256) for n in (32, 16, 16))
    parts = [rtn.quantize(a), rtn.quantize(b, sym=True), rtn.quantize(c, sym=True)]
    fused = layout.concat_n(parts)
    assert fused.shape == (64, 256) and fused.zeros is not None  # mixed zero forms -> a tensor
    assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in parts]))
    both_sym = layout.concat_n(parts[1:])
    assert both_sym.zeros is None and both_sym.zero_point == 8
    perm = torch.randperm(256)
    with_perm = [QuantizedWeight(p.qweight, p.scales, 4, 128, zero_point=8, perm=perm) for p in parts[1:]]
    fused = layout.concat_n(with_perm)
    assert torch.equal(fused.perm, perm)
    assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in with_perm]))
    other = QuantizedWeight(parts[1].qweight, parts[1].scales, 4, 128, zero_point=8, perm=torch.randperm(256))
    with pytest.raises(ValueError, match="permutation"):
        layout.concat_n([with_perm[0], other])
    with pytest.raises(ValueError):
        layout.concat_n([parts[0], rtn.quantize(b, group_size=64)])
