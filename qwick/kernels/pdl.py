"""Programmatic dependent launch (PDL, sm_90 and later): a batch-1 GEMV that follows a kernel of a few
programs starts while that kernel still runs. In the engine: the int4 QKV projection after the input
RMSNorm (one program), and the int4, fp8 and int8 o projections after decode attention (one program per
kv head; `PackedLinearMethod.pdl_preload`, `W8A8LinearMethod.pdl_preload`). The int4 MLP chain after o
(`PackedLinearMethod.pdl_mlp`, `pdl_down`), the next layer's input norm (`pdl_norm`, `RMSNorm.pdl_early`)
and decode attention after QKV (`pdl_norm`, `triton_backend.PDL_EARLY_DECODE`) can launch early too, each
GEMV letting its successor in once its programs are past their loops; off: with triggers at the launch's
start the MLP chain lost 5-6%, and the late triggers are not timed yet.

While such a kernel runs, the rest of the GPU and its memory idle. Its successor, launched with
`launch_pdl=True`, may start as soon as every program of the kernel before has called `pdl_trigger`. Its
programs then load what no earlier kernel writes (their split's first weight tiles: all of them at the 7b
QKV and o projections, see `row_gemv_half2.preload_fits`) and block in `pdl_wait` until the kernel before
has ended and its writes are visible; the activations, scratch and outputs come after the wait, so the
arithmetic is that of launches one after another. A kernel that triggers without a PDL successor changes
nothing, so the norm's and attention's triggers stay on.

An earlier attempt (25th session in BENCHMARKS.md) put every kernel of the chain under PDL and lost 4-5%:
a GEMV's successor then floods in while the GEMV itself still has programs to place. The kernels that
trigger by default here hold 1-4 programs (the 37th session's MLP chain, where o lets gate/up in, lost
5-6% the same way).

`pdl_supported(device)`: CUDA devices of compute capability 9.0+, never under Triton's interpreter (which
runs no PTX), and not with `QWICK_PDL=0` (read once, at import: the A/B switch of the benchmarks).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from qwick.kernels.half2 import EMULATE

ENABLED = not EMULATE and os.environ.get("QWICK_PDL", "1") != "0"


@triton.jit
def pdl_trigger():
    """Let the stream's next kernel launch now (its programs run up to their own `pdl_wait`)."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], tl.int32, False, 1)


@triton.jit
def pdl_wait():
    """Block until the kernel before has ended and its memory writes are visible (at once when this kernel
    was not launched early)."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], tl.int32, False, 1)


@functools.cache
def _capability_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` may trigger and launch with PDL."""
    if device.type != "cuda" or not ENABLED:
        return False
    return _capability_ok(device.index if device.index is not None else torch.cuda.current_device())
