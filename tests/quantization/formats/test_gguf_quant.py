"""GGUF Q8_0 / Q5_0 / Q4_K / Q6_K kept quantized: the repacked weight must dequantize bit for bit to
`gguf.quants.dequantize`, on random blocks (every bit pattern of the packed fields) and on the demo model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from qwick.quantization.formats import gguf_quant
from qwick.quantization.formats.layout import dequantize
from qwick.quantization.formats.reference import dequant_matmul

TYPES = [QT.Q8_0, QT.Q5_0, QT.Q4_K, QT.Q6_K]
# byte offsets of each type's fp16 fields inside a block
FP16_FIELDS = {QT.Q8_0: [0], QT.Q5_0: [0], QT.Q4_K: [0, 2], QT.Q6_K: [208]}


def _random_blocks(qtype: QT, n: int, k: int, seed: int) -> np.ndarray:
    """Random bytes with finite fp16 fields (any finite value: negative, subnormal, zero, up to 65504)."""
    rng = np.random.default_rng(seed)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(n, k // block * type_size), dtype=np.uint8)
    blocks = data.reshape(-1, type_size)
    for off in FP16_FIELDS[qtype]:
        bits = blocks[:, off : off + 2].copy().view(np.uint16)
        bits &= np.uint16(0xFBFF)  # exponent 31 (inf/nan) -> 30
        blocks[:, off : off + 2] = bits.view(np.uint8)
    return data


def _assert_bit_exact(ours: torch.Tensor, ref: np.ndarray) -> None:
    ours_np = ours.numpy()
    assert ours_np.shape == ref.shape and ours_np.dtype == np.float32
    mismatch = ours_np.view(np.uint32) != ref.view(np.uint32)
    assert not mismatch.any(), (
        f"{int(mismatch.sum())} values differ, e.g. {ours_np[mismatch][:4]} vs {ref[mismatch][:4]}"
    )


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_bit_exact(qtype):
    n, k = 24, 1024
    data = _random_blocks(qtype, n, k, seed=int(qtype))
    ref = gguf.quants.dequantize(data, qtype)
    _assert_bit_exact(gguf_quant.dequantize(data, int(qtype), (n, k)), ref)
    _assert_bit_exact(gguf_quant.dequantize(torch.from_numpy(data), qtype, (n, k)), ref)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q5_0], ids=lambda t: t.name)
def test_quantized_floats_bit_exact(qtype):
    w = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32) * 0.05
    data = gguf.quants.quantize(w, qtype)
    _assert_bit_exact(gguf_quant.dequantize(data, qtype, (16, 512)), gguf.quants.dequantize(data, qtype))


@pytest.mark.parametrize(
    "qtype,bits,group,has_mins,zero_point",
    [
        (QT.Q8_0, 8, 32, False, 128),
        (QT.Q5_0, 8, 32, False, 16),
        (QT.Q4_K, 4, 32, True, 0),
        (QT.Q6_K, 8, 16, False, 32),
    ],
    ids=lambda v: v.name if isinstance(v, QT) else None,
)
def test_repacked_layout(qtype, bits, group, has_mins, zero_point):
    data = _random_blocks(qtype, 8, 512, seed=1)
    w = gguf_quant.repack(data, qtype, (8, 512))
    assert (w.bits, w.group_size, w.mins is not None, w.zero_point) == (bits, group, has_mins, zero_point)
    assert w.zeros is None and w.perm is None and w.shape == (8, 512)
    assert w.scales.dtype == (torch.float32 if qtype in (QT.Q4_K, QT.Q6_K) else torch.float16)
    x = torch.randn(3, 512, dtype=torch.float64)
    ref = torch.from_numpy(gguf.quants.dequantize(data, qtype)).double()
    torch.testing.assert_close(dequant_matmul(x, w), x @ ref.T, rtol=1e-12, atol=1e-12)


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        gguf_quant.repack(np.zeros(34 * 3, np.uint8), QT.Q8_0, (1, 64))  # 3 blocks for 2
    with pytest.raises(ValueError):
        gguf_quant.repack(np.zeros(34, np.uint8), QT.Q4_0, (1, 32))  # unsupported type
    with pytest.raises(ValueError):
        gguf_quant.repack(np.zeros(144, np.uint8), QT.Q4_K, (1, 128))  # K not a multiple of 256


@pytest.fixture(scope="module")
def demo_reader(demo_gguf_file):
    return gguf.GGUFReader(demo_gguf_file)  # ~10 s to parse: once for the module


@pytest.mark.demo
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_demo_model_tensors_bit_exact(qtype, demo_reader):
    """The demo model's tensors of this type (up to 6 of them; the first 2048 rows of the big ones)."""
    tensors = [t for t in demo_reader.tensors if t.tensor_type == qtype]
    assert tensors, f"the demo model has no {qtype.name} tensor"
    for t in tensors[:6]:
        k = int(t.shape[0])  # ggml order: ne0 (row length) first
        rows = t.data[:2048]
        ours = gguf_quant.dequantize(rows, qtype, (rows.shape[0], k))
        _assert_bit_exact(ours, gguf.quants.dequantize(rows, qtype))
    # the matmul path on one of them, against float64 on gguf's weights
    rows = tensors[0].data[:256]
    k = int(tensors[0].shape[0])
    x = torch.randn(2, k, dtype=torch.float64)
    ref = torch.from_numpy(gguf.quants.dequantize(rows, qtype)).double()
    out = dequant_matmul(x, gguf_quant.repack(rows, qtype, (rows.shape[0], k)))
    torch.testing.assert_close(out, x @ ref.T, rtol=1e-12, atol=1e-12)
    assert torch.equal(dequantize(gguf_quant.repack(rows, qtype, (rows.shape[0], k))), ref.float())
