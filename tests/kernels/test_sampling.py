"""Seeded noise on the GPU: a pure function of the row's seed, whatever the batch; uniform in [0, 1)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


def test_seeded_rows_do_not_depend_on_the_batch():
    from qwick.kernels.sampling import seeded_uniform_

    dev = _device()
    vocab = 152064
    alone = torch.full((1, vocab), -1.0, device=dev)
    seeded_uniform_(alone, [0], [12345])
    batch = torch.full((5, vocab), -1.0, device=dev)
    seeded_uniform_(batch, [3, 1], [999, 12345])  # same seed in another row, another neighbour
    assert torch.equal(batch[1], alone[0])
    assert not torch.equal(batch[3], alone[0])
    assert bool((batch[[0, 2, 4]] == -1).all())  # unseeded rows untouched
    u = batch[3]
    assert bool((u >= 0).all() and (u < 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.01
