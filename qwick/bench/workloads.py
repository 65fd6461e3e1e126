"""Benchmark inputs: random token-id prompts, seeded, so every engine sees the same work."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    # Stay clear of the special tokens at the top of Qwen vocabularies.
    high = max(2, min(vocab_size, 150_000))
    return [rng.randrange(1, high) for _ in range(length)]


def fixed_requests(
    num: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(random_prompt(rng, input_len, vocab_size), output_len) for _ in range(num)]


def ranged_requests(
    num: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    """Lengths uniform in the given inclusive ranges (workload 3 of the benchmark method)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in = rng.randint(*input_range)
        n_out = rng.randint(*output_range)
        out.append(BenchRequest(random_prompt(rng, n_in, vocab_size), n_out))
    return out


def workload3_requests(vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """Workload 3 of the benchmark method (offline throughput): 256 requests, prompt and output lengths
    uniform in [100, 1024]."""
    return ranged_requests(256, (100, 1024), (100, 1024), vocab_size, seed)


def throughput_summary(requests: list[BenchRequest], seconds: float) -> dict:
    """Seconds and output tokens per second of a run that generated every request's `max_tokens`."""
    return {"seconds": seconds, "output_tokens_per_s": sum(r.max_tokens for r in requests) / seconds}
