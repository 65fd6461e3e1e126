"""The reference: transformers' own model and `generate` on the same weights and the same inputs."""

from __future__ import annotations

import statistics
import time

import torch
from transformers.generation.streamers import BaseStreamer

from qwick.bench.workloads import BenchRequest, throughput_summary


def load_transformers(model_dir: str, dtype: torch.dtype, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def transformers_on_our_weights(model, dtype: torch.dtype, device: str | torch.device):
    """transformers' model for our model's config, holding our weights (dummy ones too): the reference
    for `--load-format dummy` runs, where no checkpoint exists to load it from."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        ref = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    missing, unexpected = ref.load_state_dict(dict(model.checkpoint_tensors()), strict=False)
    missing = [m for m in missing if m != "lm_head.weight" or not model.tie_word_embeddings]
    if missing or unexpected:
        raise ValueError(
            f"weights do not line up with transformers: missing {missing}, unexpected {unexpected}"
        )
    if model.tie_word_embeddings:
        ref.tie_weights()
    return ref.eval()


class TokenClock(BaseStreamer):
    """A `generate` streamer that notes when each new token is ready: `put` is called with the prompt
    first, then once per step with that step's tokens (the device is synchronized first, so a GPU step
    is timed when it has run, not when it was queued)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []  # one per generated token
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if value.is_cuda:
            torch.cuda.synchronize(value.device)
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def _generate(
    model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, streamer: TokenClock | None = None
) -> None:
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.no_grad():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            streamer=streamer,
        )


def latency(model, request: BenchRequest, pad_id: int = 0) -> dict:
    """Batch-1 decode speed from one timed `generate`: TTFT to its first token, the decode step as the
    median gap between the next ones. (TTFT and the whole run timed apart, and the step taken from their
    difference, gave negative rates on a busy CPU.)"""
    prompt = [request.prompt_token_ids]
    _generate(model, prompt, 2, pad_id)  # warm-up
    clock = TokenClock()
    _generate(model, prompt, request.max_tokens, pad_id, streamer=clock)
    total = time.perf_counter() - clock.start
    ttft = clock.times[0] - clock.start
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    per_token = statistics.median(gaps) if gaps else float("nan")
    return {
        "ttft_ms": 1000 * ttft,
        "decode_step_ms": 1000 * per_token,
        "decode_tokens_per_s": 1 / per_token,
        "total_s": total,
    }


def batched_throughput(model, requests: list[BenchRequest], pad_id: int = 0) -> dict:
    """All requests in one left-padded `generate` (transformers' best case for concurrent requests).

    A static batch runs until its longest output is done: with outputs of different lengths (workload 3)
    every request generates the longest `max_tokens`, and only the tokens each one asked for are counted,
    as for qwick."""
    n_out = max(r.max_tokens for r in requests)
    prompts = [r.prompt_token_ids for r in requests]
    _generate(model, prompts[:1], 2, pad_id)  # warm-up
    t = time.perf_counter()
    _generate(model, prompts, n_out, pad_id)
    seconds = time.perf_counter() - t
    return {**throughput_summary(requests, seconds), "generated_tokens": n_out * len(requests)}
