"""The whole-prompt prefill path (`sdpa_prefill`) against the PyTorch reference backend, on the CPU: the
same outputs for fresh prompts with grouped-query heads, padded to length buckets or not, rows it is not
given left untouched, the rule that picks the rows (every multi-token row a whole sequence of at least
`min_tokens`), and the lengths its warm-up plans."""

from __future__ import annotations

import pytest
import torch

from qwick.layers.attention import sdpa_prefill
from qwick.layers.attention.backend import AttentionRow
from qwick.layers.attention.sdpa_prefill import causal_prefill_sdpa, padded_length, warm_up, whole_prompt_rows
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


@pytest.mark.parametrize("bucket", [1, 16, 64])
def test_whole_prompts_match_the_reference_backend(bucket):
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
    causal_prefill_sdpa(q, k, v, out, prompts, dim**-0.5, bucket)
    for start, n in prompts:
        torch.testing.assert_close(out[start : start + n], expected[start : start + n], atol=1e-5, rtol=1e-5)
    assert out[37].isnan().all()  # the decode row is not its to write


def test_rows_are_taken_only_when_every_extend_row_is_a_whole_long_prompt():
    md = TorchAttentionBackend(BLOCK, "cpu").build_metadata(_rows([(0, 600), (30, 1), (0, 800)])[0])
    assert whole_prompt_rows(md, [(0, 600), (2, 800)], min_tokens=512) == [(0, 600), (601, 800)]
    assert whole_prompt_rows(md, [(0, 600), (2, 800)], min_tokens=700) is None  # one prompt too short
    md = TorchAttentionBackend(BLOCK, "cpu").build_metadata(_rows([(0, 600), (64, 600)])[0])
    assert whole_prompt_rows(md, [(0, 600), (1, 600)], min_tokens=512) is None  # a cached prefix


def test_padded_lengths_and_the_warm_up_plans_each_once(monkeypatch):
    lengths = (512, 513, 767, 768, 2048, 2049)
    assert [padded_length(n, 256) for n in lengths] == [512, 768, 768, 768, 2048, 2304]
    calls = []
    real = sdpa_prefill.F.scaled_dot_product_attention
    monkeypatch.setattr(
        sdpa_prefill.F,
        "scaled_dot_product_attention",
        lambda q, k, v, **kw: calls.append(q.shape[2]) or real(q, k, v, **kw),
    )
    assert warm_up(4, 2, 8, torch.float32, torch.device("cpu"), 512, 1000, 256) == 3
    assert calls == [512, 768, 1024]  # one call per padded length
