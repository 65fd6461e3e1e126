"""Our decoder against transformers on the same random weights: logits at prefill and at every decode step,
and greedy tokens, for batches of mixed lengths, under prefix caching, preemption and chunked prefill."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from qwick import LLM, SamplingParams
from tests.utils import hf_greedy, hf_logits, make_tiny_model, record_sampled_logits

VARIANTS = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama": ("llama", {}),
    "qwen2-sliding-window": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen2-yarn": (
        "qwen2",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "rope_theta": 10000.0,
            }
        ),
    ),
    "llama-linear-rope": (
        "llama",
        dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    ),
}
PROMPTS = [
    list(range(10, 13)),
    [(7 * i) % 300 + 5 for i in range(37)],
    [(3 * i + 1) % 300 + 5 for i in range(17)],
    [42] * 9,
]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    model = make_tiny_model(arch, path, **overrides)
    return path, model


class LogitsRecorder:
    """Wraps the runner so each request's logits rows are kept, step by step: the sampler's input
    (`record_sampled_logits`), matched to requests in `launch`, which the synchronous `execute` calls and
    async scheduling calls directly."""

    def __init__(self, llm: LLM) -> None:
        runner = llm.llm_engine.core.runner
        self.by_request: dict[str, list[torch.Tensor]] = defaultdict(list)
        captured: list[torch.Tensor] = []
        launch = runner.launch
        record_sampled_logits(runner, captured)

        def recording_launch(scheduler_output):
            captured.clear()
            result = launch(scheduler_output)
            rows = [s.request_id for s in scheduler_output.scheduled if s.sample]
            if captured:
                for rid, row in zip(rows, captured[-1]):
                    self.by_request[rid].append(row)
            return result

        runner.launch = recording_launch


def check_against_reference(llm: LLM, hf_model, prompts, max_tokens=MAX_TOKENS) -> list:
    recorder = LogitsRecorder(llm)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(hf_model, prompt, max_tokens), (
            f"greedy tokens differ for prompt {prompt[:5]}"
        )
        ref = hf_logits(hf_model, prompt + tokens)
        ours = torch.stack(recorder.by_request[out.request_id]).cpu()
        assert ours.shape[0] == max_tokens  # one logits row per generated token
        expected = ref[len(prompt) - 1 : len(prompt) - 1 + max_tokens]
        torch.testing.assert_close(ours, expected.to(ours.device), atol=1e-4, rtol=0)
    return outputs


def exact_llm(path: str, **overrides) -> LLM:
    """fp32 (the oracle's dtype), 4-token blocks so short prompts span several, a small KV pool."""
    kwargs = dict(dtype="float32", num_gpu_blocks_override=128, block_size=4, max_model_len=256)
    return LLM(path, **{**kwargs, **overrides})


def test_batch_of_mixed_lengths(tiny):
    path, hf_model = tiny
    llm = exact_llm(path, enable_prefix_caching=False)
    check_against_reference(llm, hf_model, PROMPTS)
    assert llm.llm_engine.core.scheduler.get_stats().kv_cache_usage == 0.0


def test_prefix_caching_repeated_prompt(tiny):
    path, hf_model = tiny
    llm = exact_llm(path, enable_prefix_caching=True)
    check_against_reference(llm, hf_model, PROMPTS[1:2])
    # Same prompt again, plus one sharing its first 20 tokens: both must reuse cached blocks.
    shared = PROMPTS[1][:20] + [11, 12, 13]
    outputs = check_against_reference(llm, hf_model, [PROMPTS[1], shared])
    assert outputs[0].num_cached_tokens == 36  # 37 tokens: 9 full blocks hit, capped below len - 1
    assert outputs[1].num_cached_tokens == 20


def test_preemption_with_tiny_kv_pool(tiny):
    path, hf_model = tiny
    # 16 usable blocks of 4 tokens (64 slots) for four requests needing up to 49 positions each.
    llm = exact_llm(path, num_gpu_blocks_override=17, enable_prefix_caching=False, max_model_len=64)
    check_against_reference(llm, hf_model, PROMPTS)
    stats = llm.llm_engine.core.scheduler.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0


def test_chunked_prefill_in_small_chunks(tiny):
    path, hf_model = tiny
    llm = exact_llm(path, max_num_batched_tokens=5, max_num_seqs=3)
    check_against_reference(llm, hf_model, PROMPTS)
