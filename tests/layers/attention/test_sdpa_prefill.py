"""The whole-prompt prefill path (`sdpa_prefill`) against the PyTorch reference backend, on the CPU: the
same outputs for fresh prompts with grouped-query heads, rows it is not given left untouched, and the rule
that picks the rows (every multi-token row a whole sequence of at least `min_tokens`)."""

from __future__ import annotations

import torch

from qwick.layers.attention.backend import AttentionRow
from qwick.layers.attention.sdpa_prefill import causal_prefill_sdpa, whole_prompt_rows
from qwick.layers.attention.torch_ref import TorchAttentionBackend

BLOCK = 16


def _rows(specs):
    """(cached tokens, new tokens) per row -> rows with disjoint block tables (block 0 is the null block)."""
    rows, next_block = [], 1
    for ctx, n in specs:
        blocks = (ctx + n + BLOCK - 1) // BLOCK
        rows.append(AttentionRow(ctx, n, list(range(next_block, next_block + blocks))))
        next_block += blocks
    return rows, next_block


def test_whole_prompts_match_the_reference_backend():
    torch.manual_seed(0)
    specs = [(0, 37), (9, 1), (0, 70), (0, 5)]  # three whole prompts and a decode row
    num_kv, group, dim = 2, 7, 64
    rows, num_blocks = _rows(specs)
    tokens = sum(n for _, n in specs)
    q = 2 * torch.randn(tokens, num_kv * group, dim)
    k, v = torch.randn(tokens, num_kv, dim), torch.randn(tokens, num_kv, dim)
    ref = TorchAttentionBackend(BLOCK, "cpu")
    md = ref.build_metadata(rows)
    cache = torch.zeros(2, num_blocks, BLOCK, num_kv, dim)
    expected = ref.forward(q, k, v, cache, md, scale=dim**-0.5, sliding_window=None)

    prompts = whole_prompt_rows(md, [(0, 37), (2, 70), (3, 5)], min_tokens=1)
    assert prompts == [(0, 37), (38, 70), (108, 5)]
    out = torch.full_like(q, float("nan"))
    causal_prefill_sdpa(q, k, v, out, prompts, dim**-0.5)
    for start, n in prompts:
        torch.testing.assert_close(out[start : start + n], expected[start : start + n], atol=1e-5, rtol=1e-5)
    assert out[37].isnan().all()  # the decode row is not its to write


def test_rows_are_taken_only_when_every_extend_row_is_a_whole_long_prompt():
    md = TorchAttentionBackend(BLOCK, "cpu").build_metadata(_rows([(0, 600), (30, 1), (0, 800)])[0])
    assert whole_prompt_rows(md, [(0, 600), (2, 800)], min_tokens=512) == [(0, 600), (601, 800)]
    assert whole_prompt_rows(md, [(0, 600), (2, 800)], min_tokens=700) is None  # one prompt too short
    md = TorchAttentionBackend(BLOCK, "cpu").build_metadata(_rows([(0, 600), (64, 600)])[0])
    assert whole_prompt_rows(md, [(0, 600), (1, 600)], min_tokens=512) is None  # a cached prefix
