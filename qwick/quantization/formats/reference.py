"""The reference matmul on quantized weights: dequantize, then an ordinary matmul.

The oracle for the Triton kernels and the CPU path of every integer format (AWQ, GPTQ, RTN, GGUF), once
converted to `QuantizedWeight`: `awq.to_internal`, `gptq.to_internal`, `rtn.quantize`, `gguf_quant.repack`.
The weight is dequantized in float32 (exact) and rounded once to the activations' dtype, which is what a
kernel that dequantizes a tile before `tl.dot` computes too; only the summation order differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwick.quantization.formats.layout import QuantizedWeight, dequantize


def dequant_matmul(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ W.T + bias` for x [..., K]. Act-order weights stay in stored order and gather x instead."""
    w = dequantize(weight, x.dtype, original_order=False)
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm.to(x.device))
    return F.linear(x, w, bias)
