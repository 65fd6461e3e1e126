"""The reference matmul on quantized weights: dequantize, then an ordinary matmul.

The oracle for the Triton kernels and the CPU path of every integer format (AWQ, GPTQ, RTN, GGUF), once
converted to `QuantizedWeight`: `awq.to_internal`, `gptq.to_internal`, `rtn.quantize`, `gguf_quant.repack`.
The weight is dequantized in float32 (exact) and rounded once to the activations' dtype, which is what a
kernel that dequantizes a tile before `tl.dot` computes too; only the summation order differs. On CPUs
decode-sized inputs go through W a cache-sized chunk of rows at a time (same values, same per-row sums).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwick.quantization.formats.layout import QuantizedWeight, dequantize, dequantize_rows, row_chunks

# Up to this many activation rows, a CPU matmul runs piece by piece over cache-sized row chunks of W:
# each chunk is dequantized and multiplied while in cache, so W is never written out in full (decode).
CHUNKED_MAX_ROWS = 16


def dequant_matmul(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ W.T + bias` for x [..., K]. Act-order weights stay in stored order and gather x instead."""
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm.to(x.device))
    chunks = row_chunks(weight)
    rows = x.numel() // max(x.shape[-1], 1)
    if len(chunks) == 1 or rows > CHUNKED_MAX_ROWS:
        return F.linear(x, dequantize(weight, x.dtype, original_order=False), bias)
    x2 = x.reshape(rows, x.shape[-1])
    y = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device)
    for start, stop in chunks:
        w = dequantize_rows(weight, start, stop).to(x.dtype)
        b = bias[start:stop] if bias is not None else None
        if rows == 1:  # mv: twice F.linear's speed for one bf16 row on CPUs (qwick.layers.linear)
            y[0, start:stop] = torch.mv(w, x2[0]) if b is None else torch.addmv(b, w, x2[0])
        else:
            y[:, start:stop] = F.linear(x2, w, b)
    return y.reshape(*x.shape[:-1], weight.shape[0])
