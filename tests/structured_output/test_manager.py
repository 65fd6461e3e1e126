"""The compile cache and per-request grammar state, on the tiny test tokenizer (312 tokens) under a model
vocabulary of 320: ids 312..319 exist only in the model and must never be allowed."""

from __future__ import annotations

import pytest
import torch

from qwick.core.request import Request, RequestStatus
from qwick.sampling_params import SamplingParams
from qwick.sampling_params import StructuredOutputsParams as S
from qwick.structured_output import manager as manager_module
from qwick.structured_output.manager import StructuredOutputManager
from tests.utils import EOS_ID, VOCAB, tiny_tokenizer

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def make_request(rid: str, constraint: S) -> Request:
    params = SamplingParams(max_tokens=32, structured_outputs=constraint)
    params.update_from_generation_config({EOS_ID})
    return Request(rid, [5, 6, 7], params)


def ready(manager: StructuredOutputManager, request: Request) -> None:
    while manager.has_pending:
        manager.wait(timeout=30)
        assert manager.poll() == []
    assert request.structured_output.ready


def allowed(request: Request) -> set[int]:
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    request.structured_output.fill_bitmask(bitmask, 0)
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32)) & 1
    return set(torch.nonzero(bits.flatten()[:VOCAB]).flatten().tolist())


def test_grammar_compiles_off_thread_and_masks_what_the_schema_forbids(tokenizer):
    manager = StructuredOutputManager(VOCAB, tokenizer=tokenizer)
    request = make_request("r", S(json=SCHEMA))
    manager.add_request(request)
    ready(manager, request)
    first = allowed(request)
    assert first and all(tokenizer.decode([t]).startswith("{") for t in first)
    text = '{"a": 12}'
    for token in tokenizer.encode(text):
        assert request.structured_output.accept(token)
    done = allowed(request)  # the object is complete: only the stop token may follow
    assert done == {EOS_ID}
    assert not request.structured_output.is_terminated
    assert request.structured_output.accept(EOS_ID) and request.structured_output.is_terminated


def test_padding_ids_of_the_model_vocab_are_never_allowed(tokenizer):
    manager = StructuredOutputManager(VOCAB, tokenizer=tokenizer)
    request = make_request("r", S(regex=r"[^a]*"))  # almost anything
    manager.add_request(request)
    ready(manager, request)
    ids = allowed(request)
    assert len(ids) > 200 and not ids & set(range(len(tokenizer), VOCAB))


def test_one_compile_per_spec_one_matcher_per_request(tokenizer, monkeypatch):
    compiled = []
    real = manager_module.compile_spec
    monkeypatch.setattr(
        manager_module, "compile_spec", lambda c, spec: compiled.append(spec) or real(c, spec)
    )
    manager = StructuredOutputManager(VOCAB, tokenizer=tokenizer)
    a, b = make_request("a#0", S(choice=["yes", "no"])), make_request("a#1", S(choice=["yes", "no"]))
    for r in (a, b):
        manager.add_request(r)
        ready(manager, r)
    assert len(compiled) == 1
    assert a.structured_output.matcher is not b.structured_output.matcher
    assert a.structured_output.accept(tokenizer.encode("y")[0])
    assert allowed(b) != allowed(a)  # b's matcher did not move


def test_failed_compilation_is_reported_once(tokenizer, monkeypatch):
    def boom(compiler, spec):
        raise RuntimeError("no grammar today")

    monkeypatch.setattr(manager_module, "compile_spec", boom)
    manager = StructuredOutputManager(VOCAB, tokenizer=tokenizer)
    request = make_request("r", S(regex="x+"))
    manager.add_request(request)
    manager.wait(timeout=30)
    assert manager.poll() == [request]
    assert "no grammar today" in request.structured_output.error and not request.structured_output.ready
    assert not manager.has_pending and manager.poll() == []


def test_tokenizer_loaded_from_path_on_the_worker(tiny_qwen2_dir):
    manager = StructuredOutputManager(VOCAB, tokenizer_path=tiny_qwen2_dir)
    request = make_request("r", S(json_object=True))
    manager.add_request(request)
    ready(manager, request)
    assert manager._compiler is not None


def test_request_aborted_while_compiling_is_forgotten(tokenizer):
    manager = StructuredOutputManager(VOCAB, tokenizer=tokenizer)
    request = make_request("r", S(regex="[0-9]+ aborted"))
    manager.add_request(request)
    request.status = RequestStatus.FINISHED_ABORTED  # what the scheduler does on abort
    manager.wait(timeout=30)
    assert manager.poll() == [] and not manager.has_pending


def test_cache_keeps_a_byte_budget_dropping_the_least_recently_used(tokenizer, monkeypatch):
    monkeypatch.setattr(manager_module, "MAX_CACHE_BYTES", 1)  # every compiled grammar is over it
    manager = StructuredOutputManager(VOCAB, tokenizer=tokenizer)
    for i in range(3):
        request = make_request(f"r{i}", S(regex=f"x{{{i + 1}}}"))
        manager.add_request(request)
        ready(manager, request)
        assert request.structured_output.accept(tokenizer.encode("x")[0])  # an evicted grammar still works
    assert list(manager._cache) == [request.structured_output.spec]


def test_user_stop_ids_stay_ordinary_tokens_to_the_grammar(tokenizer):
    """Only EOS ends the grammar; a user's stop token is allowed where the grammar allows it (and sampling
    it then ends the request in the scheduler, as without a grammar)."""
    comma = tokenizer.convert_tokens_to_ids(",")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}  # fmt: skip
    params = SamplingParams(max_tokens=32, stop_token_ids=[comma], structured_outputs=S(json=schema))
    params.update_from_generation_config({EOS_ID})
    request = Request("r", [5, 6, 7], params)
    manager = StructuredOutputManager(VOCAB, tokenizer=tokenizer)
    manager.add_request(request)
    ready(manager, request)
    for token in tokenizer.encode('{"a": 1'):
        assert request.structured_output.accept(token)
    assert comma in allowed(request) and EOS_ID not in allowed(request)
