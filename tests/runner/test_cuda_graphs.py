"""CUDA-graph decode steps: same greedy tokens as eager, with padded buckets, and graphs really replayed;
capture survives garbage whose finalizers make CUDA calls a capturing stream forbids."""

from __future__ import annotations

import gc

import pytest
import torch

from qwick import SamplingParams
from qwick.runner.cuda_graphs import DecodeGraphRunner, decode_buckets, gc_paused, short_context_limit
from tests.utils import gpu_graph_llm


def test_decode_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(5) == [1, 2, 4, 5]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert decode_buckets(1000)[-1] == 256 and decode_buckets(20) == [1, 2, 4, 8, 16, 20]


def _run(path, dtype, enforce_eager, batches):
    llm = gpu_graph_llm(path, dtype, enforce_eager, max_model_len=512)
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


@pytest.mark.gpu
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


def test_short_context_limit_is_longer_for_a_lone_row():
    """One row replays its one-split graph up to `SHORT_CONTEXT_ONE_ROW` tokens, more rows up to
    `SHORT_CONTEXT_GRAPHS`; without one-split graphs, none does."""
    assert short_context_limit(1, 256, 512) == 512
    assert [short_context_limit(bs, 256, 512) for bs in (2, 8, 256)] == [256, 256, 256]
    assert short_context_limit(1, 256, 0) == 256  # the backend does not read a lone row early
    assert short_context_limit(1, 256, 128) == 256  # never shorter than the others'
    assert short_context_limit(1, 0, 512) == 0


def _assert_same_tokens(batches, eager, graph) -> None:
    for n, e, gr in zip(batches, eager, graph):
        for i, (a, b) in enumerate(zip(e, gr)):
            div = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            assert a == b, f"batch {n} request {i}: graph output diverges from eager at token {div}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_short_context_graphs_match_eager(tiny_qwen2_dir, dtype, monkeypatch):
    """`SHORT_CONTEXT_GRAPHS`: steps whose contexts all fit replay the one-split graphs, the others the
    usual ones (prompts of 1-59 tokens and 8-57 outputs cross the 64-token line, and a lone row's 96),
    same tokens as eager."""
    from qwick.runner import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "SHORT_CONTEXT_GRAPHS", 64)
    monkeypatch.setattr(cuda_graphs, "SHORT_CONTEXT_ONE_ROW", 96)
    batches = (3, 5, 1, 8)
    eager, _, _, _ = _run(tiny_qwen2_dir, dtype, True, batches)
    graph, replays, has_graphs, short = _run(tiny_qwen2_dir, dtype, False, batches)
    assert has_graphs and 0 < short < replays
    _assert_same_tokens(batches, eager, graph)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_with_the_decode_kernel_writing_the_kv_match_eager(tiny_qwen2_dir, dtype, monkeypatch):
    """`FUSE_DECODE_WRITE`: decode steps (graphs, eager when off) write their keys and values inside the
    decode kernel; the greedy tokens are those of eager steps with the separate write."""
    from qwick.layers.attention import triton_backend

    batches = (3, 5, 1, 8)
    eager, _, _, _ = _run(tiny_qwen2_dir, dtype, True, batches)
    monkeypatch.setattr(triton_backend, "FUSE_DECODE_WRITE", True)
    graph, replays, has_graphs, _ = _run(tiny_qwen2_dir, dtype, False, batches)
    assert has_graphs and replays > 0
    _assert_same_tokens(batches, eager, graph)


class _Cycle:
    """Garbage only the cyclic collector frees; its finalizer calls `on_free`."""

    def __init__(self, on_free) -> None:
        self.me, self.on_free = self, on_free

    def __del__(self) -> None:
        self.on_free()


def test_gc_paused_collects_first_and_restores_the_collector():
    freed = []
    _Cycle(lambda: freed.append("before"))
    with gc_paused():
        assert freed == ["before"] and not gc.isenabled()
        _Cycle(lambda: freed.append("inside"))
        junk = [[] for _ in range(10 * gc.get_threshold()[0])]  # would trigger automatic collections
        assert freed == ["before"] and junk  # the collector stayed off
    assert gc.isenabled()
    gc.collect()
    assert freed == ["before", "inside"]
    gc.disable()
    try:
        with pytest.raises(RuntimeError), gc_paused():
            raise RuntimeError
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()


@pytest.mark.gpu
def test_capture_survives_garbage_that_syncs_when_freed(tiny_qwen2_dir, monkeypatch):
    """Every forward the graph runner runs (warm-ups and captures) leaves a cycle whose finalizer
    synchronizes the device, which a capturing stream forbids, and the collector runs every few
    allocations: with the collector paused during capture, the graphs are still captured and replayed."""
    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    forward = DecodeGraphRunner._forward

    def forward_leaving_garbage(self, bs, md):
        _Cycle(torch.cuda.synchronize)
        return forward(self, bs, md)

    monkeypatch.setattr(DecodeGraphRunner, "_forward", forward_leaving_garbage)
    threshold = gc.get_threshold()
    gc.set_threshold(5, 1, 1)
    try:
        results, replays, has_graphs, _ = _run(tiny_qwen2_dir, "bfloat16", False, (2,))
    finally:
        gc.set_threshold(*threshold)
    assert has_graphs and replays > 0
    assert all(len(tokens) == 8 + 7 * i for i, tokens in enumerate(results[0]))
