"""qwick's side of each workload, driven through the same engine `LLM` uses."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

from qwick.bench.workloads import BenchRequest
from qwick.entrypoints.llm import LLM
from qwick.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from qwick.engine.llm_engine import LLMEngine

# The schema of `--structured`: records with nested arrays, enums, bounded numbers and patterned strings.
# `minItems` is out of reach, so the grammar never completes and every request makes exactly its
# max_tokens, as the unconstrained run does: tokens/s compare like for like on the same prompts.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 100000,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "name": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
                    "kind": {"enum": ["alpha", "beta", "gamma"]},
                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                        "maxItems": 3,
                    },
                },
                "required": ["id", "name", "kind", "score", "tags"],
            },
        }
    },
    "required": ["records"],
}


def step_timings(
    llm: LLM,
    requests: list[BenchRequest],
    temperature: float = 0.0,
    structured: StructuredOutputsParams | None = None,
) -> dict:
    """Run requests together, timing every engine step: the first steps prefill, the rest decode."""
    engine = llm.llm_engine
    for r in requests:
        params = SamplingParams(
            max_tokens=r.max_tokens, temperature=temperature, ignore_eos=True, structured_outputs=structured
        )
        engine.add_request(r.prompt_token_ids, params)
    steps: list[tuple[float, int]] = []  # (seconds, tokens produced)
    first_token_at = None
    start = time.perf_counter()
    generated = 0
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        produced = sum(1 for o in outs if o.outputs and o.outputs[0].token_ids)
        steps.append((dt, produced))
        generated += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
        if first_token_at is None and produced:
            first_token_at = time.perf_counter() - start
    total = time.perf_counter() - start
    batch = len(requests)
    decode = [dt for dt, n in steps if n == batch][1:]  # full-batch decode steps, skipping the first
    median = statistics.median(decode) if decode else float("nan")
    return {
        "ttft_ms": 1000 * (first_token_at or float("nan")),
        "decode_step_ms_median": 1000 * median,
        "decode_tokens_per_s": batch / median if decode else float("nan"),
        "total_s": total,
        "output_tokens_per_s": generated / total,
    }


def throughput(
    llm: LLM,
    requests: list[BenchRequest],
    temperature: float = 0.6,
    structured: StructuredOutputsParams | None = None,
) -> dict:
    """One `generate` over all requests after a warm-up (the method nano-vllm and mini-sglang use).

    Randomness comes from the engine's seed (`--seed`, 0 by default), as in bench.md and nano-vllm; no
    per-request seeds, which would sample each row with its own generator.

    `structured`: constrain every request (the warm-up too, so the grammar is compiled before timing)."""
    params = [
        SamplingParams(
            max_tokens=r.max_tokens,
            temperature=temperature,
            ignore_eos=True,
            structured_outputs=structured,
        )
        for r in requests
    ]
    prompts = [r.prompt_token_ids for r in requests]
    warm_up = SamplingParams(max_tokens=4, ignore_eos=True, structured_outputs=structured)
    llm.generate(prompts[:1], warm_up, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "seconds": seconds,
        "output_tokens": generated,
        "output_tokens_per_s": generated / seconds,
        "total_tokens_per_s": (generated + prompt_tokens) / seconds,
        "requests_per_s": len(requests) / seconds,
    }


def first_token_seconds(engine: LLMEngine, prompt_token_ids: list[int]) -> float:
    """Time to first token of one greedy prompt on an idle `LLMEngine`: the engine steps from the request's
    addition until it is done (one output token), between device synchronizations."""
    import torch

    engine.add_request(prompt_token_ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start
