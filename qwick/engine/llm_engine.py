"""The in-process engine behind `LLM`: text in, `RequestOutput`s out.

It adds what the engine core leaves out: tokenization, validation, fan-out of `n > 1` requests into one
core request per sample, incremental detokenization with stop strings, and assembling outputs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import AutoTokenizer, GenerationConfig

from qwick.config import EngineConfig
from qwick.core.request import Request
from qwick.engine.detokenizer import IncrementalDetokenizer
from qwick.engine.engine_core import EngineCore, EngineCoreOutput
from qwick.loader.model_loader import derive_max_model_len, load_config, resolve_model
from qwick.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from qwick.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


def eos_token_ids(model_path: str, tokenizer) -> set[int]:
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
class _SampleState:
    """One sample (one core request) of a user request."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # for DELTA outputs
    released_text: str = ""  # text handed out so far (safe: no partial character, no part of a stop)
    pending_delta: str = ""  # released by the detokenizer's final flush, not yet handed out

    def take_delta(self) -> str:
        delta = self.pending_delta + self.detokenizer.get_delta()
        self.pending_delta = ""
        self.released_text += delta
        return delta


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[str, _SampleState]  # core request id -> sample
    metrics: RequestMetrics
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        resolved = resolve_model(config.model, config.revision)
        self.model_name = resolved.name
        self.model_path = resolved.path
        hf_config = load_config(resolved.path)
        self.hf_config = hf_config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or resolved.path)
        self.max_model_len = derive_max_model_len(hf_config, config.max_model_len)
        self.eos_token_ids = eos_token_ids(resolved.path, self.tokenizer)
        self.config = config
        self.core = EngineCore(config, hf_config, resolved.path, self.max_model_len)
        self.vocab_size = hf_config.vocab_size
        self._states: dict[str, _RequestState] = {}
        self._core_to_user: dict[str, str] = {}
        self._ids = itertools.count()
        self.load_time = time.perf_counter() - start
        runner = self.core.runner
        logger.info(
            "qwick ready: %s (%s) on %s, %s, max_model_len=%d, KV cache %d tokens, loaded in %.1fs",
            self.model_name,
            resolved.source,
            runner.device,
            str(runner.dtype).removeprefix("torch."),
            self.max_model_len,
            self.core.num_kv_tokens,
            self.load_time,
        )

    # ---- requests in ---------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return None, ids

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        text, prompt_ids = self.tokenize_prompt(prompt)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported yet")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias has token ids outside the vocabulary (size {self.vocab_size})")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        room = self.max_model_len - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = time.monotonic()
        state = _RequestState(request_id, text, prompt_ids, params, {}, RequestMetrics(arrival))
        salt = request_id if params.n > 1 and not self.config.enable_prefix_caching else None
        for i in range(params.n):
            sample_params = params.clone()
            if params.seed is not None and i > 0:
                sample_params.seed = params.seed + i
            sample_params.update_from_generation_config(self.eos_token_ids)
            core_id = request_id if params.n == 1 else f"{request_id}#{i}"
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
            sample = _SampleState(i, detok, logprobs=[] if params.logprobs is not None else None)
            state.samples[core_id] = sample
            self._core_to_user[core_id] = request_id
            self.core.add_request(
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
        self._states[request_id] = state
        return request_id

    def abort_request(self, request_id: str) -> None:
        state = self._states.get(request_id)
        if state is not None:
            self.core.abort_requests(list(state.samples))

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    # ---- outputs -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that progressed."""
        touched: dict[str, None] = {}
        stopped: list[str] = []
        for out in self.core.step():
            user_id = self._core_to_user.get(out.request_id)
            if user_id is None:
                continue
            state = self._states[user_id]
            if self._apply(state, state.samples[out.request_id], out):
                stopped.append(out.request_id)
            touched[user_id] = None
        if stopped:
            self.core.finish_requests(stopped)
        results = []
        for user_id in touched:
            state = self._states[user_id]
            finished = state.finished
            if finished:
                state.metrics.finished_time = time.monotonic()
                for core_id in state.samples:
                    self._core_to_user.pop(core_id, None)
                del self._states[user_id]
            if state.params.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            results.append(self._make_output(state, finished))
        return results

    def _apply(self, state: _RequestState, sample: _SampleState, out: EngineCoreOutput) -> bool:
        """Fold one core output into its sample. Returns True when a stop string ended it here."""
        if sample.finish_reason is not None:
            return False
        metrics = state.metrics
        metrics.first_scheduled_time = metrics.first_scheduled_time or out.first_scheduled_time
        metrics.first_token_time = metrics.first_token_time or out.first_token_time
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        new_ids = out.new_token_ids
        sample.token_ids.extend(new_ids)
        if out.new_logprobs:
            for token, lp in zip(new_ids, out.new_logprobs):
                sample.cumulative_logprob += lp.logprob
                if sample.logprobs is not None:
                    entry = {token: Logprob(lp.logprob, lp.rank, self._piece(token))}
                    for rank, (tid, value) in enumerate(lp.top, start=1):
                        entry.setdefault(tid, Logprob(value, rank, self._piece(tid)))
                    sample.logprobs.append(entry)
        stop_token = out.finish_reason == "stop" and isinstance(out.stop_reason, int)
        stop = sample.detokenizer.update(new_ids, stop_terminated=stop_token)
        if stop is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop
            return out.finish_reason is None
        if out.finish_reason is not None:
            sample.pending_delta += sample.detokenizer.flush()
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        delta = state.params.output_kind == RequestOutputKind.DELTA
        completions = []
        for sample in sorted(state.samples.values(), key=lambda s: s.index):
            new_text = sample.take_delta()
            if delta:
                text = new_text
                token_ids = sample.token_ids[sample.sent_tokens :]
                logprobs = sample.logprobs[sample.sent_tokens :] if sample.logprobs is not None else None
                sample.sent_tokens = len(sample.token_ids)
            else:
                text = sample.detokenizer.output_text if sample.finish_reason else sample.released_text
                token_ids = list(sample.token_ids)
                logprobs = list(sample.logprobs) if sample.logprobs is not None else None
            completions.append(
                CompletionOutput(
                    index=sample.index,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=sample.cumulative_logprob if sample.logprobs is not None else None,
                    logprobs=logprobs,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                )
            )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
        )
