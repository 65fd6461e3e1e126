"""The grammar bitmask in the batched sampler: constrained rows sample only allowed tokens (greedy or not,
seeded or not), other rows are untouched, logprobs stay those of the raw logits."""

from __future__ import annotations

import pytest
import torch

from qwick.core.request import Request
from qwick.runner.sampler import Sampler, SamplingMetadata
from qwick.sampling_params import SamplingParams

pytest.importorskip("xgrammar")

V = 100
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class MaskOnly:
    """A stand-in grammar that allows a fixed set of tokens."""

    ready = True

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for tok in self.allowed:
            word, bit = divmod(tok, 32)
            value = int(bitmask[row, word]) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # int32 two's complement


def make_req(rid: str, allowed: set[int] | None = None, **params) -> Request:
    request = Request(rid, [1, 2, 3], SamplingParams(**params))
    if allowed is not None:
        request.structured_output = MaskOnly(allowed)
    return request


def run(requests, logits, device="cpu", sampler=None):
    meta = SamplingMetadata.build(requests, V, device)
    return (sampler or Sampler(seed=0))(logits.clone().to(device), meta), meta


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_take_the_best_allowed_token_others_untouched(device):
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    allowed = {5, 40, 63, 64, 99}  # across words, including bit 31 (63) and the last id
    reqs = [
        make_req("a", allowed, temperature=0),
        make_req("b", temperature=0),
        make_req("c", {31}, temperature=0),
    ]
    out, meta = run(reqs, logits, device)
    assert meta.grammar_rows == [0, 2]
    best = max(allowed, key=lambda t: logits[0, t].item())
    assert out.sampled_token_ids.tolist() == [best, int(logits[1].argmax()), 31]


@pytest.mark.parametrize("device", DEVICES)
def test_random_rows_sample_only_allowed_tokens(device):
    logits = torch.zeros(64, V)  # flat: without the mask every token would show up
    allowed = {3, 17, 32, 77}
    reqs = [make_req(f"r{i}", allowed, temperature=1.0, top_p=0.95) for i in range(64)]
    seen = set()
    sampler = Sampler(seed=1)
    for _ in range(4):
        out, _ = run(reqs, logits, device, sampler)
        seen |= set(out.sampled_token_ids.tolist())
    assert seen == allowed


def test_logprobs_come_from_the_raw_logits():
    torch.manual_seed(1)
    logits = torch.randn(1, V)
    out, _ = run([make_req("a", {7, 8}, temperature=0, logprobs=3)], logits)
    raw = torch.log_softmax(logits[0], dim=-1)
    token = int(out.sampled_token_ids[0])
    assert token in (7, 8)
    assert out.logprobs.sampled_logprobs[0].item() == pytest.approx(raw[token].item())
    assert out.logprobs.topk_token_ids[0].tolist() == raw.topk(3).indices.tolist()
    assert out.logprobs.selected_token_ranks[0].item() == int((raw > raw[token]).sum()) + 1


def test_seeded_constrained_row_does_not_depend_on_its_neighbours():
    torch.manual_seed(2)
    logits = torch.randn(3, V)
    target = make_req("t", set(range(0, V, 3)), temperature=1.0, seed=42)
    alone, _ = run([target], logits[1:2], sampler=Sampler(seed=5))
    batch, _ = run([make_req("x", temperature=1.0), target, make_req("y", {1}, temperature=0.5)], logits)
    assert batch.sampled_token_ids[1].item() == alone.sampled_token_ids[0].item()


def test_batch_without_grammar_builds_no_bitmask():
    _, meta = run([make_req("a", temperature=0), make_req("b", temperature=1.0)], torch.randn(2, V))
    assert meta.grammar_bitmask is None and meta.grammar_rows == []
