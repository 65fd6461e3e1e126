"""A request as the scheduler and the KV cache manager see it. Torch-free.

The one number that drives scheduling is `num_computed_tokens`: how many of the request's tokens
(prompt + generated) already have their keys and values in the KV cache. Each step the scheduler lets it
catch up with `num_tokens`; prefill, chunked prefill, decode and recompute after preemption are all
the same operation seen at different gaps.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from qwick.sampling_params import SamplingParams

if TYPE_CHECKING:
    from qwick.structured_output.manager import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # a stop token or stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence being generated. `n > 1` requests are fanned out into one Request per sample."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        # Requests with the same salt share prefix-cache entries even when prefix caching is off:
        # the samples of one `n > 1` request use it to share their prompt's blocks.
        self.cache_salt = cache_salt
        # The engine resolves `max_tokens=None` against max_model_len before the request gets here.
        self.max_tokens = max_tokens if max_tokens is not None else (sampling_params.max_tokens or 1)

        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling: tokens sampled by steps already launched whose ids the host has not seen yet.
        # Their positions are scheduled (and counted in num_computed_tokens); `all_token_ids` lacks them.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Set by the engine core for a request with `structured_outputs`: its grammar state. The scheduler
        # skips it while `.ready` is False (still compiling) and advances it with each sampled token.
        self.structured_output: RequestGrammar | None = None
        # The model runner's per-request sampling constants (opaque here), computed once, not every step.
        self.sampling_cache: object = None

        # Timing, for metrics and the per-request breakdown.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def sample_index(self) -> int:
        """Index in the output of the token the step being prepared samples for this request (its seed and
        min_tokens depend on it): the placeholders include that step's own token."""
        return self.num_output_tokens + max(self.num_output_placeholders - 1, 0)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
