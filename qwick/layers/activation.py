"""SwiGLU's gate: silu(gate) * up over the packed gate/up projection (one Triton kernel on CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwick.layers.linear import HalfPairs, PairedRows, QuantizedRows, RowQuant


class SiluAndMul(nn.Module):
    def forward(
        self, x: torch.Tensor, quant: RowQuant | HalfPairs | None = None
    ) -> torch.Tensor | QuantizedRows | PairedRows:
        """With `quant` (the down projection's `input_quant`), CUDA also writes the output's codes (or its
        fp16 pairs)."""
        if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:
            from qwick.kernels.elementwise import silu_and_mul

            return silu_and_mul(x, quant)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
