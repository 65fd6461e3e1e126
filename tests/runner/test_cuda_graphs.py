"""CUDA-graph decode steps: same greedy tokens as eager, with padded buckets, and graphs really replayed."""

from __future__ import annotations

import pytest
import torch

from qwick import LLM, SamplingParams
from qwick.runner.cuda_graphs import decode_buckets

pytestmark = pytest.mark.gpu


def test_decode_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(5) == [1, 2, 4, 5]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert decode_buckets(1000)[-1] == 256 and decode_buckets(20) == [1, 2, 4, 8, 16, 20]


def _run(path, dtype, enforce_eager, batches):
    llm = LLM(
        path,
        dtype=dtype,
        device="cuda",
        attention_backend="triton",
        enforce_eager=enforce_eager,
        max_model_len=512,
        max_num_seqs=8,
        num_gpu_blocks_override=256,
    )
    g = torch.Generator().manual_seed(0)
    results = []
    for n in batches:
        prompts = [
            torch.randint(2, 300, (int(L),), generator=g).tolist()
            for L in (torch.randint(1, 60, (n,), generator=g))
        ]
        # Different lengths so requests finish at different steps (the batch shrinks across buckets).
        params = [SamplingParams(max_tokens=8 + 7 * i, temperature=0, ignore_eos=True) for i in range(n)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
    runner = llm.llm_engine.core.runner
    replays = runner.num_graph_replays
    has_graphs = runner.graph_runner is not None
    short = runner.graph_runner.num_short_replays if has_graphs else 0
    del llm
    torch.cuda.empty_cache()
    return results, replays, has_graphs, short


@pytest.mark.parametrize("longest_first", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_match_eager(tiny_qwen2_dir, dtype, longest_first, monkeypatch):
    """`longest_first`: decode rows launched longest context first, in the graphs' uploaded row order
    as in eager steps."""
    from qwick.layers.attention import triton_backend

    monkeypatch.setattr(triton_backend, "LONGEST_FIRST", longest_first)
    batches = (3, 5, 1, 8)
    eager, eager_replays, eager_graphs, _ = _run(tiny_qwen2_dir, dtype, True, batches)
    graph, replays, has_graphs, _ = _run(tiny_qwen2_dir, dtype, False, batches)
    assert not eager_graphs and eager_replays == 0
    assert has_graphs and replays > 0
    _assert_same_tokens(batches, eager, graph)


def _assert_same_tokens(batches, eager, graph) -> None:
    for n, e, gr in zip(batches, eager, graph):
        for i, (a, b) in enumerate(zip(e, gr)):
            div = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            assert a == b, f"batch {n} request {i}: graph output diverges from eager at token {div}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_short_context_graphs_match_eager(tiny_qwen2_dir, dtype, monkeypatch):
    """`SHORT_CONTEXT_GRAPHS`: steps whose contexts all fit replay the one-split graphs, the others the
    usual ones (prompts of 1-59 tokens and 8-57 outputs cross the 64-token line), same tokens as eager."""
    from qwick.runner import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "SHORT_CONTEXT_GRAPHS", 64)
    batches = (3, 5, 1, 8)
    eager, _, _, _ = _run(tiny_qwen2_dir, dtype, True, batches)
    graph, replays, has_graphs, short = _run(tiny_qwen2_dir, dtype, False, batches)
    assert has_graphs and 0 < short < replays
    _assert_same_tokens(batches, eager, graph)
