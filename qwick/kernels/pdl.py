"""Programmatic dependent launch (PDL, sm_90 and later): a batch-1 GEMV that follows a kernel of a few
programs starts while that kernel still runs. In the engine: the int4 QKV projection after the input
RMSNorm (one program), and the int4, fp8 and int8 o projections after decode attention (one program per
kv head; `PackedLinearMethod.pdl_preload`, `W8A8LinearMethod.pdl_preload`). With int4 the chain goes on
through the layer boundary (`PackedLinearMethod.pdl_norm`, `LinearMethod.lets_next_in`): the down GEMV lets
the next layer's input norm in and the QKV GEMV lets decode attention in, each once its programs are past
their loops, and both launch early and wait at their start (+2.0-2.2% at batch 1 on H100s, 38th session).
The 8-bit modes run the same chain with every one-row GEMV on activation codes launched early, its first
weight tile loaded before it waits (`W8A8LinearMethod.pdl_norm`: +6.0-6.2% on an H100, 39th session).
The int4 MLP chain after o launches early too (`pdl_mlp`, `pdl_down`; on since the 47th session: +2.5-2.7%
at batch 1 on an H100, after losing 7-11% on H100s in the 38th and 41st).

While such a kernel runs, the rest of the GPU and its memory idle. Its successor, launched with
`launch_pdl=True`, may start as soon as every program of the kernel before has called `pdl_trigger`. Its
programs then load what no earlier kernel writes (their split's first weight tiles: all of them at the 7b
QKV and o projections, see `row_gemv_half2.preload_fits`) and block in `pdl_wait` until the kernel before
has ended and its writes are visible; the activations, scratch and outputs come after the wait, so the
arithmetic is that of launches one after another. A kernel that triggers without a PDL successor changes
nothing, so the norm's and attention's triggers stay on. An early launch after a kernel that never
triggers is slower by 0.8-0.9% (38th session), so the norm and attention launch early only where the
projection before them triggers.

An earlier attempt (25th session in BENCHMARKS.md) put every kernel of the chain under PDL and lost 4-5%:
a GEMV's successor then floods in while the GEMV itself still has programs to place. The GEMVs that
trigger by default here do so after their loops, once every program is placed (the 37th session's MLP
chain, with o letting gate/up in at its start, lost 5-6% the same way).

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
