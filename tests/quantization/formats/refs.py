"""Independent, deliberately simple references for the format tests (loops over groups and nibbles, numpy).

Nothing here calls into `qwick.quantization.formats`: a bug there cannot hide behind the same bug here.
"""

from __future__ import annotations

import numpy as np

# AutoAWQ's `order_map` for 4 bits: nibble i of a word holds column ORDER[i] of its eight.
AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


def fp16_at_least(x: float) -> np.float16:
    """The smallest fp16 >= x (> 0)."""
    h = np.float16(x)
    if float(h) < x:
        h = np.nextafter(h, np.float16(np.inf))
    if float(h) <= 0.0:
        h = np.nextafter(np.float16(0.0), np.float16(1.0))
    return h


def rtn_reference(w: np.ndarray, group_size: int, sym: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [N, K], zeros [N, G], scales fp16 [N, G]) by the textbook min/max recipe, one group at a time."""
    n, k = w.shape
    groups = k // group_size
    q = np.zeros((n, k), dtype=np.int64)
    zeros = np.zeros((n, groups), dtype=np.int64)
    scales = np.zeros((n, groups), dtype=np.float16)
    for r in range(n):
        for g in range(groups):
            chunk = w[r, g * group_size : (g + 1) * group_size].astype(np.float32)
            if sym:
                s = fp16_at_least(float(np.float32(2) * np.abs(chunk).max() / np.float32(15)))
                z = 8
            else:
                lo = min(float(chunk.min()), 0.0)
                hi = max(float(chunk.max()), 0.0)
                s = fp16_at_least(float(np.float32(hi - lo) / np.float32(15)))
                z = int(np.clip(np.round(np.float32(-lo) / np.float32(s)), 0, 15))
            scales[r, g] = s
            zeros[r, g] = z
            q[r, g * group_size : (g + 1) * group_size] = np.clip(np.round(chunk / np.float32(s)) + z, 0, 15)
    return q, zeros, scales


def dequant_groups(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    """W[n, k] = (q[n, k] - zeros[n, g_idx[k]]) * scales[n, g_idx[k]], in float32."""
    return ((q - zeros[:, g_idx]).astype(np.float32) * scales[:, g_idx].astype(np.float32)).astype(np.float32)


def awq_pack_columns(values: np.ndarray) -> np.ndarray:
    """AutoAWQ's packing loop: int [R, C] -> int32 [R, C / 8], word column c |= v[:, 8c + ORDER[i]] << 4i."""
    rows, cols = values.shape
    out = np.zeros((rows, cols // 8), dtype=np.uint32)
    for c in range(cols // 8):
        for i in range(8):
            out[:, c] |= values[:, 8 * c + AWQ_ORDER_MAP[i]].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def gptq_pack_rows(values: np.ndarray) -> np.ndarray:
    """AutoGPTQ's qweight loop: int [K, N] -> int32 [K / 8, N], row r |= v[8r + j] << 4j."""
    k, n = values.shape
    out = np.zeros((k // 8, n), dtype=np.uint32)
    for r in range(k // 8):
        for j in range(8):
            out[r] |= values[8 * r + j].astype(np.uint32) << np.uint32(4 * j)
    return out.view(np.int32)


def gptq_pack_zeros(zeros: np.ndarray, offset: int) -> np.ndarray:
    """AutoGPTQ's qzeros loop on [G, N] zero points stored minus `offset` (per nibble, mod 16)."""
    stored = (zeros.astype(np.int64) - offset) % 16
    g, n = stored.shape
    out = np.zeros((g, n // 8), dtype=np.uint32)
    for c in range(n // 8):
        for j in range(8):
            out[:, c] |= stored[:, 8 * c + j].astype(np.uint32) << np.uint32(4 * j)
    return out.view(np.int32)
