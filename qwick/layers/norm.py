"""RMSNorm, with the residual add fused in: on CUDA one Triton kernel does both in one pass."""

from __future__ import annotations

import torch
from torch import nn

from qwick.layers.linear import HalfPairs, PairedRows, QuantizedRows, RowQuant

NormOut = torch.Tensor | QuantizedRows | PairedRows


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers: statistics in fp32, scale in the model dtype.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        quant: RowQuant | HalfPairs | None = None,
        early: bool = False,
    ) -> NormOut | tuple[NormOut, torch.Tensor]:
        """`norm(x)`, or with a residual: `(norm(x + residual), x + residual)`.

        On CUDA (2-D inputs) the fused kernel writes `x + residual` into `residual` in place, and with
        `quant` (the next layer's `input_quant`) it also writes the output's codes (`QuantizedRows`) or
        its fp16 pairs (`PairedRows`). `early`: the kernel before lets the next one in
        (`LinearMethod.lets_next_in`), so a one-row norm with a residual launches early and waits at its
        start (`qwick.kernels.pdl`).
        """
        if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:
            from qwick.kernels.elementwise import rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps, quant=quant)
            early = early and x.shape[0] == 1
            out = rms_norm(x, self.weight, self.eps, residual=residual, quant=quant, early=early)
            return out, residual
        return self.forward_native(x, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The PyTorch path (every device): transformers' arithmetic, and the fused kernel's oracle."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
