"""`qwick.bench.engine_bench` helpers that the benchmark scripts share."""

from __future__ import annotations

from qwick.bench.engine_bench import first_token_seconds
from qwick.entrypoints.llm import LLM


def test_first_token_seconds_runs_one_greedy_token_to_the_end(tiny_qwen2_dir):
    llm = LLM(tiny_qwen2_dir, dtype="float32", max_model_len=128)
    engine = llm.llm_engine
    finished = []
    step = engine.step

    def recording_step():
        outputs = step()
        finished.extend(o for o in outputs if o.finished)
        return outputs

    engine.step = recording_step
    seconds = first_token_seconds(engine, list(range(5, 40)))
    assert seconds > 0 and not engine.has_unfinished_requests()
    assert len(finished) == 1 and len(finished[0].outputs[0].token_ids) == 1
    assert finished[0].outputs[0].finish_reason == "length"
