"""The built-in demo model: qwick's greedy output equals transformers' token for token.

transformers loads the converted directory; tests/loader/test_demo.py proves its tensors are bit-identical
to transformers' own load of the GGUF file, so this is the same model transformers builds from the GGUF.
"""

from __future__ import annotations

import pytest
import torch

from qwick import LLM, SamplingParams

pytestmark = pytest.mark.demo

CONVERSATIONS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "用中文解释一下什么是快速排序，并给出它的时间复杂度。",
    "Write a C function that reverses a singly linked list, then explain how it works step by step.",
]
RAW_PROMPTS = ["def merge_sort(arr):\n    "]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def models(demo_model_dir):
    from transformers import AutoModelForCausalLM

    llm = LLM(demo_model_dir, dtype="float32", max_model_len=1024)
    hf = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    return llm, hf


def test_greedy_equals_transformers_english_chinese_code(models):
    llm, hf = models
    tokenizer = llm.get_tokenizer()
    prompts = []
    for text in CONVERSATIONS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    prompts += [tokenizer.encode(p) for p in RAW_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outputs = llm.generate(prompts, params, use_tqdm=False)  # one batch, mixed lengths
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
            )[0, len(prompt) :].tolist()
        ours = out.outputs[0].token_ids
        assert len(ours) == NEW_TOKENS, f"stopped early: {out.outputs[0].text!r}"
        assert ours == ref, (
            f"diverged at token {next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)}"
        )
    chinese = outputs[1].outputs[0].text
    assert "快速排序" in chinese and "\ufffd" not in chinese  # sensible, unbroken Chinese
    assert "def " in outputs[0].outputs[0].text
