"""`qwick bench latency / throughput --structured`: the same prompts with and without a JSON Schema."""

from __future__ import annotations

import json

import pytest

from qwick.entrypoints.cli import main

pytest.importorskip("xgrammar")

ENGINE = ["--dtype", "float32", "--num-gpu-blocks-override", "256", "--max-model-len", "512"]


def test_throughput_with_and_without_a_schema(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "thr.json"
    args = ["bench", "throughput", tiny_qwen2_dir, *ENGINE, "--num-prompts", "4", "--input-len", "8",
            "--output-len", "12", "--num-iters", "1", "--structured", "--output-json", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())["result"]
    plain, constrained = result["qwick"], result["qwick_structured"]
    # The built-in schema never completes: both runs make every token they were asked for.
    assert plain["output_tokens"] == constrained["output_tokens"] == 4 * 12
    assert result["structured_relative_speed"] == pytest.approx(
        constrained["output_tokens_per_s"] / plain["output_tokens_per_s"]
    )


def test_latency_with_a_schema_file(tiny_qwen2_dir, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 1000}))
    out = tmp_path / "lat.json"
    args = ["bench", "latency", tiny_qwen2_dir, *ENGINE, "--input-len", "8", "--output-len", "6",
            "--num-iters", "1", "--structured", str(schema), "--output-json", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())["result"]
    assert result["qwick_structured"]["decode_tokens_per_s"] > 0 and result["structured_relative_speed"] > 0
