"""What the scheduler hands the model runner each step. Torch-free.

One step is a flat batch of rows; each row is a contiguous run of one request's tokens whose KV is not yet
computed: a single token for a decode, a chunk of a prompt for (chunked) prefill. The runner does not care
which is which.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qwick.core.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    start_pos: int  # request.num_computed_tokens before this step
    num_tokens: int  # tokens to compute this step: all_token_ids[start_pos : start_pos + num_tokens]
    block_table: list[int]  # the request's blocks; covers start_pos + num_tokens positions
    # True when this row reaches the request's last token, so the step yields its next token.
    sample: bool = False
    # Async scheduling: the row's last input token was sampled by the previous step and is not on the host
    # yet (`token_ids` then lacks it); the runner takes it from that step's device output.
    placeholder_input: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start_pos : self.start_pos + self.num_tokens]

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # row order of the batch
    num_batched_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that left the engine (finished or aborted) since the previous step:
    # the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
