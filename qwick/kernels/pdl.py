"""Programmatic dependent launch (PDL, Hopper and later): a kernel starts while the one before it finishes.

A batch-1 decode step is a chain of ~200 short kernels, each waiting for the one before: a GEMV's programs
start only once the norm before it has ended, and then wait a DRAM round trip for their first weights,
while decode attention runs on 4 programs and leaves 128 SMs idle. With PDL each kernel of the chain
lets the next one launch at its start (`pdl_trigger`); the next one's programs become resident on the
free SMs, load what no earlier kernel writes (a GEMV's first weight tiles, into registers), and then block
in `pdl_wait` until the kernel before has finished and its writes are visible. Everything a kernel reads
from or writes to activations, caches and scratch comes after its `pdl_wait`, so the arithmetic is the
same as launched one after another.

A kernel launched with `launch_pdl=True` must call `pdl_wait` before touching such memory; one launched
without it (a PyTorch op, cuBLAS) waits for the kernel before it to finish, as always. So each kernel
opts in on its own. `pdl_launch(device)` says whether launches on a device use it: CUDA devices of compute
capability 9.0 and later, never under Triton's interpreter (which runs no PTX), and not with
`QWICK_PDL=0` (the A/B switch of the benchmarks).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from qwick.kernels.half2 import EMULATE

_ENABLED = not EMULATE and os.environ.get("QWICK_PDL", "1") != "0"  # read once, at import


@triton.jit
def pdl_trigger():
    """Let the next kernel of the stream launch now (its programs run up to their own `pdl_wait`)."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], tl.int32, False, 1)


@triton.jit
def pdl_wait():
    """Block until the kernel before has finished and its memory writes are visible."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], tl.int32, False, 1)


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (their `PDL` meta-parameter and `launch_pdl`)."""
    if device.type != "cuda" or not _ENABLED:
        return False
    return _device_has_pdl(device.index if device.index is not None else torch.cuda.current_device())
