"""qwick's side of each workload, driven through the same engine `LLM` uses."""

from __future__ import annotations

import statistics
import time

from qwick.bench.workloads import BenchRequest
from qwick.entrypoints.llm import LLM
from qwick.sampling_params import SamplingParams


def step_timings(llm: LLM, requests: list[BenchRequest], temperature: float = 0.0) -> dict:
    """Run requests together, timing every engine step: the first steps prefill, the rest decode."""
    engine = llm.llm_engine
    for r in requests:
        params = SamplingParams(max_tokens=r.max_tokens, temperature=temperature, ignore_eos=True)
        engine.add_request(r.prompt_token_ids, params)
    steps: list[tuple[float, int]] = []  # (seconds, tokens produced)
    first_token_at = None
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        produced = sum(1 for o in outs if o.outputs and o.outputs[0].token_ids)
        steps.append((dt, produced))
        if first_token_at is None and produced:
            first_token_at = time.perf_counter() - start
    total = time.perf_counter() - start
    batch = len(requests)
    decode = [dt for dt, n in steps if n == batch][1:]  # full-batch decode steps, skipping the first
    generated = sum(r.max_tokens for r in requests)
    median = statistics.median(decode) if decode else float("nan")
    return {
        "ttft_ms": 1000 * (first_token_at or float("nan")),
        "decode_step_ms_median": 1000 * median,
        "decode_tokens_per_s": batch / median if decode else float("nan"),
        "total_s": total,
        "output_tokens_per_s": generated / total,
    }


def throughput(llm: LLM, requests: list[BenchRequest], temperature: float = 0.6, seed: int = 0) -> dict:
    """One `generate` over all requests after a warm-up (the method nano-vllm and mini-sglang use)."""
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=temperature, ignore_eos=True, seed=seed + i)
        for i, r in enumerate(requests)
    ]
    prompts = [r.prompt_token_ids for r in requests]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(r.max_tokens for r in requests)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "seconds": seconds,
        "output_tokens_per_s": generated / seconds,
        "total_tokens_per_s": (generated + prompt_tokens) / seconds,
        "requests_per_s": len(requests) / seconds,
    }
