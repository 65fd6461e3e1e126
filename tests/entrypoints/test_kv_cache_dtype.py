"""`kv_cache_dtype` / `--kv-cache-dtype`: accepted values (vLLM's names), errors, the CLI flag."""

from __future__ import annotations

import pytest

from qwick import LLM
from qwick.config import EngineConfig
from qwick.entrypoints.cli import build_parser, engine_config_from_args, main


@pytest.mark.parametrize("value,canonical", [("auto", "auto"), ("fp8", "fp8"), ("fp8_e4m3", "fp8")])
def test_engine_config_accepts_vllm_names(value, canonical):
    assert EngineConfig(kv_cache_dtype=value).kv_cache_dtype == canonical


@pytest.mark.parametrize("value", ["fp8_e5m2", "int8", "bfloat16", "FP8", ""])
def test_other_values_are_a_clear_error(value):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        EngineConfig(kv_cache_dtype=value)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("x", kv_cache_dtype=value)


def test_cli_flag_reaches_the_engine_config():
    for argv in (["serve"], ["bench", "latency"], ["bench", "throughput"], ["generate"]):
        args = build_parser().parse_args([*argv, "--kv-cache-dtype", "fp8_e4m3"])
        assert engine_config_from_args(args).kv_cache_dtype == "fp8", argv
    args = build_parser().parse_args(["generate"])
    assert engine_config_from_args(args).kv_cache_dtype == "auto"


def test_cli_rejects_unknown_values(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv-cache-dtype", "int4"])
    assert "--kv-cache-dtype" in capsys.readouterr().err


@pytest.mark.parametrize("sub", ["serve", "generate"])
def test_help_explains_the_flag(sub, capsys):
    with pytest.raises(SystemExit):
        main([sub, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--kv-cache-dtype" in out and "fp8_e4m3" in out
    assert "doubles the KV capacity" in out and "small quality cost" in out


def test_generate_with_fp8_cache(tiny_qwen2_dir, capsys):
    args = [
        "generate",
        tiny_qwen2_dir,
        "--prompt",
        "hello",
        "--max-tokens",
        "8",
        "--dtype",
        "float32",
        "--kv-cache-dtype",
        "fp8",
        "--num-gpu-blocks-override",
        "64",
        "--max-model-len",
        "256",
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "8 tokens" in captured.err
