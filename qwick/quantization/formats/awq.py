"""AWQ checkpoints, AutoAWQ's "gemm" version (the format of Qwen's official -AWQ releases).

Per linear layer with weight W [N, K] (out x in), group size g:

    qweight  int32 [K, N / 8]   packed along the *output* columns: word j of row k holds columns 8j..8j+7,
                                column 8j + AWQ_ORDER[i] in bits 4i..4i+3 (AWQ's interleaved order)
    qzeros   int32 [K / g, N / 8]   zero points, packed the same way
    scales   fp16 [K / g, N]

    W[n, k] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n]

config.json: "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
"zero_point": true, "version": "gemm"}. The interleave lets AutoAWQ's CUDA kernel turn a word into eight
fp16 with a few bit operations; we unpack it once at load into `QuantizedWeight`'s rows.
"""

from __future__ import annotations

from typing import Any

import torch

from qwick.quantization.formats import rtn
from qwick.quantization.formats.layout import QuantizedWeight, _to_int32, compact_zeros, pack_along_k

BITS = 4
PACK = 32 // BITS
# Nibble i of a packed word holds column AWQ_ORDER[i] of its eight (AutoAWQ's `order_map` for 4 bits).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# ... so column c of the eight sits in nibble AWQ_REVERSE_ORDER[c].
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(c) for c in range(PACK))


def quantization_config(group_size: int = rtn.DEFAULT_GROUP_SIZE) -> dict[str, Any]:
    """The `quantization_config` AutoAWQ writes into config.json (as in Qwen2.5-*-AWQ)."""
    return {
        "quant_method": "awq",
        "bits": BITS,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] in AWQ order -> uint8 [R, C] in natural column order."""
    rows, words = packed.shape
    shifts = torch.tensor([4 * i for i in AWQ_REVERSE_ORDER], dtype=torch.int32, device=packed.device)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    return values.to(torch.uint8).reshape(rows, words * PACK)


def _pack_columns(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] (each < 16) -> int32 [R, C / 8] in AWQ order."""
    rows, cols = values.shape
    if cols % PACK:
        raise ValueError(f"{cols} columns is not a multiple of {PACK}")
    v = values.to(torch.int64).view(rows, cols // PACK, PACK)
    shifts = torch.tensor([4 * i for i in AWQ_REVERSE_ORDER], dtype=torch.int64, device=values.device)
    return _to_int32((v << shifts).sum(-1))


def unpack(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K], zeros uint8 [N, K / g], scales fp16 [N, K / g]) from a checkpoint's tensors."""
    k = qweight.shape[0]
    n = scales.shape[1]
    n_groups = scales.shape[0]
    if qweight.shape[1] * PACK != n or tuple(qzeros.shape) != (n_groups, n // PACK) or k % n_groups:
        raise ValueError(
            f"inconsistent AWQ tensors: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}"
        )
    q = _unpack_columns(qweight).t().contiguous()
    zeros = _unpack_columns(qzeros).t().contiguous()
    return q, zeros, scales.t().contiguous()


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W [N, K] float32, exact: (q - zero) * scale has at most 4 + 11 significant bits."""
    q, zeros, s = unpack(qweight, qzeros, scales)
    n, k = q.shape
    g = k // s.shape[1]
    w = (q.to(torch.float32).view(n, -1, g) - zeros.to(torch.float32).unsqueeze(-1)) * s.to(
        torch.float32
    ).unsqueeze(-1)
    return w.view(n, k)


def pack(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """Checkpoint tensors {qweight, qzeros, scales} for q uint8 [N, K], zeros [N, G], scales [N, G]."""
    n, k = q.shape
    if zeros.shape != scales.shape or scales.shape[0] != n or k % scales.shape[1]:
        raise ValueError(
            f"shapes do not fit: q {tuple(q.shape)}, zeros {tuple(zeros.shape)}, scales {tuple(scales.shape)}"
        )
    return {
        "qweight": _pack_columns(q.t()),
        "qzeros": _pack_columns(zeros.t()),
        "scales": scales.t().to(torch.float16).contiguous(),
    }


def quantize(w: torch.Tensor, group_size: int = rtn.DEFAULT_GROUP_SIZE) -> dict[str, torch.Tensor]:
    """A float weight [N, K] as AWQ checkpoint tensors, by round to nearest (asymmetric, zero points)."""
    return pack(*rtn.quantize_groups(w, group_size, BITS, sym=False))


def to_internal(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """Repack checkpoint tensors into the kernels' layout; dequantizes to exactly `dequantize`'s values."""
    q, zeros, s = unpack(qweight, qzeros, scales)
    zeros_t, zero_point = compact_zeros(zeros)
    return QuantizedWeight(
        qweight=pack_along_k(q, BITS),
        scales=s.to(torch.float16),
        bits=BITS,
        group_size=q.shape[1] // s.shape[1],
        zeros=zeros_t,
        zero_point=zero_point,
    )
