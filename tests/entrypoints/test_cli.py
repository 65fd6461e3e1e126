"""The `qwick` command line on a tiny model: generate streams text, bad input exits with a clear error."""

from __future__ import annotations

import pytest

from qwick.entrypoints.cli import main


def test_generate_streams_the_completion(tiny_qwen2_dir, capsys):
    args = [
        "generate",
        tiny_qwen2_dir,
        "--prompt",
        "hello",
        "--max-tokens",
        "8",
        "--dtype",
        "float32",
        "--num-gpu-blocks-override",
        "64",
        "--max-model-len",
        "256",
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()  # some text came out
    assert "8 tokens" in captured.err  # the timing summary


def test_bad_model_path_is_a_clean_error(capsys):
    assert main(["generate", "./definitely/not/here"]) == 2
    assert "qwick: error:" in capsys.readouterr().err


def test_help_lists_engine_flags(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--max-model-len", "--max-num-seqs", "--enable-prefix-caching", "--load-format", "--dtype"):
        assert flag in out
