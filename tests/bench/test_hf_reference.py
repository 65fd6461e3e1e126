import torch

from qwick.bench.hf_reference import TokenClock, latency, load_transformers
from qwick.bench.workloads import BenchRequest


def test_token_clock_skips_the_prompt_and_times_each_new_token_in_order():
    clock = TokenClock()
    clock.put(torch.tensor([[1, 2, 3]]))  # the prompt, as `generate` hands it over first
    assert clock.times == []
    for token in (4, 5, 6):
        clock.put(torch.tensor([token]))
    clock.end()
    assert len(clock.times) == 3
    assert clock.start <= clock.times[0] <= clock.times[1] <= clock.times[2]


def test_transformers_latency_gives_positive_times_from_one_generate(tiny_qwen2_dir):
    model = load_transformers(tiny_qwen2_dir, torch.float32)
    request = BenchRequest(prompt_token_ids=list(range(3, 13)), max_tokens=5)
    result = latency(model, request)
    assert result["ttft_ms"] > 0 and result["decode_step_ms"] > 0 and result["decode_tokens_per_s"] > 0
    # the first token and the four steps after it all lie inside the one timed run
    assert result["ttft_ms"] + result["decode_step_ms"] <= result["total_s"] * 1000
