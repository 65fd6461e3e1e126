"""Programmatic dependent launch (`qwick.kernels.pdl`) on a GPU: a preloaded GEMV launched early after a
kernel that lets it start still reads that kernel's output, inside a CUDA graph as decode runs it."""

from __future__ import annotations

import pytest
import torch

from qwick.quantization.formats import rtn
from tests.triton_utils import gemv_workspace

pytestmark = pytest.mark.gpu


def test_preloaded_gemv_waits_for_the_norm_before_it_in_a_graph():
    """The QKV projection's chain as a decode graph runs it: RMSNorm writing the pairs (it lets the next
    kernel launch at its start), then the preloaded GEMV, launched early where the GPU has programmatic
    dependent launch. Replayed on new inputs, every replay gives the bits of the same two launches run
    eagerly without preload: a GEMV that read its pairs before the norm had written them would give the
    previous replay's product."""
    from qwick.kernels.elementwise import rms_norm
    from qwick.kernels.pdl import pdl_supported
    from qwick.kernels.row_gemv_half2 import X_DIV, w4_half2_gemv
    from qwick.layers.linear import HalfPairs

    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    dev = torch.device("cuda")
    print("programmatic dependent launch:", pdl_supported(dev))
    ws = gemv_workspace(dev)
    n, k = 4608, 3584
    gen = torch.Generator().manual_seed(11)
    qw = rtn.quantize(torch.randn(n, k, generator=gen) / k**0.5, group_size=128).to(dev)
    b = torch.randn(n, generator=gen).to(dev, torch.bfloat16)
    norm_w = (torch.rand(k, generator=gen) + 0.5).to(dev, torch.bfloat16)
    h = torch.zeros(1, k, device=dev, dtype=torch.bfloat16)

    def chain(preload: bool) -> torch.Tensor:
        paired = rms_norm(h, norm_w, 1e-6, quant=HalfPairs(X_DIV))
        return w4_half2_gemv(paired.x, qw, b, ws, pairs=paired.pairs, preload=preload)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(True)  # compiled outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(40):
        h.copy_((torch.randn(1, k, generator=gen) * 3).to(dev, torch.bfloat16))
        graph.replay()
        assert torch.equal(out, chain(False))
