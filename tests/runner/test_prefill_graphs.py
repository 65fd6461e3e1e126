"""CUDA graphs for a lone prompt chunk: the buckets, the padded input layout, the padded forward against the
eager step (under Triton's interpreter on the CPU too), and on the GPU the same tokens as eager serving with
the graphs really replayed."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from qwick import SamplingParams
from qwick.forward_context import set_forward_context
from qwick.layers.attention.backend import AttentionRow, OutputRows, kv_cache_tensor
from qwick.loader.model_loader import build_model
from qwick.runner.prefill_graphs import PrefillGraphRunner, prefill_buckets
from tests.triton_utils import triton_device
from tests.utils import gpu_graph_llm, make_tiny_model

BLOCK = 16


def test_prefill_buckets():
    assert prefill_buckets(512) == [32, 64, 128, 256, 384, 512]
    assert prefill_buckets(8192) == [32, 64, 128, 256, 384, 512, 768, 1024]
    assert prefill_buckets(300) == [32, 64, 128, 256]
    assert prefill_buckets(20) == [20]  # steps of fewer tokens than the first bucket
    assert prefill_buckets(1) == []


def test_inputs_are_padded_into_the_bucket_layout():
    """Tokens past the chunk are token 0 at position 0 with slot -1 (no KV write); the row's query range
    is the chunk's, its context includes the cached prefix, its last token is the output row."""
    runner = PrefillGraphRunner(
        torch.nn.Identity(),
        None,
        max_tokens=64,
        max_model_len=128,
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    chunk = list(range(100, 140))  # 40 tokens after a 20-token prefix: bucket 64
    p = runner.bucket_for(len(chunk))
    assert p == 64 and runner.bucket_for(65) is None
    table = [7, 3, 9, 4]
    runner._fill_host(p, [(chunk, 20, table)])
    runner._upload(p)
    v = runner._views(p)
    pos = torch.arange(20, 60)
    assert v["ids"][:40].tolist() == chunk and not v["ids"][40:].any()
    assert torch.equal(v["pos"][:40], pos.int()) and not v["pos"][40:].any()
    assert v["slots"][:40].tolist() == [table[i // BLOCK] * BLOCK + i % BLOCK for i in pos.tolist()]
    assert (v["slots"][40:] == -1).all()
    assert v["seq_len"].tolist() == [60]
    assert v["query_start_loc"].tolist() == [0, 40]
    assert v["last"].tolist() == [39]
    assert v["block_table"].tolist() == [table + [0] * (runner.width - 4)]
    assert not runner.can_run(40, 1, 4)  # nothing captured
    runner.graphs = dict.fromkeys(runner.buckets)
    assert runner.can_run(2, 1, 4) and runner.can_run(64, 1, runner.width)
    assert not runner.can_run(1, 1, 4) and not runner.can_run(65, 1, 4)
    assert not runner.can_run(40, 1, runner.width + 1) and not runner.can_run(40, 2, 4)  # one row at most


def _eager_step(model, backend, chunk: list[int], start: int, table: list[int], device) -> torch.Tensor:
    """The eager step's forward of one prompt chunk (`ModelRunner.launch`): every token, the last one out."""
    row = AttentionRow(start, len(chunk), table)
    md = backend.build_metadata([row])
    out = OutputRows(backend, [len(chunk) - 1], [row.last_query()])
    ids = torch.tensor(chunk, device=device)
    pos = torch.arange(start, start + len(chunk), device=device)
    with set_forward_context(md), torch.inference_mode():
        return model(ids, pos, out)


@pytest.mark.gpu
@pytest.mark.interpret
@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("qwen2", {}),
        ("qwen3", {}),
        ("qwen2", dict(use_sliding_window=True, sliding_window=24, max_window_layers=0)),
    ],
    ids=["qwen2", "qwen3", "qwen2-window"],
)
def test_padded_forward_matches_the_eager_step(tmp_path, arch, overrides):
    """A 70-token prompt in two chunks (40 tokens, then 30 after the cached 40): the padded bucket's last
    token equals the eager step's, the real tokens' keys and values are the eager step's, and the padding
    writes nothing into the cache (a sliding window of 24 tokens too)."""
    from qwick.layers.attention.triton_backend import TritonAttentionBackend

    device = triton_device()
    make_tiny_model(arch, str(tmp_path), **overrides)
    config = AutoConfig.from_pretrained(str(tmp_path))
    model = build_model(config, str(tmp_path), dtype=torch.float32, device=device, max_len=256)
    backend = TritonAttentionBackend(BLOCK, device)
    layers = model.attention_layers()
    for layer in layers:
        layer.kv_cache = kv_cache_tensor(
            lambda shape: torch.zeros(shape, device=device), 12, BLOCK, layer.num_kv_heads, layer.head_dim
        )
        layer.backend = backend
    runner = PrefillGraphRunner(
        model, backend, max_tokens=64, max_model_len=256, block_size=BLOCK, device=device
    )
    prompt = torch.randint(2, 300, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    table = [5, 2, 8, 3, 9]  # not in order; blocks 0 (null), 1, 4, 6, 7, 10, 11 stay untouched
    untouched = [0, 1, 4, 6, 7, 10, 11]
    for start, end in ((0, 40), (40, 70)):
        chunk = prompt[start:end]
        before = [layer.kv_cache.clone() for layer in layers]
        want = _eager_step(model, backend, chunk, start, table, device)
        want_caches = [layer.kv_cache.clone() for layer in layers]
        for layer, cache in zip(layers, before):
            layer.kv_cache.copy_(cache)
        got, _ = runner.run_eager(runner.bucket_for(len(chunk)), [(chunk, start, table)])
        assert got.shape == want.shape == (1, config.hidden_size)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for layer, cache, want_cache in zip(layers, before, want_caches):
            torch.testing.assert_close(layer.kv_cache, want_cache, atol=1e-5, rtol=1e-5)
            assert torch.equal(layer.kv_cache[:, untouched], cache[:, untouched])


def _serve_one_at_a_time(path: str, dtype: str, enforce_eager: bool, prompts: list[list[int]]):
    llm = gpu_graph_llm(path, dtype, enforce_eager, max_model_len=512)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    runner = llm.llm_engine.core.runner
    alone = runner.num_prefill_graph_replays
    # Two prompts in one step (one graph of several rows, or eager), and a prompt longer than the largest
    # bucket (eager).
    together = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params, use_tqdm=False)]
    llm.generate([list(range(5, 305))], params, use_tqdm=False)
    extra = runner.num_prefill_graph_replays - alone
    has_graphs = runner.prefill_graphs is not None
    del llm
    torch.cuda.empty_cache()
    return tokens, together, alone, extra, has_graphs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_graphs_give_the_eager_tokens(tiny_qwen2_dir, dtype, monkeypatch):
    """Prompts of 2-250 tokens served one at a time, with graphs of up to 256 tokens: each prefill replays
    a graph (the 260-token prompt hits the prefix cache after the 250-token one: a 20-token chunk over a
    cached context), and the greedy tokens are eager serving's."""
    from qwick.runner import prefill_graphs

    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    monkeypatch.setattr(prefill_graphs, "PREFILL_GRAPH_TOKENS", 256)
    g = torch.Generator().manual_seed(0)
    lengths = (2, 31, 33, 100, 250)
    prompts = [torch.randint(2, 300, (n,), generator=g).tolist() for n in lengths]
    prompts.append(prompts[4] + torch.randint(2, 300, (10,), generator=g).tolist())
    eager, eager_together, eager_alone, _, eager_graphs = _serve_one_at_a_time(
        tiny_qwen2_dir, dtype, True, prompts
    )
    graph, graph_together, alone, extra, has_graphs = _serve_one_at_a_time(
        tiny_qwen2_dir, dtype, False, prompts
    )
    assert not eager_graphs and eager_alone == 0
    assert has_graphs and alone == len(prompts) and extra == (prefill_graphs.PREFILL_GRAPH_ROWS > 1)
    assert graph == eager and graph_together == eager_together


@pytest.mark.gpu
@pytest.mark.interpret
def test_several_rows_in_one_padded_forward_match_the_eager_step(tmp_path):
    """`max_rows` 4: steps of three rows (a decode row, a chunk over a cached prefix, a new prompt) and of
    four (each query tile in use, the spare ones past row 0's queries) give each row's last token as the
    eager step does, and the same keys and values; blocks no row owns stay untouched."""
    from qwick.layers.attention.triton_backend import TritonAttentionBackend

    device = triton_device()
    make_tiny_model("qwen2", str(tmp_path))
    config = AutoConfig.from_pretrained(str(tmp_path))
    model = build_model(config, str(tmp_path), dtype=torch.float32, device=device, max_len=256)
    backend = TritonAttentionBackend(BLOCK, device)
    layers = model.attention_layers()
    gen = torch.Generator().manual_seed(1)
    for layer in layers:
        shape = (2, 16, BLOCK, layer.num_kv_heads, layer.head_dim)
        layer.kv_cache = torch.randn(shape, generator=gen).to(device)  # cached contexts with content
        layer.backend = backend
    runner = PrefillGraphRunner(
        model,
        backend,
        max_tokens=64,
        max_model_len=256,
        block_size=BLOCK,
        device=device,
        dtype=torch.float32,
        max_rows=4,
    )
    ids = lambda n: torch.randint(2, 300, (n,), generator=gen).tolist()  # noqa: E731
    steps = [
        [(ids(1), 30, [3, 5]), (ids(20), 40, [7, 1, 9, 2]), (ids(13), 0, [11])],
        [(ids(9), 0, [12]), (ids(1), 17, [13, 14]), (ids(30), 0, [4, 6]), (ids(2), 5, [15])],
    ]
    for step in steps:
        owned = {b for _, _, table in step for b in table}
        rows = [AttentionRow(start, len(t), table) for t, start, table in step]
        ends = (torch.tensor([len(t) for t, _, _ in step]).cumsum(0) - 1).tolist()
        before = [layer.kv_cache.clone() for layer in layers]
        with set_forward_context(backend.build_metadata(rows)), torch.inference_mode():
            want = model(
                torch.tensor([x for t, _, _ in step for x in t], device=device),
                torch.tensor([s + j for t, s, _ in step for j in range(len(t))], device=device),
                OutputRows(backend, ends, [r.last_query() for r in rows]),
            )
        want_caches = [layer.kv_cache.clone() for layer in layers]
        for layer, cache in zip(layers, before):
            layer.kv_cache.copy_(cache)
        got, (chunk, _) = runner.run_eager(runner.bucket_for(sum(len(t) for t, _, _ in step)), step)
        assert list(chunk.plan["triton"].tiles) == [runner.tile_rows(64)]  # the uploaded tiles only
        assert got.shape == (4, config.hidden_size)
        torch.testing.assert_close(got[: len(step)], want, atol=1e-4, rtol=1e-4)
        for layer, cache, want_cache in zip(layers, before, want_caches):
            torch.testing.assert_close(layer.kv_cache, want_cache, atol=1e-5, rtol=1e-5)
            untouched = [b for b in range(16) if b not in owned]
            assert torch.equal(layer.kv_cache[:, untouched], cache[:, untouched])
