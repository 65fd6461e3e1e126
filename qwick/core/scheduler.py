"""Token-budget continuous batching (vLLM v1 style). Torch-free.

Each step spends `max_num_batched_tokens`: first on RUNNING requests in order (decodes and unfinished
prefill chunks), then on WAITING ones (new and preempted), so one step mixes decode and prefill. A request is
just `num_computed_tokens` catching up with `num_tokens`; the runner samples a row when it reaches the end.

When the KV pool runs dry, the newest running request (the tail of `running`) is preempted and recomputed
later. For the priority policy `running` is kept sorted by (priority, arrival_time), so the tail is also the
least important one. Either way the victim is never a request already scheduled in this step: the scan goes
front to back and victims come off the back, so no scheduled row ever loses its blocks (its freshly cached
blocks would otherwise be visible to others without their KV ever being written).

Structured output: a waiting request whose grammar is still compiling is passed over (it keeps its place),
and every sampled token advances the request's grammar; a grammar that terminates finishes the request.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from qwick.config import CacheConfig, SchedulerConfig
from qwick.core.kv_cache_manager import KVCacheManager
from qwick.core.request import Request, RequestStatus
from qwick.core.scheduler_output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int  # total since start


def _priority_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


class _WaitingQueue:
    """FCFS: a deque, preempted requests go to the front. Priority: kept sorted by (priority, arrival)."""

    def __init__(self, policy: str) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}.")
        self.policy = policy
        self._fcfs: deque[Request] = deque()
        self._sorted: list[tuple[int, float, int, Request]] = []
        self._seq = 0  # tie-breaker, so requests are never compared

    def push(self, request: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            if front:
                self._fcfs.appendleft(request)
            else:
                self._fcfs.append(request)
        else:  # a preempted request simply goes back to its place in priority order
            self._seq += 1
            bisect.insort(self._sorted, (request.priority, request.arrival_time, self._seq, request))

    def peek(self) -> Request:
        return self._fcfs[0] if self.policy == "fcfs" else self._sorted[0][3]

    def pop(self) -> Request:
        return self._fcfs.popleft() if self.policy == "fcfs" else self._sorted.pop(0)[3]

    def remove(self, request_ids: set[str]) -> None:
        if self.policy == "fcfs":
            self._fcfs = deque(r for r in self._fcfs if r.request_id not in request_ids)
        else:
            self._sorted = [e for e in self._sorted if e[3].request_id not in request_ids]

    def __len__(self) -> int:
        return len(self._fcfs) if self.policy == "fcfs" else len(self._sorted)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._fcfs) if self.policy == "fcfs" else (e[3] for e in self._sorted)


class Scheduler:
    """Decides, each step, which tokens of which requests the model runner computes."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.config = scheduler_config
        self._max_model_len = scheduler_config.max_model_len
        self.policy = scheduler_config.policy
        self.kv_cache = KVCacheManager(
            cache_config.num_gpu_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}
        self.waiting = _WaitingQueue(self.policy)
        self.running: list[Request] = []  # admission order (fcfs) or (priority, arrival) order
        self._finished_ids: list[str] = []  # reported in the next SchedulerOutput
        self._capped: list[Request] = []  # finished inside schedule(); returned by update_from_output
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler.")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Drop requests wherever they are; unknown ids are ignored. Returns the requests dropped."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside (a stop string matched, an abort): free them, report them."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}.")
        found = [self.requests[rid] for rid in dict.fromkeys(request_ids) if rid in self.requests]
        for request in found:
            request.status = status
        self._remove_finished(found)
        return found

    def _remove_finished(self, finished: list[Request]) -> None:
        if not finished:
            return
        ids = {r.request_id for r in finished}
        self.running = [r for r in self.running if r.request_id not in ids]
        self.waiting.remove(ids)
        for request in finished:
            self.kv_cache.free(request)
            del self.requests[request.request_id]
            self._finished_ids.append(request.request_id)

    # ---- one step ------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens

        # Running requests first, in order. Snapshot: preemption removes requests from the tail.
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if request.num_output_placeholders and not self._can_run_ahead(request):
                continue  # its next step needs the token still in flight
            num_new = min(
                request.num_tokens + request.num_output_placeholders - request.num_computed_tokens, budget
            )
            if num_new <= 0:
                continue
            if not self._allocate_or_preempt(request, num_new, out):
                continue
            self._add_row(out, request, num_new)
            budget -= num_new

        # Then waiting requests, unless memory was too tight to keep everyone running this step.
        # Requests whose grammar is still compiling are passed over (and keep their place in the queue).
        skipped: list[Request] = []
        while budget > 0 and not out.preempted_request_ids and len(self.waiting) > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            grammar_pending = request.structured_output is not None and not request.structured_output.ready
            if grammar_pending or request.num_output_placeholders:  # (a preempted request's token in flight)
                skipped.append(self.waiting.pop())
                continue
            computed_blocks, num_hit = self.kv_cache.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget:
                # Without chunking a prompt waits until it fits whole, unless it never can.
                if not self.config.enable_chunked_prefill and num_new <= self.config.max_num_batched_tokens:
                    break
                num_new = budget
            if not self.kv_cache.allocate_slots(request, num_new, computed_blocks):
                if not self.running:  # the whole pool cannot hold it: it would wait forever
                    self.waiting.pop()
                    self._cannot_fit(request)
                    continue
                break
            self.waiting.pop()
            self._admit(request, num_hit)
            self._add_row(out, request, num_new)
            budget -= num_new
        for request in reversed(skipped):
            self.waiting.push(request, front=True)
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate for a running request, preempting from the tail until it fits. False: not scheduled."""
        while not self.kv_cache.allocate_slots(request, num_new):
            if len(self.running) == 1:  # alone with the whole pool and still too big: give up on it
                self._cannot_fit(request)
                return False
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request, front=True)
        out.preempted_request_ids.append(request.request_id)

    def _cannot_fit(self, request: Request) -> None:
        """The KV pool is smaller than this request: stop it with what it has (finish reason "length").

        The engine should reject such requests up front (prompt + max_tokens > usable blocks * block_size);
        this only keeps the scheduler from preempting and recomputing it forever.
        """
        request.status = RequestStatus.FINISHED_LENGTH
        self._remove_finished([request])
        self._capped.append(request)

    def _admit(self, request: Request, num_hit: int) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = num_hit
        if self.policy == "priority":
            bisect.insort(self.running, request, key=_priority_key)
        else:
            self.running.append(request)

    def _add_row(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        block_table = self.kv_cache.get_block_table(request.request_id)
        start = request.num_computed_tokens
        known = request.num_tokens
        row = ScheduledRequest(
            request,
            start,
            num_new,
            block_table,
            sample=start + num_new == known + request.num_output_placeholders,
            placeholder_input=start + num_new > known,
        )
        out.scheduled.append(row)
        out.num_batched_tokens += num_new
        if self.config.async_scheduling:
            # The positions count as computed from now on, and a sampled token is on its way.
            request.num_computed_tokens += num_new
            if row.sample:
                request.num_output_placeholders += 1

    def _can_run_ahead(self, request: Request) -> bool:
        """Whether a request may be scheduled again before its in-flight token reaches the host: not when
        that token's value decides what the next step computes (a grammar's mask, penalties' counts), nor
        when it may be the last one. Seeds and min_tokens depend only on how many tokens came before
        (`Request.sample_index`), which is known."""
        params = request.sampling_params
        if request.num_output_placeholders > 1:  # one step ahead at most: the runner patches from the last
            return False
        if request.structured_output is not None:
            return False
        if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
            return False
        num_out = request.num_output_tokens + request.num_output_placeholders
        return num_out < request.max_tokens and request.num_tokens + request.num_output_placeholders < (
            self._max_model_len
        )

    # ---- results -------------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]
    ) -> list[Request]:
        """Advance every scheduled row, append sampled tokens, finish requests that hit a stop.

        Returns the requests that got new tokens this step, finished or not, plus any request the
        preceding `schedule()` had to finish because the whole KV pool cannot hold it.
        """
        updated, self._capped = self._capped, []
        finished: list[Request] = []
        for row in scheduler_output.scheduled:
            request = row.request
            if self.requests.get(request.request_id) is not request or request.is_finished:
                continue  # finished or aborted since the step was scheduled
            sample = row.sample
            if self.config.async_scheduling:
                if sample:
                    request.num_output_placeholders -= 1
            else:
                request.num_computed_tokens += row.num_tokens
            if not sample:
                continue
            new_tokens = sampled_token_ids.get(request.request_id, ())
            for token_id in new_tokens:
                request.append_output_token(token_id)
                if self._check_stop(request, token_id):
                    finished.append(request)
                    break
            if new_tokens:
                updated.append(request)
        self._remove_finished(finished)
        return updated

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        grammar = request.structured_output
        if grammar is not None and not grammar.accept(token_id):
            # Only when the grammar's every allowed token was masked to -inf (say, min_tokens holding back
            # the stop token of a complete grammar): nothing valid can follow, so stop here.
            logger.warning("request %s: token %d breaks its grammar; stopping", request.request_id, token_id)
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        stop_token = request.num_output_tokens > params.min_tokens and token_id in params.all_stop_token_ids
        if stop_token or (grammar is not None and grammar.is_terminated):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
        elif request.num_output_tokens >= request.max_tokens or request.num_tokens >= self._max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
        else:
            return False
        return True

    # ---- introspection -------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv_cache.usage,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )
