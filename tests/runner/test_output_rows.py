"""Eager steps run the last layer past its KV write only for the tokens that sample (`OutputRows`): the
logits, the tokens and the KV cache are what the whole model gives, and the last layer's MLP really sees
only the sampling rows."""

from __future__ import annotations

import pytest
import torch

from qwick import LLM, SamplingParams
from tests.utils import record_sampled_logits

PROMPTS = [
    [(7 * i) % 300 + 5 for i in range(37)],
    list(range(10, 13)),
    [(3 * i + 1) % 300 + 5 for i in range(17)],
    [42] * 9,
]


def _llm(path: str, **overrides) -> LLM:
    kwargs = dict(dtype="float32", num_gpu_blocks_override=128, block_size=4, max_model_len=256)
    return LLM(path, **{**kwargs, **overrides})


def _run(llm: LLM, sampled_rows_only: bool):
    """Greedy outputs, each step's logits, and the KV caches after the run."""
    runner = llm.llm_engine.core.runner
    runner.sampled_rows_only = sampled_rows_only
    logits: list[torch.Tensor] = []
    record_sampled_logits(runner, logits)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    caches = [layer.kv_cache.clone() for layer in runner.model.attention_layers()]
    return [o.outputs[0].token_ids for o in outputs], logits, caches


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole-prompts", "chunks-of-5"])
def test_same_tokens_logits_and_cache_as_the_whole_model(tiny_qwen2_dir, chunk):
    """With 5-token chunks, most prefill steps sample nothing (a prompt's middle chunk)."""
    extra = {} if chunk is None else dict(max_num_batched_tokens=chunk, max_num_seqs=3)
    tokens_on, logits_on, caches_on = _run(_llm(tiny_qwen2_dir, enable_prefix_caching=False, **extra), True)
    tokens_off, logits_off, caches_off = _run(
        _llm(tiny_qwen2_dir, enable_prefix_caching=False, **extra), False
    )
    assert tokens_on == tokens_off
    assert len(logits_on) == len(logits_off)
    for on, off in zip(logits_on, logits_off):
        torch.testing.assert_close(on, off, atol=1e-5, rtol=0)
    for on, off in zip(caches_on, caches_off):
        assert torch.equal(on, off)


def test_last_layer_mlp_sees_only_the_sampling_rows(tiny_qwen2_dir):
    llm = _llm(tiny_qwen2_dir)
    runner = llm.llm_engine.core.runner
    layers = runner.model.model.layers
    seen: dict[str, list[int]] = {"first": [], "last": []}
    # (the MLP's last matmul: the layer runs the MLP's parts, so that a method may fuse the norm after it)
    layers[0].mlp.down_proj.register_forward_hook(lambda m, args, out: seen["first"].append(out.shape[0]))
    layers[-1].mlp.down_proj.register_forward_hook(lambda m, args, out: seen["last"].append(out.shape[0]))
    llm.generate(PROMPTS, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    # One prefill step of all four prompts: every token through the first layer, one per prompt leaves
    # the last.
    assert seen["first"] == [sum(len(p) for p in PROMPTS)]
    assert seen["last"] == [len(PROMPTS)]

    runner.sampled_rows_only = False
    seen["first"].clear()
    seen["last"].clear()
    llm.generate(PROMPTS, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    assert seen["last"] == seen["first"] and seen["last"][0] > len(PROMPTS)
