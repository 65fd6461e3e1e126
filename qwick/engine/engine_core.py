"""The engine core: scheduler + model runner, stepped in a loop. Knows token ids, never text.

The offline `LLM` drives it in-process; the server runs it in its own process behind a message queue.
Its outputs are plain data (ids, numbers, strings) so they cross a process boundary as they are.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from transformers import PretrainedConfig

from qwick.config import CacheConfig, EngineConfig, SchedulerConfig, default_max_num_batched_tokens
from qwick.core.request import Request, RequestStatus
from qwick.core.scheduler import Scheduler
from qwick.core.scheduler_output import SchedulerOutput
from qwick.runner.model_runner import LaunchedStep, ModelRunner, RunnerOutput, TokenLogprobs
from qwick.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    # A plain dataclass: msgspec carries it to the API process as it is, and the engine stays importable
    # without the server's dependencies (the GPU machine has no msgspec).
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None  # "stop", "length", "abort"; None while running
    stop_reason: int | str | None
    num_cached_tokens: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


# How long an idle step waits for a grammar to finish compiling before returning (so the loop still
# notices new input and aborts at this pace, without spinning).
GRAMMAR_WAIT_S = 0.05


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        hf_config: PretrainedConfig,
        model_path: str | None,
        max_model_len: int,
        tokenizer=None,
    ):
        """`tokenizer`: the front end's, when it lives in this process; otherwise structured output loads
        one from `config.tokenizer or model_path` when the first constrained request arrives."""
        self.config = config
        self.max_model_len = max_model_len
        self.runner = ModelRunner(config, hf_config, model_path, max_model_len)
        self.async_scheduling = self.runner.async_scheduling  # the runner resolves the default per device
        cache_config = CacheConfig(
            block_size=config.block_size,
            num_gpu_blocks=self.runner.num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            gpu_memory_utilization=config.gpu_memory_utilization,
            num_gpu_blocks_override=config.num_gpu_blocks_override,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=default_max_num_batched_tokens(config, max_model_len),
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            async_scheduling=self.async_scheduling,
        )
        budget = scheduler_config.max_num_batched_tokens
        if not config.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({budget}) "
                f"must be at least max_model_len ({max_model_len})"
            )
        self.scheduler = Scheduler(scheduler_config, cache_config)
        self.num_kv_tokens = (self.runner.num_blocks - 1) * config.block_size
        if self.num_kv_tokens < max_model_len:
            raise ValueError(
                f"the KV cache holds {self.num_kv_tokens} tokens, fewer than max_model_len={max_model_len}: "
                "one long request could never run; lower max_model_len or give the KV cache more blocks"
            )
        self._finished_now: list[Request] = []
        # Async scheduling: the step launched by the previous `step()` call, not yet read back.
        self._in_flight: tuple[SchedulerOutput, LaunchedStep | None] | None = None
        self.structured_output = StructuredOutputManager(
            hf_config.vocab_size, tokenizer=tokenizer, tokenizer_path=config.tokenizer or model_path
        )

    def add_request(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is not None:
            self.structured_output.add_request(request)  # compiles off this thread; the request waits
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._finished_now.extend(self.scheduler.abort_requests(request_ids))

    def finish_requests(self, request_ids: list[str]) -> None:
        """End requests the detokenizer stopped (a stop string matched)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, and report what each request got.

        With async scheduling, a call schedules and launches step n, then reads back step n-1 (launched by
        the previous call) and reports its tokens: the host's work for step n overlaps the device's work
        on step n-1, and each token reaches its request one call later."""
        structured = self.structured_output
        if structured.has_pending:
            failed = structured.poll()
            if failed:
                ids = [r.request_id for r in failed]
                self._finished_now.extend(self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED))
        outputs = [self._output(r, [], None) for r in self._finished_now]
        self._finished_now = []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and structured.has_pending and self._in_flight is None:
            structured.wait(GRAMMAR_WAIT_S)  # nothing runnable until a grammar compiles: wait, don't spin
        if self.async_scheduling:
            launched = self.runner.launch(scheduler_output)
            previous, self._in_flight = self._in_flight, (scheduler_output, launched)
            if scheduler_output.is_empty:
                self._in_flight = None
            if previous is None:
                return outputs
            scheduler_output, launched = previous
            runner_output = self.runner.collect(launched)
        else:
            runner_output = self.runner.execute(scheduler_output)  # nothing to run: an empty output
        return outputs + self._process(scheduler_output, runner_output)

    def _process(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        sampled = {rid: [tok] for rid, tok in runner_output.sampled_token_ids.items()}
        updated = self.scheduler.update_from_output(scheduler_output, sampled)
        now = time.monotonic()
        for request in updated:
            new = sampled.get(request.request_id, [])
            if new and request.first_token_time is None:
                request.first_token_time = now
            lp = runner_output.logprobs.get(request.request_id)
            outputs.append(self._output(request, new, [lp] if lp is not None else None))
        return outputs

    @staticmethod
    def _output(
        request: Request, new_tokens: list[int], logprobs: list[TokenLogprobs] | None
    ) -> EngineCoreOutput:
        if request.is_finished and request.finished_time is None:
            request.finished_time = time.monotonic()
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_tokens,
            new_logprobs=logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finished_time=request.finished_time,
        )
