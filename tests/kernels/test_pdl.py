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


def test_early_norm_waits_for_the_down_gemv_before_it_in_a_graph():
    """The layer boundary as `pdl_norm` runs it (`lets_next_in`): the down GEMV (letting the next
    kernel in once its programs are past their loops), the next layer's input norm with the residual add
    (launched early, waiting at its start), then the preloaded QKV GEMV. Replayed on new inputs, every
    replay gives the bits of the same launches run eagerly without PDL, the residual included: a norm that
    read the down GEMV's output or the residual before they were written would not."""
    from qwick.kernels.elementwise import rms_norm
    from qwick.kernels.row_gemv_half2 import X_DIV, w4_half2_gemv
    from qwick.layers.linear import HalfPairs

    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    dev = torch.device("cuda")
    ws = gemv_workspace(dev)
    hidden, inter, n_qkv = 3584, 18944, 4608
    gen = torch.Generator().manual_seed(12)
    q_down = rtn.quantize(torch.randn(hidden, inter, generator=gen) / inter**0.5, group_size=128).to(dev)
    q_qkv = rtn.quantize(torch.randn(n_qkv, hidden, generator=gen) / hidden**0.5, group_size=128).to(dev)
    norm_w = (torch.rand(hidden, generator=gen) + 0.5).to(dev, torch.bfloat16)
    act = torch.zeros(1, inter, device=dev, dtype=torch.bfloat16)
    residual = torch.zeros(1, hidden, device=dev, dtype=torch.bfloat16)

    def chain(early: bool, res: torch.Tensor) -> torch.Tensor:
        y = w4_half2_gemv(act, q_down, None, ws, trigger=early)
        paired = rms_norm(y, norm_w, 1e-6, residual=res, quant=HalfPairs(X_DIV), early=early)
        return w4_half2_gemv(paired.x, q_qkv, None, ws, pairs=paired.pairs, preload=early)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(True, residual.clone())  # compiled outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True, residual)
    for _ in range(40):
        act.copy_((torch.randn(1, inter, generator=gen) * 2).to(dev, torch.bfloat16))
        start = (torch.randn(1, hidden, generator=gen) * 4).to(dev, torch.bfloat16)
        residual.copy_(start)
        graph.replay()
        res_ref = start.clone()
        assert torch.equal(out, chain(False, res_ref))
        assert torch.equal(residual, res_ref)
