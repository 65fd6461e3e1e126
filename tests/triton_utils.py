"""Helpers of the Triton kernel tests: where they run (a CUDA GPU, or Triton's interpreter on the CPU with
TRITON_INTERPRET=1, at small shapes) and the split-K scratch the skinny-GEMM kernels share."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def triton_device() -> torch.device:
    """The GPU, or the CPU under Triton's interpreter; otherwise the test is skipped (GPU tests are marked
    `gpu`, which the CPU suite deselects)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if INTERPRET:
        return torch.device("cpu")
    pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1)")


def gemv_workspace(dev: torch.device):
    """A `GemvWorkspace` on `dev`: the real one on a GPU (16M partials: room for every test shape), a small
    CPU stand-in for the interpreter (which has no device properties to ask for an SM count)."""
    from qwick.kernels.gemv import GemvWorkspace

    if dev.type == "cuda":
        return GemvWorkspace(dev, max_elems=1 << 24)
    ws = GemvWorkspace.__new__(GemvWorkspace)
    ws.partials = torch.empty(1 << 20, dtype=torch.float32)
    ws.counters = torch.zeros(1 << 12, dtype=torch.int32)
    ws.num_sms = 4
    ws.configs = {}
    return ws
