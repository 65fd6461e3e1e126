"""Turning a user's request into engine-core requests: tokenize, validate, fan out `n > 1`.

Shared by the in-process engine (`LLM`) and the server's API process, so both reject the same inputs
with the same messages.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import GenerationConfig

from qwick.core.request import Request
from qwick.engine.output_processor import OutputProcessor, RequestState, SampleState
from qwick.sampling_params import SamplingParams


def eos_token_ids(model_path: str, tokenizer) -> set[int]:
    """End-of-sequence ids: the generation config's (often several for chat models) and the tokenizer's."""
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        if eos is not None:
            ids |= set(eos) if isinstance(eos, list) else {eos}
    except OSError:
        pass  # no generation_config.json
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@dataclass
class ProcessorLimits:
    vocab_size: int
    max_model_len: int
    enable_prefix_caching: bool


class InputProcessor:
    def __init__(self, tokenizer, eos_ids: set[int], limits: ProcessorLimits) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.limits = limits

    def tokenize_prompt(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.limits.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return None, ids

    def validate(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Check the request fits; return the max_tokens it gets (None: all the room left)."""
        max_len = self.limits.max_model_len
        if num_prompt_tokens >= max_len:
            raise ValueError(
                f"prompt is {num_prompt_tokens} tokens, which leaves no room to generate within "
                f"max_model_len={max_len}"
            )
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported yet")
        if params.logit_bias and max(params.logit_bias) >= self.limits.vocab_size:
            raise ValueError(
                f"logit_bias has token ids outside the vocabulary (size {self.limits.vocab_size})"
            )
        if params.stop_token_ids and max(params.stop_token_ids) >= self.limits.vocab_size:
            raise ValueError(f"stop_token_ids outside the vocabulary (size {self.limits.vocab_size})")
        if params.structured_outputs is not None:
            from qwick.structured_output.grammar import validate_structured_outputs

            try:
                validate_structured_outputs(params.structured_outputs)
            except ValueError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        room = max_len - num_prompt_tokens
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def process(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> tuple[RequestState, list[Request]]:
        """Build the output-side state and one core request per sample."""
        text, prompt_ids = self.tokenize_prompt(prompt)
        max_tokens = self.validate(len(prompt_ids), params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = RequestState.new(request_id, text, prompt_ids, params, arrival)
        # Samples of one request share their prompt's KV blocks through the prefix cache; with caching
        # off, a salt private to this request lets them share without exposing blocks to others.
        salt = request_id if params.n > 1 and not self.limits.enable_prefix_caching else None
        requests = []
        for i in range(params.n):
            sample_params = params.clone()
            if params.seed is not None and i > 0:
                sample_params.seed = params.seed + i
            sample_params.update_from_generation_config(self.eos_ids)
            core_id = request_id if params.n == 1 else f"{request_id}#{i}"
            state.samples[core_id] = SampleState.new(i, self.tokenizer, prompt_ids, params)
            requests.append(
                Request(
                    core_id,
                    prompt_ids,
                    sample_params,
                    arrival_time=arrival,
                    priority=priority,
                    cache_salt=salt,
                    max_tokens=max_tokens,
                )
            )
        return state, requests


@dataclass
class Frontend:
    """Everything on the text side of the engine: where the model lives, its config and tokenizer, and
    the processors around the engine core. Built the same way for `LLM` and for the server."""

    model_name: str
    model_path: str
    model_source: str
    hf_config: object
    tokenizer: object
    max_model_len: int
    input_processor: InputProcessor
    output_processor: OutputProcessor


def build_frontend(config) -> Frontend:
    from transformers import AutoTokenizer

    from qwick.loader.model_loader import derive_max_model_len, load_config, resolve_model

    resolved = resolve_model(config.model, config.revision)
    hf_config = load_config(resolved.path)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or resolved.path)
    max_model_len = derive_max_model_len(hf_config, config.max_model_len)
    limits = ProcessorLimits(hf_config.vocab_size, max_model_len, config.enable_prefix_caching)
    return Frontend(
        model_name=resolved.name,
        model_path=resolved.path,
        model_source=resolved.source,
        hf_config=hf_config,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        input_processor=InputProcessor(tokenizer, eos_token_ids(resolved.path, tokenizer), limits),
        output_processor=OutputProcessor(tokenizer),
    )
