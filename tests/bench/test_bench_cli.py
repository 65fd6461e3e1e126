"""`qwick bench` runs end to end on a tiny model, beside transformers, and writes its JSON report."""

from __future__ import annotations

import json

import pytest

from qwick.entrypoints.cli import main

ENGINE = ["--dtype", "float32", "--num-gpu-blocks-override", "256", "--max-model-len", "512"]


def test_latency_report(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "lat.json"
    args = [
        "bench",
        "latency",
        tiny_qwen2_dir,
        *ENGINE,
        "--input-len",
        "20",
        "--output-len",
        "8",
        "--num-iters",
        "2",
        "--compare-transformers",
        "--output-json",
        str(out),
    ]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("qwick bench latency") and report["commit"] and report["date"]
    ours, ref = report["result"]["qwick"], report["result"]["transformers"]
    assert len(report["result"]["qwick_runs"]) == 2
    assert ours["decode_tokens_per_s"] > 0 and ours["ttft_ms"] > 0
    assert ref["decode_tokens_per_s"] > 0


def test_throughput_report(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "thr.json"
    args = [
        "bench",
        "throughput",
        tiny_qwen2_dir,
        *ENGINE,
        "--num-prompts",
        "6",
        "--input-len",
        "12",
        "--output-len",
        "5",
        "--num-iters",
        "1",
        "--compare-transformers",
        "--output-json",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())["result"]
    assert result["qwick"]["output_tokens_per_s"] > 0
    assert result["transformers"]["output_tokens_per_s"] > 0


def test_throughput_with_length_ranges(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "thr.json"
    args = [
        "bench",
        "throughput",
        tiny_qwen2_dir,
        *ENGINE,
        "--num-prompts",
        "5",
        "--input-len-range",
        "4",
        "30",
        "--output-len-range",
        "2",
        "9",
        "--num-iters",
        "1",
        "--compare-transformers",
        "--output-json",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())["result"]
    assert result["qwick"]["seconds"] > 0
    # transformers' static batch generates the longest output for every request; only the asked-for
    # tokens count, as for qwick.
    hf = result["transformers"]
    wanted = result["qwick"]["output_tokens"]
    assert hf["output_tokens_per_s"] == pytest.approx(wanted / hf["seconds"])
    assert hf["generated_tokens"] >= wanted


def test_latency_at_real_shapes_with_dummy_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("QWICK_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "shape.json"
    args = [
        "bench",
        "latency",
        "--shape",
        "qwen2.5-0.5b",
        "--max-model-len",
        "256",
        "--cpu-kv-cache-gib",
        "0.1",
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--num-iters",
        "1",
        "--output-json",
        str(out),
    ]
    assert main(args) == 0
    assert json.loads(out.read_text())["result"]["qwick"]["decode_tokens_per_s"] > 0
    config = json.loads((tmp_path / "cache" / "shapes" / "qwen2.5-0.5b" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (896, 24, 151936)


def test_unknown_shape_is_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "latency", "--shape", "qwen9-999b"])
    assert "invalid choice" in capsys.readouterr().err


def test_latency_on_dummy_weights_compares_with_transformers_on_the_same_weights(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "dummy.json"
    args = [
        "bench",
        "latency",
        tiny_qwen2_dir,
        *ENGINE,
        "--load-format",
        "dummy",
        "--input-len",
        "10",
        "--output-len",
        "4",
        "--num-iters",
        "1",
        "--compare-transformers",
        "--output-json",
        str(out),
    ]
    assert main(args) == 0
    assert json.loads(out.read_text())["result"]["transformers"]["decode_tokens_per_s"] > 0


def test_latency_summary_takes_each_figures_median():
    """The summary of several latency runs: every figure's own median, not the figures of one run (the run
    with the median decode step here has the outlying TTFT)."""
    from qwick.bench.cli import _medians

    steps = [4.44, 4.50, 4.53, 4.56]
    ttfts = [46.8, 54.6, float("nan"), 47.1]  # the third run measured no TTFT
    runs = [
        {"ttft_ms": t, "decode_step_ms_median": s, "decode_tokens_per_s": 1000 / s}
        for t, s in zip(ttfts, steps)
    ]
    summary = _medians(runs)
    assert summary["ttft_ms"] == 47.1
    # an even count: the step and the rate still come from one run
    assert summary["decode_step_ms_median"] == 4.50 and summary["decode_tokens_per_s"] == 1000 / 4.50
