"""The benchmark inputs (qwick/bench/workloads.py): seeded, in the method's ranges, clear of special ids."""

from __future__ import annotations

import pytest

from qwick.bench.workloads import fixed_requests, ranged_requests, throughput_summary, workload3_requests


def test_workload3_is_the_methods_ranges_and_seeded():
    reqs = workload3_requests(151_936)
    assert len(reqs) == 256
    assert all(100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.max_tokens <= 1024 for r in reqs)
    assert all(1 <= t < 150_000 for r in reqs for t in r.prompt_token_ids)
    again = workload3_requests(151_936)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    assert [r.max_tokens for r in workload3_requests(151_936, seed=1)] != [r.max_tokens for r in reqs]
    assert [r.max_tokens for r in reqs] == [
        r.max_tokens for r in ranged_requests(256, (100, 1024), (100, 1024), 151_936)
    ]


def test_fixed_requests_and_summary():
    reqs = fixed_requests(3, 5, 7, vocab_size=10)
    assert [len(r.prompt_token_ids) for r in reqs] == [5, 5, 5] and {r.max_tokens for r in reqs} == {7}
    assert throughput_summary(reqs, 2.0) == {"seconds": 2.0, "output_tokens_per_s": pytest.approx(10.5)}
