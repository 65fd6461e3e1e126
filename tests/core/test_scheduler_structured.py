"""The scheduler's side of structured output, with a stand-in grammar (no xgrammar, no torch): requests
wait while their grammar compiles without holding up others, every sampled token advances the grammar,
and a terminated (or violated) grammar finishes the request."""

from __future__ import annotations

import pytest

from qwick.config import CacheConfig, SchedulerConfig
from qwick.core.request import Request, RequestStatus
from qwick.core.scheduler import Scheduler
from qwick.sampling_params import SamplingParams

BS = 4
STOP = 99


class FakeGrammar:
    """Accepts `allowed` tokens; terminates on STOP once `complete_after` tokens were accepted."""

    def __init__(self, ready: bool = True, allowed: set[int] | None = None, complete_after: int = 0) -> None:
        self.ready = ready
        self.allowed = allowed
        self.complete_after = complete_after
        self.accepted: list[int] = []
        self.is_terminated = False

    def accept(self, token_id: int) -> bool:
        if token_id == STOP and len(self.accepted) >= self.complete_after:
            self.is_terminated = True
        elif self.allowed is not None and token_id not in self.allowed:
            return False
        self.accepted.append(token_id)
        return True


def make_sched(policy: str = "fcfs", num_blocks: int = 64, max_batched: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched, max_model_len=256, policy=policy),
        CacheConfig(block_size=BS, num_gpu_blocks=num_blocks, enable_prefix_caching=False),
    )


def make_req(rid: str, prompt: int = 5, grammar: FakeGrammar | None = None, **params) -> Request:
    sp = SamplingParams(max_tokens=params.pop("max_tokens", 16), **params)
    sp.update_from_generation_config({STOP})
    request = Request(rid, list(range(10, 10 + prompt)), sp)
    request.structured_output = grammar
    return request


def step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sampled = {row.request_id: [token] for row in out.scheduled if row.sample}
    return out, sched.update_from_output(out, sampled)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_compiling_request_waits_without_blocking_others_and_keeps_its_place(policy):
    sched = make_sched(policy)
    grammar = FakeGrammar(ready=False)
    sched.add_request(make_req("g", grammar=grammar))
    sched.add_request(make_req("plain"))
    out, _ = step(sched)
    assert [r.request_id for r in out.scheduled] == ["plain"]
    assert [r.request_id for r in sched.waiting] == ["g"]
    assert sched.requests["g"].status == RequestStatus.WAITING
    grammar.ready = True
    out, _ = step(sched)
    assert [r.request_id for r in out.scheduled] == ["plain", "g"]


def test_skipped_requests_keep_their_order():
    sched = make_sched()
    grammars = {rid: FakeGrammar(ready=False) for rid in ("a", "b")}
    for rid in ("a", "b"):
        sched.add_request(make_req(rid, grammar=grammars[rid]))
    sched.add_request(make_req("c"))
    step(sched)
    assert [r.request_id for r in sched.waiting] == ["a", "b"]


def test_each_sampled_token_advances_the_grammar_and_termination_stops():
    sched = make_sched()
    grammar = FakeGrammar(complete_after=2)
    # STOP would also end the request as a stop token; ignore_eos keeps it out of the stop set, so only
    # the grammar's termination can end the request here.
    request = make_req("g", grammar=grammar, ignore_eos=True)
    request.sampling_params.all_stop_token_ids = set()
    sched.add_request(request)
    for token in (7, 8):
        step(sched, token)
    assert grammar.accepted == [7, 8] and not request.is_finished
    _, updated = step(sched, STOP)
    assert grammar.is_terminated and request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == STOP and updated == [request] and not sched.requests


def test_token_the_grammar_rejects_stops_the_request():
    sched = make_sched()
    request = make_req("g", grammar=FakeGrammar(allowed={7}))
    sched.add_request(request)
    step(sched, 7)
    step(sched, 8)
    assert request.status == RequestStatus.FINISHED_STOPPED and request.output_token_ids == [7, 8]


def test_prefill_chunks_do_not_touch_the_grammar():
    sched = make_sched(max_batched=4)
    grammar = FakeGrammar()
    sched.add_request(make_req("g", prompt=10, grammar=grammar))
    for _ in range(2):  # 4 + 4 of 10 prompt tokens: nothing sampled yet
        step(sched)
    assert grammar.accepted == []
    step(sched)
    assert grammar.accepted == [7]


def test_preempted_request_keeps_its_grammar_state():
    # 6 usable blocks of 4 tokens; two requests of 8 prompt tokens grow until one must be preempted.
    sched = make_sched(num_blocks=6)
    grammars = {rid: FakeGrammar() for rid in ("a", "b")}
    for rid in ("a", "b"):
        sched.add_request(make_req(rid, prompt=8, grammar=grammars[rid], max_tokens=12))
    while sched.num_preemptions == 0:
        step(sched)
    victim = next(r for r in sched.waiting)
    kept = list(grammars[victim.request_id].accepted)
    assert kept == victim.output_token_ids  # the matcher is where the output is, not rebuilt
    while sched.has_unfinished_requests():
        step(sched)
    for grammar in grammars.values():
        assert len(grammar.accepted) == 12
