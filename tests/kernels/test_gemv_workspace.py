"""The split-K workspace's capacity rule, shared by every skinny GEMM (plain Python: runs on the CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.triton_utils import gemv_workspace


def test_workspace_capacity_rule():
    """Partials (splits x rows x N) and one counter per output tile must fit; one split needs neither;
    a launch that does not fit is refused before it could write past the buffers."""
    ws = gemv_workspace(torch.device("cpu"))  # 2^20 partials, 2^12 counters
    assert ws.fits(4, 16, 1 << 14, 64)
    assert not ws.fits(4, 16, (1 << 14) + 1, 64)
    assert not ws.fits(2, 1, 8, (1 << 12) + 1)
    assert ws.fits(1, 10**6, 10**6, 10**9)
    with pytest.raises(ValueError, match="workspace too small"):
        ws.check(8, 16, 1 << 14, 64, "this launch")
