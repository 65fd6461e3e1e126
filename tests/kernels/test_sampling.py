"""Sampling kernels: seeded noise (a pure function of the row's seed, whatever the batch; uniform in [0, 1))
and the fused exponential race (the torch race's token on the same noise; softmax frequencies)."""

from __future__ import annotations

import pytest
import torch

from tests.triton_utils import INTERPRET, triton_device

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


def _race_reference(logits: torch.Tensor, temperature: torch.Tensor | None, seeds: list[int]) -> torch.Tensor:
    """The torch path's race on the noise `seeded_uniform_` draws for each row's key."""
    from qwick.kernels.sampling import seeded_uniform_

    u = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    seeded_uniform_(u, list(range(len(seeds))), seeds)
    q = (-u.log()).clamp(min=1e-30)
    x = logits.float() if temperature is None else logits.float() / temperature[:, None]
    return (x.softmax(dim=-1) / q).argmax(dim=-1)


@pytest.mark.parametrize(
    "batch", [pytest.param(1, marks=pytest.mark.interpret), pytest.param(3, marks=pytest.mark.interpret), 300]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_race_sample_picks_the_races_winner(batch, dtype):
    """One pass in log space gives the token of the softmax / noise race, with each row keyed by
    base + row, also when a row is split over many programs (batch 1) or a program walks many blocks
    (a whole row in one program included)."""
    from qwick.kernels.sampling import race_sample

    dev = triton_device()
    vocab = 152064 if dev.type == "cuda" else 5000
    if INTERPRET and batch == 300:
        pytest.skip("too slow for the interpreter")
    g = torch.Generator().manual_seed(batch)
    logits = (torch.randn((batch, vocab), generator=g) * 4).to(dtype).to(dev)
    temperature = (torch.rand(batch, generator=g) * 1.5 + 0.1).to(dev)
    base = (1 << 40) + 17
    seeds = [base + i for i in range(batch)]
    for temp in (None, temperature):
        got = race_sample(logits, temp, base)
        assert got.dtype == torch.long and got.shape == (batch,)
        assert torch.equal(got, _race_reference(logits, temp, seeds))
    # Explicit per-row keys select the same draws as the implicit ones.
    assert torch.equal(race_sample(logits, temperature, 5, seeds), race_sample(logits, temperature, base))
    # Fewer programs (one per row at 300 rows: the single-chunk path), the same winners.
    got = race_sample(logits, temperature, base, programs_per_sm=1)
    assert torch.equal(got, _race_reference(logits, temperature, seeds))


@pytest.mark.interpret
def test_race_sample_seeded_row_ignores_the_batch():
    from qwick.kernels.sampling import race_sample

    dev = triton_device()
    vocab = 4096
    logits = torch.randn((4, vocab), generator=torch.Generator().manual_seed(1)).to(dev)
    alone = race_sample(logits[2:3], None, 1 << 40, [987654321])
    for base in (1 << 33, 1 << 50):
        batch = race_sample(logits, None, base, [base, base + 1, 987654321, base + 3])
        assert batch[2] == alone[0]
    assert race_sample(logits[:0], None, 1 << 40).shape == (0,)  # no rows: no launch, no division by zero


@pytest.mark.interpret
def test_race_sample_follows_the_softmax():
    """Frequencies over 4096 draws of one row track softmax(logits / t); -inf columns never win."""
    from qwick.kernels.sampling import race_sample

    dev = triton_device()
    n = 4096
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf"), 1.5, float("-inf")])
    temperature = torch.full((n,), 0.8, device=dev)
    ids = race_sample(row.expand(n, -1).contiguous().to(dev), temperature, (1 << 36) + 5)
    freq = torch.bincount(ids.cpu(), minlength=8).float() / n
    probs = (row / 0.8).softmax(dim=-1)
    assert freq[5] == 0 and freq[7] == 0
    assert torch.allclose(freq, probs, atol=0.03)  # ~4 standard deviations at n = 4096


@pytest.mark.parametrize(
    "batch", [pytest.param(1, marks=pytest.mark.interpret), pytest.param(3, marks=pytest.mark.interpret), 300]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_argmax_is_torch_argmax(batch, dtype):
    """The two-launch argmax gives torch.argmax's token: over many chunks (batch 1) and one chunk a row
    (300 rows), with ties (the first column wins, across chunks too), rows of -inf (column 0), +inf, and
    NaN (the first NaN, as torch takes it)."""
    from qwick.kernels.sampling import ARGMAX_BLOCK, greedy_argmax

    dev = triton_device()
    vocab = 152064 if dev.type == "cuda" else 5000
    if INTERPRET and batch == 300:
        pytest.skip("too slow for the interpreter")
    g = torch.Generator().manual_seed(batch)
    logits = (torch.randn((batch, vocab), generator=g) * 4).to(dtype)
    logits[0, 7] = logits[0, vocab - 3] = logits[0, 2 * ARGMAX_BLOCK + 5] = 100.0  # a tie over three chunks
    if batch > 1:
        logits[1] = float("-inf")
        logits[2, 11] = logits[2, vocab - 1] = float("nan")
        logits[2, 3] = float("inf")
    for programs_per_sm in (2, 1):  # the default, and fewer chunks (one a row at 300 rows)
        got = greedy_argmax(logits.to(dev), programs_per_sm)
        assert got.dtype == torch.long and got.shape == (batch,)
        assert torch.equal(got.cpu(), logits.argmax(dim=-1)), programs_per_sm
    assert got[0] == 7
    if batch > 1:
        assert got[1] == 0 and got[2] == 11
    assert greedy_argmax(logits[:0].to(dev)).shape == (0,)
