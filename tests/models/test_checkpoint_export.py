"""`checkpoint_tensors` undoes `load_weights`: transformers can run on exactly our (even random) weights."""

from __future__ import annotations

import pytest
import torch

from qwick import LLM
from qwick.bench.hf_reference import transformers_on_our_weights
from tests.utils import make_tiny_model


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_export_equals_the_checkpoint(arch, tmp_path):
    hf = make_tiny_model(arch, str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", num_gpu_blocks_override=128, max_model_len=256)
    exported = dict(llm.llm_engine.core.runner.model.checkpoint_tensors())
    expected = {
        k: v
        for k, v in hf.state_dict().items()
        if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)
    }
    assert set(exported) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name


def test_transformers_on_dummy_weights_matches_qwick(tmp_path):
    make_tiny_model("qwen2", str(tmp_path))
    llm = LLM(
        str(tmp_path), dtype="float32", load_format="dummy", num_gpu_blocks_override=128, max_model_len=256
    )
    model = llm.llm_engine.core.runner.model
    ref = transformers_on_our_weights(model, torch.float32, "cpu")
    prompt = [5, 17, 42, 99, 7]
    from qwick import SamplingParams

    ours = llm.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False
    )
    with torch.no_grad():
        theirs = ref.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert ours[0].outputs[0].token_ids == theirs
