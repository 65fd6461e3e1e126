"""Model-runner pieces that stand alone."""

from __future__ import annotations

import pytest
import torch

from qwick.runner.model_runner import zeros_on_demand


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeros_on_demand_is_zero_and_writable(dtype):
    t = zeros_on_demand((2, 5, 4, 2, 8), dtype, torch.device("cpu"))
    assert t.shape == (2, 5, 4, 2, 8) and t.dtype == dtype
    assert torch.count_nonzero(t) == 0
    t[1, 3] = 1.5
    assert t.sum().item() == pytest.approx(1.5 * 4 * 2 * 8)
