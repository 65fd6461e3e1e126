"""GGUF quantized tensors kept quantized: Q8_0, Q5_0, Q4_K and Q6_K repacked into `QuantizedWeight`.

The GGUF reader gives a weight W [N, K] as uint8 [N, K / block * type_size]: each row a run of blocks along K.

    Q8_0  32 values   fp16 d, 32 x int8 q                       W = d * q
    Q5_0  32 values   fp16 d, 4 bytes of high bits, 16 bytes of nibbles   W = d * (q5 - 16)
    Q4_K  256 values  fp16 d, fp16 dmin, 12 bytes of 6-bit (sc, m) for 8 sub-blocks of 32,
                      128 bytes of nibbles                      W = (d * sc) * q4 - (dmin * m)
    Q6_K  256 values  128 bytes low nibbles, 64 bytes of 2-bit highs, 16 x int8 sc (sub-blocks of 16),
                      fp16 d                                    W = (d * sc) * (q6 - 32)

Every type maps exactly onto the generic layout, so one kernel family (4- or 8-bit containers, any group
size) serves them all:

    Q4_K -> bits 4, groups of 32, fp32 scales = d * sc and fp32 mins = dmin * m (W = q * s - m).
            d * sc has up to 11 + 6 significant bits: exact in fp32, not in fp16, hence fp32.
    Q6_K -> bits 8 holding q6 in 0..63, zero point 32, groups of 16, fp32 scales = d * sc (11 + 8 bits).
    Q5_0 -> bits 8 holding q5 in 0..31, zero point 16, groups of 32, fp16 scales = d.
    Q8_0 -> bits 8 holding q + 128, zero point 128, groups of 32, fp16 scales = d.

Dequantizing that in float32 performs the very operations `gguf.quants.dequantize` performs (every product
of a scale and a small integer is exact in fp32; Q4_K's one subtraction is rounded identically), so the
values are bit-identical, signs of zeros included (tested on random blocks and on the demo model).
The cost is memory: Q4_K takes 6 bits per weight here against 4.5 in the file, Q6_K 10 against 6.56, Q5_0
8.5 against 5.5, Q8_0 8.5 as in the file. A two-level scale (fp16 d per 256 times uint8 sc per sub-block)
would bring Q4_K to 4.6 bits without losing exactness; worth it once GGUF speed on the GPU matters.

This module needs numpy and torch only: the `gguf` package (absent on the GPU machine) is needed only to
read the file.
"""

from __future__ import annotations

import numpy as np
import torch

from qwick.quantization.formats.layout import QuantizedWeight, pack_along_k
from qwick.quantization.formats.layout import dequantize as _dequantize

# GGML type ids (gguf.GGMLQuantizationType values), so that this module does not need the gguf package.
Q5_0 = 6
Q8_0 = 8
Q4_K = 12
Q6_K = 14
QK_K = 256
# type -> (values per block, bytes per block)
BLOCK_SIZES: dict[int, tuple[int, int]] = {Q8_0: (32, 34), Q5_0: (32, 22), Q4_K: (256, 144), Q6_K: (256, 210)}
TYPE_NAMES = {Q8_0: "Q8_0", Q5_0: "Q5_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}
SUPPORTED_TYPES = frozenset(BLOCK_SIZES)


def _blocks(data: np.ndarray | torch.Tensor, qtype: int, shape: tuple[int, int]) -> torch.Tensor:
    """The bytes as uint8 [N, K / block, bytes_per_block], copied (reader data is a read-only mmap)."""
    if qtype not in BLOCK_SIZES:
        raise ValueError(f"GGML type {qtype} is not one of {sorted(TYPE_NAMES.values())}")
    block, type_size = BLOCK_SIZES[qtype]
    n, k = shape
    if k % block:
        raise ValueError(f"K={k} is not a multiple of the {TYPE_NAMES[qtype]} block size {block}")
    if isinstance(data, torch.Tensor):
        t = data.detach().to("cpu", torch.uint8).contiguous().clone()
    else:
        t = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))
    expected = n * (k // block) * type_size
    if t.numel() != expected:
        raise ValueError(f"{TYPE_NAMES[qtype]} tensor [{n}, {k}] needs {expected} bytes, got {t.numel()}")
    return t.reshape(n, k // block, type_size)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from the last dimension (2 bytes) -> float32, dropping that dimension."""
    return b.contiguous().view(torch.float16).squeeze(-1).to(torch.float32)


def repack(data: np.ndarray | torch.Tensor, qtype: int, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor's raw bytes (e.g. `GGUFReader(...).tensors[i].data`) -> `QuantizedWeight`.

    `shape` is (N, K) = (rows, row length): the reverse of the reader's `tensor.shape` (ggml's ne0 first).
    """
    qtype = int(qtype)
    n, k = shape
    blocks = _blocks(data, qtype, (n, k))
    nb = blocks.shape[1]
    if qtype == Q8_0:
        d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, nb)
        q = blocks[..., 2:].reshape(n, k) ^ 0x80  # int8 two's complement -> q + 128
        return QuantizedWeight(pack_along_k(q, 8), d, bits=8, group_size=32, zero_point=128)
    if qtype == Q5_0:
        d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, nb)
        qh = blocks[..., 2:6].contiguous().view(torch.int32)  # [n, nb, 1], bit j = high bit of value j
        high = (qh >> torch.arange(32, dtype=torch.int32)) & 1  # [n, nb, 32]
        qs = blocks[..., 6:22]  # value j < 16: low nibble of byte j; value 16 + j: its high nibble
        low = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
        q = (low.to(torch.int32) | (high << 4)).reshape(n, k)
        return QuantizedWeight(pack_along_k(q, 8), d, bits=8, group_size=32, zero_point=16)
    if qtype == Q4_K:
        d = _f16(blocks[..., 0:2])
        dmin = _f16(blocks[..., 2:4])
        sc, m = _k_scale_min(blocks[..., 4:16])  # [n, nb, 8] each
        qs = blocks[..., 16:144].reshape(
            n, nb, 4, 32
        )  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c+1 (high)
        q = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(n, k)
        scales = (d.unsqueeze(-1) * sc.to(torch.float32)).reshape(n, nb * 8)
        mins = (dmin.unsqueeze(-1) * m.to(torch.float32)).reshape(n, nb * 8)
        return QuantizedWeight(pack_along_k(q, 4), scales, bits=4, group_size=32, mins=mins)
    # Q6_K: two halves of 128 values; in half h, value 32 * i + j (i < 4, j < 32) takes the low or high
    # nibble (i >= 2) of ql byte 64h + 32(i % 2) + j and bits 2i..2i+1 of qh byte 32h + j.
    ql = blocks[..., 0:128].reshape(n, nb, 2, 2, 32)  # [.., half, i % 2, j]
    qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32).to(torch.int32)  # [.., half, -, j]
    sc = blocks[..., 192:208].contiguous().view(torch.int8)  # [n, nb, 16], one per 16 values
    d = _f16(blocks[..., 208:210])
    low = torch.cat([ql & 0x0F, ql >> 4], dim=3).to(torch.int32)  # [.., half, i (4), j]
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(4, 1)) & 3
    q = (low | (high << 4)).reshape(n, k)
    scales = (d.unsqueeze(-1) * sc.to(torch.float32)).reshape(n, nb * 16)
    return QuantizedWeight(pack_along_k(q, 8), scales, bits=8, group_size=16, zero_point=32)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit (scale, min) pairs of a K-quant super-block from its 12 bytes.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales/mins 4-7 take their low 4
    bits from the nibbles of bytes 8-11 and their top 2 bits from the top bits of bytes 0-3 / 4-7.
    """
    p = packed.to(torch.int32)
    a, b, c = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    sc = torch.cat([a & 63, (c & 0x0F) | ((a >> 6) << 4)], dim=-1)
    m = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=-1)
    return sc, m


def dequantize(data: np.ndarray | torch.Tensor, qtype: int, shape: tuple[int, int]) -> torch.Tensor:
    """W [N, K] float32, bit-identical to `gguf.quants.dequantize(data, qtype).reshape(shape)`."""
    return _dequantize(repack(data, qtype, shape), torch.float32)
