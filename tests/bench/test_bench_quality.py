"""`qwick bench quality` end to end on a tiny model: perplexity over the pinned stdlib files, greedy and
teacher-forced agreement with the unquantized model, weight memory per mode."""

from __future__ import annotations

import json
import math

import pytest

from qwick.bench.quality import STDLIB_FILES, stdlib_corpus
from qwick.entrypoints.cli import main

ENGINE = ["--dtype", "float32", "--num-gpu-blocks-override", "256", "--max-model-len", "512"]


def _quality(model_dir: str, tmp_path, capsys, *flags: str) -> tuple[str, dict]:
    """`qwick bench quality` on a small window: (the printed table, the JSON report's result)."""
    out = tmp_path / "quality.json"
    args = ["bench", "quality", model_dir, *ENGINE, *flags, "--output-json", str(out)]
    args += ["--window", "64", "--prompt-len", "16", "--max-tokens", "6", "--num-prompts", "3"]
    assert main(args) == 0
    return capsys.readouterr().out, json.loads(out.read_text())["result"]


def test_quality_report(tiny_qwen2_dir, tmp_path, capsys):
    printed, result = _quality(tiny_qwen2_dir, tmp_path, capsys, "--modes", "none", "fp8", "int8")
    assert "| fp8 + fp8 LM head | float32 |" in printed  # the 8-bit modes quantize the head by default
    corpus = stdlib_corpus()
    assert result["corpus"]["files"] == list(STDLIB_FILES) and result["corpus"]["sha256"] == corpus.sha256
    none, fp8, int8 = result["modes"]
    assert none["quantization"] is None and "greedy_identical" not in none
    for mode in (none, fp8, int8):
        assert mode["scored_tokens"] == len(STDLIB_FILES) * 63 and math.isfinite(mode["perplexity"])
    for mode in (fp8, int8):
        assert 0 <= mode["greedy_identical"] <= 1 and 0 <= mode["teacher_forced_top1"] <= 1
        assert mode["teacher_forced_top1"] > 0.5  # the same random model, 8-bit: mostly the same picks
        assert mode["linear_weight_bytes"] < none["linear_weight_bytes"] / 3  # fp32 -> one byte a weight
        assert abs(math.log(mode["perplexity"] / none["perplexity"])) < 0.1


@pytest.mark.parametrize(
    ("flag", "heads"),
    [
        (None, ("int8", "int8")),
        ("--quantize-lm-head", ("int8", "int4")),
        ("--no-quantize-lm-head", (None, None)),
    ],
)
def test_quality_with_the_lm_head_quantized(tiny_qwen2_dir, tmp_path, capsys, flag, heads):
    """Unset, int8 quantizes the LM head and int4 makes it int8; `--quantize-lm-head` puts each in its
    body's format and `--no-quantize-lm-head` keeps them in the model dtype; the reference keeps its head."""
    flags = ("--modes", "none", "int8", "int4") + ((flag,) if flag else ())
    printed, result = _quality(tiny_qwen2_dir, tmp_path, capsys, *flags)
    none, int8, int4 = result["modes"]
    assert none["lm_head"] is None and (int8["lm_head"], int4["lm_head"]) == heads
    for mode, head in zip(("int8", "int4"), heads):
        assert (f"| {mode} + {head} LM head | float32 |" in printed) == (head is not None)
        assert (f"| {mode} | float32 |" in printed) == (head is None)
    assert int8["teacher_forced_top1"] > 0.5


def test_quality_needs_the_reference_first(tiny_qwen2_dir, capsys):
    assert main(["bench", "quality", tiny_qwen2_dir, *ENGINE, "--modes", "fp8"]) == 2
    assert "must start with 'none'" in capsys.readouterr().err


@pytest.mark.parametrize("name", STDLIB_FILES)
def test_pinned_stdlib_files_exist(name):
    """The pinned set is read from the running interpreter's stdlib: every file must be there."""
    assert stdlib_corpus((name,)).texts[0]
