"""AWQ "gemm" tensors (Qwen's -AWQ format) against an independent packer and float reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwick.quantization.formats import awq
from qwick.quantization.formats.layout import dequantize
from tests.quantization.formats.refs import awq_pack_columns, dequant_groups, rtn_reference


def test_awq_interleaved_order_known_word():
    """Columns 0..7 holding 0..7 pack into 0x75316420 (nibble i holds column [0,2,4,6,1,3,5,7][i])."""
    values = torch.arange(8, dtype=torch.uint8).view(1, 8)
    packed = awq.pack(values.t().contiguous(), torch.zeros(8, 1, dtype=torch.uint8), torch.ones(8, 1))
    assert packed["qweight"].tolist() == [[0x75316420]]
    q, _, _ = awq.unpack(
        torch.tensor([[0x75316420]], dtype=torch.int32),
        torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, 8, dtype=torch.float16),
    )
    assert q.flatten().tolist() == list(range(8))


def _random_parts(n: int, k: int, g: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (n, k // g), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 1e-4).to(torch.float16)
    return q, zeros, scales


def test_pack_matches_autoawq_loop_and_round_trips():
    q, zeros, scales = _random_parts(48, 256, 128)
    packed = awq.pack(q, zeros, scales)
    assert packed["qweight"].shape == (256, 6) and packed["qweight"].dtype == torch.int32
    assert packed["qzeros"].shape == (2, 6) and packed["qzeros"].dtype == torch.int32
    assert packed["scales"].shape == (2, 48) and packed["scales"].dtype == torch.float16
    assert np.array_equal(packed["qweight"].numpy(), awq_pack_columns(q.t().numpy()))
    assert np.array_equal(packed["qzeros"].numpy(), awq_pack_columns(zeros.t().numpy()))
    uq, uz, us = awq.unpack(**packed)
    assert torch.equal(uq, q) and torch.equal(uz, zeros) and torch.equal(us, scales)


def test_dequantize_equals_float_reference():
    q, zeros, scales = _random_parts(32, 384, 128, seed=3)
    checkpoint = {
        "qweight": torch.from_numpy(awq_pack_columns(q.t().numpy())),
        "qzeros": torch.from_numpy(awq_pack_columns(zeros.t().numpy())),
        "scales": scales.t().contiguous(),
    }
    g_idx = np.arange(384) // 128
    expect = dequant_groups(q.numpy().astype(np.int64), zeros.numpy().astype(np.int64), scales.numpy(), g_idx)
    assert np.array_equal(awq.dequantize(**checkpoint).numpy(), expect)


def test_quantize_equals_independent_rtn_and_error_bound():
    torch.manual_seed(0)
    w = torch.randn(40, 256) * 0.03
    packed = awq.quantize(w, 128)
    rq, rz, rs = rtn_reference(w.numpy(), 128, sym=False)
    expect = dequant_groups(rq, rz, rs, np.arange(256) // 128)
    dq = awq.dequantize(**packed)
    assert np.array_equal(dq.numpy(), expect)
    bound = torch.from_numpy(rs.astype(np.float32)).repeat_interleave(128, 1) / 2
    assert bool(((w - dq).abs() <= bound * (1 + 1e-6)).all())


def test_to_internal_preserves_values():
    torch.manual_seed(2)
    packed = awq.quantize(torch.randn(64, 512), 128)
    internal = awq.to_internal(**packed)
    assert internal.bits == 4 and internal.group_size == 128 and internal.shape == (64, 512)
    assert internal.zeros is not None and internal.perm is None
    assert torch.equal(dequantize(internal), awq.dequantize(**packed))


def test_unpack_rejects_inconsistent_tensors():
    packed = awq.quantize(torch.randn(16, 256), 128)
    with pytest.raises(ValueError):
        awq.unpack(packed["qweight"], packed["qzeros"][:1], packed["scales"])


def test_quantization_config_is_qwens():
    assert awq.quantization_config() == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
