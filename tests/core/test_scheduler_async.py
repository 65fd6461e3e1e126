"""Async scheduling in the scheduler: step n+1 is scheduled before step n's tokens are known."""

from __future__ import annotations

from qwick.config import CacheConfig, SchedulerConfig
from qwick.core.request import Request, RequestStatus
from qwick.core.scheduler import Scheduler
from qwick.sampling_params import SamplingParams

BS = 4


def make_sched(num_blocks: int = 64, max_batched: int = 32) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched, async_scheduling=True),
        CacheConfig(block_size=BS, num_gpu_blocks=num_blocks),
    )


def make_req(rid: str, prompt: int, max_tokens: int = 16, **params) -> Request:
    return Request(rid, list(range(100, 100 + prompt)), SamplingParams(max_tokens=max_tokens, **params))


def test_runs_one_step_ahead_with_a_placeholder_input():
    s = make_sched()
    s.add_request(make_req("a", 6))
    first = s.schedule()  # the prompt
    (row,) = first.scheduled
    assert (row.start_pos, row.num_tokens, row.sample, row.placeholder_input) == (0, 6, True, False)
    second = s.schedule()  # before the first token is known: decode its position from a placeholder
    (row2,) = second.scheduled
    assert (row2.start_pos, row2.num_tokens, row2.sample, row2.placeholder_input) == (6, 1, True, True)
    assert row2.token_ids == []  # the runner takes that token from the device
    req = s.requests["a"]
    assert req.num_computed_tokens == 7 and req.num_output_placeholders == 2
    assert s.schedule().is_empty  # two in flight is the limit: the next needs the first token back
    s.update_from_output(first, {"a": [50]})
    assert req.output_token_ids == [50] and req.num_output_placeholders == 1
    third = s.schedule()
    assert [(r.start_pos, r.placeholder_input) for r in third.scheduled] == [(7, True)]
    s.update_from_output(second, {"a": [51]})
    assert req.all_token_ids[-2:] == [50, 51] and req.num_computed_tokens == 8


def test_requests_that_need_their_last_token_wait_for_it():
    s = make_sched()
    s.add_request(make_req("plain", 3))
    s.add_request(make_req("penalty", 3, repetition_penalty=1.3))
    s.add_request(make_req("seeded", 3, seed=1))
    s.add_request(make_req("min", 3, min_tokens=4))
    first = s.schedule()
    assert len(first.scheduled) == 4
    # penalties need the token's value on the host; seeds and min_tokens only the count of tokens before
    assert [r.request_id for r in s.schedule().scheduled] == ["plain", "seeded", "min"]


def test_does_not_schedule_past_max_tokens_and_drops_rows_of_finished_requests():
    s = make_sched()
    s.add_request(make_req("a", 3, max_tokens=2))
    s.add_request(make_req("b", 3, stop_token_ids=[9]))
    first = s.schedule()
    second = s.schedule()  # a: its 2nd (last) token; b: its 2nd
    assert {r.request_id for r in second.scheduled} == {"a", "b"}
    assert s.schedule().is_empty  # both have two tokens in flight
    s.update_from_output(first, {"a": [5], "b": [9]})  # b stops on its first token
    assert "b" not in s.requests
    assert s.schedule().is_empty  # a's last token (its 2nd) is in flight: nothing more to schedule
    updated = s.update_from_output(second, {"a": [6], "b": [7]})  # b's extra token is dropped
    assert [r.request_id for r in updated] == ["a"]
    assert "a" not in s.requests  # finished: length
    assert not s.has_unfinished_requests()


def test_preempted_request_waits_for_its_token_then_recomputes():
    s = make_sched(num_blocks=3, max_batched=64)  # 2 usable blocks of 4 tokens (block 0 is the null block)
    s.add_request(make_req("a", 4))
    s.add_request(make_req("b", 3))
    first = s.schedule()
    assert len(first.scheduled) == 2
    second = s.schedule()  # a needs a 3rd block for position 4: b (the tail) is preempted
    assert second.preempted_request_ids == ["b"]
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    s.update_from_output(first, {"a": [1], "b": [2]})
    assert b.output_token_ids == [2] and b.num_output_placeholders == 0 and b.num_computed_tokens == 0
    s.update_from_output(second, {"a": [3]})
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    third = s.schedule()  # b comes back and recomputes its prompt and its token
    (row,) = third.scheduled
    assert (row.request_id, row.start_pos, row.num_tokens, row.placeholder_input) == ("b", 0, 4, False)
