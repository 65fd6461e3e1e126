"""Attention with output rows: every token's keys and values are cached, and the chosen tokens' outputs are
the ones a full forward gives them (each attended as a one-query row over its own context)."""

from __future__ import annotations

import random

import pytest
import torch

from qwick.layers.attention.backend import AttentionRow, OutputRows
from qwick.layers.attention.torch_ref import TorchAttentionBackend
from tests.triton_utils import INTERPRET, triton_device

BLOCK = 4
KV_HEADS, GROUP, HEAD_DIM = 2, 3, 32


def _step(specs, device, dtype, seed=0):
    """A step of rows (cached context, new tokens) with random q/k/v and a random cache."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    need = [(c + n + BLOCK - 1) // BLOCK for c, n in specs]
    ids = list(range(1, sum(need) + 1))
    rng.shuffle(ids)
    rows, at = [], 0
    for (c, n), m in zip(specs, need):
        rows.append(AttentionRow(c, n, ids[at : at + m]))
        at += m
    tokens = sum(n for _, n in specs)
    q = torch.randn(tokens, KV_HEADS * GROUP, HEAD_DIM, device=device).to(dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=device).to(dtype)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=device).to(dtype)
    cache = torch.randn(2, len(ids) + 1, BLOCK, KV_HEADS, HEAD_DIM, device=device).to(dtype)
    return rows, q, k, v, cache


def _chosen(rows: list[AttentionRow], picks: list[tuple[int, int]]) -> tuple[list[int], list[AttentionRow]]:
    """(row, offset among its new tokens) -> flat token indices and one-query rows at those positions."""
    starts = [0]
    for r in rows:
        starts.append(starts[-1] + r.num_tokens)
    index = [starts[i] + j for i, j in picks]
    one = [AttentionRow(rows[i].start_pos + j, 1, rows[i].block_table) for i, j in picks]
    return index, one


CASES = {
    # rows: (cached context, new tokens); picks: (row, token) whose outputs are wanted
    "prompts' last tokens": ([(0, 9), (0, 1), (5, 7)], [(0, 8), (1, 0), (2, 6)]),
    "middle tokens, out of order": ([(3, 11), (0, 6)], [(1, 2), (0, 0), (0, 5)]),
    "decode rows and a chunk": ([(17, 1), (8, 5), (30, 1)], [(0, 0), (1, 4), (2, 0)]),
}


def _check(backend, device, dtype, specs, picks, sliding_window, atol):
    rows, q, k, v, cache = _step(specs, device, dtype)
    kw = dict(scale=HEAD_DIM**-0.5, sliding_window=sliding_window)
    full_cache = cache.clone()
    full = backend.forward(q.clone(), k, v, full_cache, backend.build_metadata(rows), **kw)
    index, one = _chosen(rows, picks)
    out_rows = OutputRows(backend, index, one)
    part = backend.forward(q.clone(), k, v, cache, backend.build_metadata(rows), output_rows=out_rows, **kw)
    assert part.shape == (len(picks), *q.shape[1:])
    assert torch.equal(cache, full_cache), "output rows changed what the cache holds"
    torch.testing.assert_close(part, full[index], atol=atol, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_torch_backend_output_rows_match_the_full_forward(case, sliding_window):
    specs, picks = CASES[case]
    backend = TorchAttentionBackend(BLOCK, torch.device("cpu"))
    _check(backend, torch.device("cpu"), torch.float32, specs, picks, sliding_window, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.interpret
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_triton_backend_output_rows_match_the_full_forward(case, sliding_window):
    """The one-query rows go through the decode kernel, the full forward through the prefill kernel: the
    same attention, summed in another order (fp32 here, so the difference is rounding)."""
    from qwick.layers.attention.triton_backend import TritonAttentionBackend

    device = triton_device()
    specs, picks = CASES[case]
    backend = TritonAttentionBackend(BLOCK, device)
    _check(backend, device, torch.float32, specs, picks, sliding_window, atol=1e-4)
    if not INTERPRET:  # and in bf16, within the kernels' usual tolerance
        _check(backend, device, torch.bfloat16, specs, picks, sliding_window, atol=2e-2)


def test_output_rows_are_one_query_each():
    backend = TorchAttentionBackend(BLOCK, torch.device("cpu"))
    with pytest.raises(ValueError, match="one query token"):
        OutputRows(backend, [0], [AttentionRow(0, 2, [1])])
    with pytest.raises(ValueError, match="at least one"):
        OutputRows(backend, [], [])
