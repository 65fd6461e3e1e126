"""`graph_us` times the calls a CUDA graph replays: the GPU's time, not the host's."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_graph_us_times_replays_of_the_captured_calls():
    from qwick.bench.gpu_timing import graph_us

    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    x = torch.zeros(1 << 20, device="cuda")
    calls = []

    def add_one():
        calls.append(1)
        x.add_(1)

    us = graph_us(add_one, calls=5, replays=3)
    torch.cuda.synchronize()
    # Python ran it twice eagerly and five times while capturing (a capture records, it does not run);
    # the GPU ran the two eager calls, then the graph's five once to warm up and three times timed.
    assert len(calls) == 7
    assert float(x[0]) == 2 + 5 * 4
    assert 0 < us < 1e4
