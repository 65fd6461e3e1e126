"""Turning engine-core token outputs into `RequestOutput`s: detokenize, apply stop strings, assemble.

Shared by the in-process engine and the server's API process. It owns the per-request state on the
output side; the engine core only ever sees token ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from qwick.engine.detokenizer import IncrementalDetokenizer
from qwick.engine.engine_core import EngineCoreOutput
from qwick.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from qwick.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class SampleState:
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

    @classmethod
    def new(cls, index: int, tokenizer, prompt_ids: list[int], params: SamplingParams) -> SampleState:
        detok = IncrementalDetokenizer(
            tokenizer,
            prompt_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
            defer=params.output_kind == RequestOutputKind.FINAL_ONLY,  # text read once, at the end
        )
        return cls(index, detok, logprobs=[] if params.logprobs is not None else None)

    def take_delta(self) -> str:
        delta = self.pending_delta + self.detokenizer.get_delta()
        self.pending_delta = ""
        self.released_text += delta
        return delta


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[str, SampleState]  # core request id -> sample
    metrics: RequestMetrics
    num_cached_tokens: int = 0

    @classmethod
    def new(cls, request_id, prompt, prompt_ids, params, arrival_time) -> RequestState:
        return cls(request_id, prompt, prompt_ids, params, {}, RequestMetrics(arrival_time))

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self._core_to_user: dict[str, str] = {}

    def add(self, state: RequestState) -> None:
        if state.request_id in self.states:
            raise ValueError(f"request id {state.request_id!r} is already in use")
        self.states[state.request_id] = state
        for core_id in state.samples:
            self._core_to_user[core_id] = state.request_id

    def core_ids(self, request_id: str) -> list[str]:
        state = self.states.get(request_id)
        return list(state.samples) if state is not None else []

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Fold a step's core outputs in. Returns the user-facing outputs of the requests that progressed,
        and the core ids that a stop string ended (the engine core must finish them)."""
        touched: dict[str, None] = {}
        stopped: list[str] = []
        for out in core_outputs:
            user_id = self._core_to_user.get(out.request_id)
            if user_id is None:
                continue  # finished on our side already (stop string), or unknown
            state = self.states[user_id]
            if self._apply(state, state.samples[out.request_id], out):
                stopped.append(out.request_id)
            touched[user_id] = None
        results = []
        for user_id in touched:
            state = self.states[user_id]
            finished = state.finished
            if finished:
                state.metrics.finished_time = time.monotonic()
                for core_id in state.samples:
                    self._core_to_user.pop(core_id, None)
                del self.states[user_id]
            if state.params.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            results.append(self._make_output(state, finished))
        return results, stopped

    def _apply(self, state: RequestState, sample: SampleState, out: EngineCoreOutput) -> bool:
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

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput:
        delta = state.params.output_kind == RequestOutputKind.DELTA
        completions = []
        samples = state.samples.values()
        for sample in sorted(samples, key=lambda s: s.index) if len(samples) > 1 else samples:
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
