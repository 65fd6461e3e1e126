"""SwiGLU's gate arithmetic, shared by every kernel that writes it: the SiLU-and-mul kernel
(`qwick.kernels.elementwise.silu_and_mul`) and the gate/up GEMVs that apply it in their epilogue
(`qwick.kernels.gemv.gated_store`, which the int4 GEMV calls too), so that all of them give the same bits."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def silu_times(gate, up):
    """silu(gate) * up of values in the model dtype, rounded where PyTorch rounds, in gate's dtype."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu rounds to the dtype
    return (act * up.to(tl.float32)).to(gate.dtype)
