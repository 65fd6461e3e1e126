"""Shared fixtures.

The demo model is assembled and converted once into the real cache ($QWICK_CACHE or ~/.cache/qwick),
so every test session (and every test in it) after the first gets it in milliseconds.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


@pytest.fixture(scope="session")
def demo_model_dir() -> str:
    """The converted demo model's HF directory; skips when the demo packages are not installed."""
    from qwick.loader.demo import DemoModelNotInstalledError, demo_model_path

    try:
        return demo_model_path()
    except DemoModelNotInstalledError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def demo_gguf_file() -> str:
    """The assembled, verified demo GGUF file; skips when the demo packages are not installed."""
    from qwick.loader.demo import DemoModelNotInstalledError, demo_gguf_path

    try:
        return demo_gguf_path()
    except DemoModelNotInstalledError as e:
        pytest.skip(str(e))


def _load_transformers_gguf(gguf_path: str):
    """The model transformers builds from a GGUF file: the reference for qwick's GGUF conversion.

    `from_pretrained(dir, gguf_file=...)` needs `accelerate`; without it, this runs the function that
    `from_pretrained` itself calls for qwen2/qwen3/llama files (`load_gguf_checkpoint`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    directory, name = os.path.split(gguf_path)
    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config).eval()
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


@pytest.fixture(scope="session")
def load_transformers_gguf():
    """`load(gguf_path) -> transformers model` loaded by transformers' own GGUF support."""
    return _load_transformers_gguf


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    """A tiny random Qwen2 checkpoint with a byte-level tokenizer, shared by the whole session."""
    from tests.utils import make_tiny_model

    path = str(tmp_path_factory.mktemp("tiny-qwen2-shared"))
    make_tiny_model("qwen2", path)
    return path
