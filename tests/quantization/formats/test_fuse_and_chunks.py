"""Shards of different GGUF types fused into one layer (`fuse_n`, `as_8bit_mins`), row selection
(`take_rows`), and the CPU reference path's cache-sized row chunks: all bit-exact against the plain
whole-weight dequantization."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from qwick.quantization.formats import gguf_quant, layout, reference, rtn
from qwick.quantization.formats.layout import as_8bit_mins, dequantize, fuse_n, take_rows
from tests.quantization.formats.test_gguf_quant import _random_blocks


def _part(qtype: QT, n: int, k: int, seed: int) -> layout.QuantizedWeight:
    return gguf_quant.repack(_random_blocks(qtype, n, k, seed), int(qtype), (n, k))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))  # signs of zeros included


@pytest.mark.parametrize(
    "qtypes",
    [
        (QT.Q4_K, QT.Q4_K, QT.Q6_K),  # Q4_K_M q/k/v of bigger models
        (QT.Q5_0, QT.Q5_0, QT.Q8_0),  # the demo model's q/k/v
        (QT.Q4_K, QT.Q5_0),
        (QT.Q6_K, QT.Q8_0, QT.Q4_K, QT.Q5_0),
    ],
    ids=lambda ts: "+".join(t.name for t in ts),
)
def test_fused_shards_dequantize_bit_exact(qtypes):
    parts = [_part(t, 8 * (i + 1), 512, seed=i) for i, t in enumerate(qtypes)]
    fused = fuse_n(parts)
    ref = torch.from_numpy(
        np.concatenate(
            [gguf.quants.dequantize(_random_blocks(t, 8 * (i + 1), 512, i), t) for i, t in enumerate(qtypes)]
        )
    )
    assert torch.equal(torch.cat([dequantize(p) for p in parts]), ref)
    if set(qtypes) == {QT.Q5_0, QT.Q8_0}:  # one form (8-bit, group 32, fp16 scales): per-group zero points
        assert fused.mins is None and fused.zeros is not None
        assert _bits_equal(dequantize(fused), ref)
    else:  # the common form: 8-bit codes, fp32 scales and mins; equal values (a zero may lose its sign)
        assert (fused.bits, fused.scales.dtype, fused.mins is not None) == (8, torch.float32, True)
        assert torch.equal(dequantize(fused), ref)


def test_as_8bit_mins_of_int4_rtn_and_zero_points():
    torch.manual_seed(0)
    for sym in (False, True):
        w = rtn.quantize(torch.randn(16, 256) * 0.05, 128, 4, sym)
        for group in (128, 32, 8):
            assert torch.equal(dequantize(as_8bit_mins(w, group)), dequantize(w))
    with pytest.raises(ValueError, match="must divide"):
        as_8bit_mins(w, 48)


def test_take_rows():
    w = _part(QT.Q4_K, 16, 256, seed=3)
    order = torch.randperm(16)
    assert _bits_equal(dequantize(take_rows(w, order)), dequantize(w)[order])


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_0, QT.Q6_K, QT.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 16, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_row_chunks_equal_whole_weight(monkeypatch, qtype, rows, dtype):
    w = _part(qtype, 200, 512, seed=int(qtype))
    whole = dequantize(w, dtype)
    x = torch.randn(rows, 512).to(dtype)
    bias = torch.randn(200).to(dtype)
    monkeypatch.setattr(layout, "CPU_CHUNK_ELEMS", 512 * 24)  # 24-row chunks, the last one partial
    assert len(layout.row_chunks(w)) == 9
    assert _bits_equal(dequantize(w, dtype).float(), whole.float())
    out = reference.dequant_matmul(x, w, bias)
    ref = x.double() @ whole.double().T + bias.double()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=tol * ref.abs().max().item(), rtol=0)
    assert out.shape == (rows, 200) and out.dtype == dtype
