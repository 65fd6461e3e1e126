"""Steps of decode rows and one prompt chunk as two graph replays (`ModelRunner.split_mixed_max_tokens`): the
step is split, the halves' inputs (tokens still in flight under async scheduling included) and outputs are
put back in order, and the tokens and logits are the single eager forward's. On the CPU the two graph
runners are stand-ins that compute what a replay computes, eagerly; the GPU test replays real graphs."""

from __future__ import annotations

import pytest
import torch

from qwick import LLM, SamplingParams
from qwick.forward_context import set_forward_context
from qwick.layers.attention.backend import AttentionRow, OutputRows
from tests.utils import gpu_graph_llm, record_sampled_logits


class _EagerDecodeGraphs:
    """A `DecodeGraphRunner` stand-in: a replay's result (every row's final hidden state), eagerly."""

    def __init__(self, runner) -> None:
        self.runner, self.num_replays = runner, 0

    def can_run(self, num_rows: int, table_len: int) -> bool:
        return True

    def replay(self, token_ids, positions, block_tables, patch=None) -> torch.Tensor:
        r = self.runner
        md = r.backend.build_metadata([AttentionRow(p, 1, t) for p, t in zip(positions, block_tables)])
        ids = torch.tensor(token_ids)
        if patch is not None:
            patch(ids)
        self.num_replays += 1
        with set_forward_context(md):
            return r.model(ids, torch.tensor(positions))


class _EagerPrefillGraphs:
    """A `PrefillGraphRunner` stand-in: a replay's result (the chunk's last token), eagerly."""

    def __init__(self, runner) -> None:
        self.runner, self.num_replays = runner, 0

    def can_run(self, num_tokens: int, num_rows: int, table_len: int) -> bool:
        return 1 < num_tokens <= 64 and num_rows == 1

    def replay(self, rows, patch=None) -> torch.Tensor:
        ((token_ids, start, block_table),) = rows
        r = self.runner
        row = AttentionRow(start, len(token_ids), block_table)
        out = OutputRows(r.backend, [len(token_ids) - 1], [row.last_query()])
        ids = torch.tensor(token_ids)
        if patch is not None:
            patch(ids)
        self.num_replays += 1
        with set_forward_context(r.backend.build_metadata([row])):
            return r.model(ids, torch.arange(start, start + len(token_ids)), out)


def _staggered(llm: LLM) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    """Four requests arriving one every three steps (the later ones while the earlier decode), one of 90
    tokens (chunked into 64 + 26 by the step budget): greedy tokens per request and every step's logits."""
    runner = llm.llm_engine.core.runner
    logits: list[torch.Tensor] = []
    record_sampled_logits(runner, logits)
    eng = llm.llm_engine
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (20, 33, 90, 5)]
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    step = 0
    while prompts or eng.has_unfinished_requests():
        if prompts and step % 3 == 0:
            eng.add_request(prompts.pop(0), params, request_id=f"r{step}")
        for out in eng.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        step += 1
    return tokens, logits


def _eager_then_fresh(path: str, async_scheduling: bool):
    """The staggered run's tokens and logits on an eager LLM, and a fresh LLM of the same settings (steps of
    at most 64 tokens: the 90-token prompt comes in two chunks) for the stand-ins."""
    kwargs = dict(
        dtype="float32",
        block_size=4,
        max_model_len=256,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
        enable_prefix_caching=False,
    )
    return _staggered(LLM(path, **kwargs)), LLM(path, **kwargs)


def _assert_same_as_eager(got: tuple, want_tokens: dict, want_logits: list) -> None:
    """Greedy tokens equal, and every step's logits close, with as many rows as the eager step's."""
    tokens, logits = got
    assert tokens == want_tokens
    assert [x.shape for x in logits] == [x.shape for x in want_logits]
    for g, w in zip(logits, want_logits):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


class _FourRowPrefillGraphs:
    """A `PrefillGraphRunner` stand-in with `max_rows` 4: steps of up to four rows, and, as a replay's
    output, each row's last token followed by rows the step does not use (NaN here)."""

    def __init__(self, runner) -> None:
        self.runner, self.num_replays, self.rows_seen = runner, 0, []

    def can_run(self, num_tokens: int, num_rows: int, table_len: int) -> bool:
        return 1 < num_tokens <= 64 and num_rows <= 4

    def replay(self, rows, patch=None) -> torch.Tensor:
        r = self.runner
        att = [AttentionRow(start, len(ids), table) for ids, start, table in rows]
        ends = torch.tensor([len(ids) for ids, _, _ in rows]).cumsum(0) - 1
        out = OutputRows(r.backend, ends.tolist(), [a.last_query() for a in att])
        ids = torch.tensor([t for step_ids, _, _ in rows for t in step_ids])
        if patch is not None:
            patch(ids)
        pos = torch.tensor([p for a in att for p in range(a.start_pos, a.seq_len)])
        self.num_replays += 1
        self.rows_seen.append(len(rows))
        with set_forward_context(r.backend.build_metadata(att)):
            last = r.model(ids, pos, out)
        return torch.cat([last, torch.full((4 - len(rows), last.shape[1]), float("nan"))])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_several_row_prefill_graphs_give_the_eager_tokens_and_logits(tiny_qwen2_dir, async_scheduling):
    """Steps of up to four rows through one prefill graph (a prompt alone, or beside decode rows): the
    sampling rows' logits, and no more rows than sample (the graph's unused rows stay out), are the eager
    step's."""
    (want_tokens, want_logits), llm = _eager_then_fresh(tiny_qwen2_dir, async_scheduling)
    runner = llm.llm_engine.core.runner
    runner.graph_runner, runner.prefill_graphs = _EagerDecodeGraphs(runner), _FourRowPrefillGraphs(runner)
    _assert_same_as_eager(_staggered(llm), want_tokens, want_logits)
    seen = runner.prefill_graphs.rows_seen
    assert 1 in seen and max(seen) > 1  # a lone prompt, and a prompt beside decode rows


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_split_steps_give_the_eager_tokens_and_logits(tiny_qwen2_dir, async_scheduling):
    (want_tokens, want_logits), llm = _eager_then_fresh(tiny_qwen2_dir, async_scheduling)
    runner = llm.llm_engine.core.runner
    runner.graph_runner, runner.prefill_graphs = _EagerDecodeGraphs(runner), _EagerPrefillGraphs(runner)
    runner.split_mixed_max_tokens = 64
    split = runner._split_replay
    splits = []
    runner._split_replay = lambda *a: splits.append(split(*a)) or splits[-1]
    _assert_same_as_eager(_staggered(llm), want_tokens, want_logits)
    # Mixed steps were split (a chunk beside decode rows), the 64-token chunk (the limit) included.
    assert sum(s is not None for s in splits) >= 3
    assert runner.prefill_graphs.num_replays > sum(s is not None for s in splits)  # lone chunks too


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_steps_replay_graphs_with_the_eager_tokens(tiny_qwen2_dir, dtype, monkeypatch):
    from qwick.runner import prefill_graphs

    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    want, _ = _staggered(gpu_graph_llm(tiny_qwen2_dir, dtype, True, max_model_len=256))
    monkeypatch.setattr(prefill_graphs, "PREFILL_GRAPH_ROWS", 1)  # else <= 3 decoders + a prompt: one graph
    llm = gpu_graph_llm(tiny_qwen2_dir, dtype, False, max_model_len=256)
    runner = llm.llm_engine.core.runner
    runner.split_mixed_max_tokens = 128  # the 90-token prompt is one chunk here (no token budget set)
    prefill_replays = runner.num_prefill_graph_replays
    got, _ = _staggered(llm)
    assert got == want
    assert runner.num_prefill_graph_replays - prefill_replays >= 4  # 1 lone and 3 split chunks, at least


def test_a_chunk_between_decode_rows_is_put_back_in_place(tiny_qwen2_dir):
    """The chunk in the middle of the step, and a decode row after it whose token is in flight: the split
    step's sampling rows, and what it writes into the cache, are those of one eager forward."""
    llm = LLM(tiny_qwen2_dir, dtype="float32", block_size=4, max_model_len=64, enable_prefix_caching=False)
    runner = llm.llm_engine.core.runner
    runner.graph_runner, runner.prefill_graphs = _EagerDecodeGraphs(runner), _EagerPrefillGraphs(runner)
    runner.split_mixed_max_tokens = 64
    layers = runner.model.attention_layers()
    for layer in layers:
        layer.kv_cache.normal_(generator=torch.Generator().manual_seed(1))  # contexts with content
    before = [layer.kv_cache.clone() for layer in layers]
    rows = [AttentionRow(10, 1, [1, 2, 3]), AttentionRow(0, 6, [4, 5]), AttentionRow(7, 1, [6, 7])]
    token_ids = [11, 21, 22, 23, 24, 25, 26, 0]  # the last one in flight: the previous step's sample 1
    positions = [10, *range(6), 7]
    runner._prev_sampled = torch.tensor([40, 41])
    with torch.inference_mode():
        got = runner._split_replay(rows, token_ids, positions, [7], [1], [0, 1, 2])
        split_caches = [layer.kv_cache.clone() for layer in layers]
        for layer, cache in zip(layers, before):
            layer.kv_cache.copy_(cache)
        out = OutputRows(runner.backend, [0, 6, 7], [r.last_query() for r in rows])
        ids = torch.tensor(token_ids[:7] + [41])
        with set_forward_context(runner.backend.build_metadata(rows)):
            want = runner.model(ids, torch.tensor(positions), out)
    assert got is not None and got.shape == want.shape == (3, runner.hf_config.hidden_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for layer, cache in zip(layers, split_caches):
        torch.testing.assert_close(cache, layer.kv_cache, atol=1e-6, rtol=1e-6)
    # Not split: two chunks, a chunk over the limit, a chunk whose own input is in flight.
    two = [rows[1], AttentionRow(0, 6, [8, 9])]
    assert runner._split_replay(two, token_ids[1:7] * 2, positions[1:7] * 2, [], [], [0, 1]) is None
    runner.split_mixed_max_tokens = 5
    assert runner._split_replay(rows, token_ids, positions, [], [], [0, 1, 2]) is None
    runner.split_mixed_max_tokens = 64
    assert runner._split_replay(rows, token_ids, positions, [6], [1], [0, 1, 2]) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_mixed_steps_replay_one_prefill_graph(tiny_qwen2_dir, dtype, monkeypatch):
    """`PREFILL_GRAPH_ROWS` 4: a new prompt's chunk beside up to three decode rows replays one prefill
    graph (no split needed); the greedy tokens are eager serving's."""
    from qwick.runner import prefill_graphs

    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    want, _ = _staggered(gpu_graph_llm(tiny_qwen2_dir, dtype, True, max_model_len=256))
    monkeypatch.setattr(prefill_graphs, "PREFILL_GRAPH_ROWS", 4)
    llm = gpu_graph_llm(tiny_qwen2_dir, dtype, False, max_model_len=256)
    runner = llm.llm_engine.core.runner
    assert runner.prefill_graphs.max_rows == 4
    got, _ = _staggered(llm)
    assert got == want
    assert runner.num_prefill_graph_replays >= 4  # every arrival's step, the mixed ones included
