"""The offline `LLM` API on a tiny random Qwen2: vLLM's contract, sampling features, errors."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from qwick import LLM, RequestOutputKind, SamplingParams
from tests.utils import hf_logits, make_tiny_model

PROMPT_IDS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 45))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-qwen2"))
    return path, make_tiny_model("qwen2", path)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny[0], dtype="float32", num_gpu_blocks_override=256, block_size=4, max_model_len=256)


def kv_usage(llm: LLM) -> float:
    return llm.llm_engine.core.scheduler.get_stats().kv_cache_usage


def test_text_prompt_output_shape(llm):
    out = llm.generate(
        "hello world", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert len(out) == 1
    res = out[0]
    assert res.prompt == "hello world"
    assert res.prompt_token_ids == llm.get_tokenizer().encode("hello world")
    comp = res.outputs[0]
    assert len(comp.token_ids) == 8 and comp.finish_reason == "length" and res.finished
    assert comp.text == llm.get_tokenizer().decode(comp.token_ids, skip_special_tokens=True)


def test_outputs_in_prompt_order_and_dict_prompts(llm):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    a = llm.generate([{"prompt_token_ids": p} for p in PROMPT_IDS], params, use_tqdm=False)
    b = llm.generate(PROMPT_IDS[::-1], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in a] == PROMPT_IDS
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b[::-1]]


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPT_IDS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, ignore_eos=True)
    batch = llm.generate(
        [PROMPT_IDS[2], PROMPT_IDS[0], PROMPT_IDS[1]], [others, params, others], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate(
        [PROMPT_IDS[0]],
        SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True),
        use_tqdm=False,
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_samples_share_prompt_blocks_without_prefix_caching(tiny):
    llm = LLM(
        tiny[0],
        dtype="float32",
        num_gpu_blocks_override=256,
        block_size=4,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    prompt = list(range(30, 70))  # 40 tokens: 10 blocks
    out = llm.generate(
        [prompt], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different samples
    stats = llm.llm_engine.core.scheduler.get_stats()
    assert stats.prefix_cache_hits >= 2 * 36  # the 2nd and 3rd samples reuse the 1st's full prompt blocks
    assert kv_usage(llm) == 0.0


def test_logprobs_match_log_softmax_of_transformers(tiny, llm):
    hf_model = tiny[1]
    prompt = PROMPT_IDS[2]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    ref = torch.log_softmax(hf_logits(hf_model, prompt + out.token_ids), dim=-1)
    assert len(out.logprobs) == 5
    total = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + step]
        top = torch.topk(row, 3)
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        for tid, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[tid].logprob == pytest.approx(value, abs=1e-4)
        total += row[token].item()
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_stop_string_and_stop_token(llm):
    base = llm.generate(
        "hello", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False
    )
    text, ids = base[0].outputs[0].text, base[0].outputs[0].token_ids
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip() and stop in text
    cut = llm.generate(
        "hello", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    kept = llm.generate(
        "hello",
        SamplingParams(
            max_tokens=20, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]

    by_token = llm.generate(
        "hello", SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[ids[3]]), use_tqdm=False
    )[0].outputs[0]
    first = ids.index(ids[3])
    assert by_token.finish_reason == "stop" and by_token.stop_reason == ids[3]
    assert by_token.token_ids == ids[: first + 1]
    assert kv_usage(llm) == 0.0


def test_min_tokens_blocks_stop_tokens(llm):
    ids = (
        llm.generate("hello", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)[
            0
        ]
        .outputs[0]
        .token_ids
    )
    out = llm.generate(
        "hello",
        SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[ids[0]], min_tokens=4),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= 4 and ids[0] not in out.token_ids[:4]


def test_stream_deltas_concatenate_to_final_text(llm):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    final = llm.generate("hello world", params, use_tqdm=False)[0].outputs[0]
    delta_params = SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    chunks, tokens, updates = [], [], 0
    for out in llm.stream("hello world", delta_params):
        chunks.append(out.outputs[0].text)
        tokens.extend(out.outputs[0].token_ids)
        updates += 1
    assert "".join(chunks) == final.text and tokens == final.token_ids
    assert updates > 1  # it really streamed


def test_stream_stopped_early_aborts_and_frees(llm):
    stream = llm.stream([PROMPT_IDS[0], PROMPT_IDS[1]], SamplingParams(max_tokens=100, ignore_eos=True))
    next(stream)
    assert kv_usage(llm) > 0.0
    stream.close()
    assert kv_usage(llm) == 0.0
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_applies_template(llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    out = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert out.prompt_token_ids == list(expected)
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "prompt, match",
    [("", "empty"), ([], "empty"), ([5, 10**6], "out of range"), (list(range(5, 261)), "max_model_len")],
)
def test_bad_prompts_rejected_and_nothing_left_behind(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["hello", prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert kv_usage(llm) == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n must"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(logit_bias={5: 500}), "logit_bias"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_logit_bias_outside_vocab_rejected(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("hi", SamplingParams(logit_bias={10**6: 5}), use_tqdm=False)


def test_logit_bias_forces_token(llm):
    out = llm.generate(
        "hi",
        SamplingParams(max_tokens=5, temperature=0, logit_bias={77: 100}, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == [77] * 5


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="unsupported model architecture.*Qwen2ForCausalLM"):
        LLM(str(tmp_path))


def test_missing_model_path():
    with pytest.raises(FileNotFoundError, match="neither a local directory"):
        LLM("./no/such/model/dir")


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))


def test_missing_weights(tiny, tmp_path):
    for name in os.listdir(tiny[0]):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny[0], name), tmp_path / name)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(tmp_path))


def test_hub_id_without_network_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="Hugging Face Hub"):
        LLM("Qwen/no-such-model-for-qwick-tests")


def test_dummy_weights_load_format(tiny):
    llm = LLM(
        tiny[0],
        dtype="float32",
        load_format="dummy",
        num_gpu_blocks_override=64,
        block_size=4,
        max_model_len=128,
    )
    out = llm.generate([PROMPT_IDS[0]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_engine_config_errors():
    with pytest.raises(ValueError, match="block_size"):
        LLM("x", block_size=3)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM("x", max_num_seqs=0)


def test_kv_cache_smaller_than_one_request(tiny):
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(tiny[0], dtype="float32", num_gpu_blocks_override=8, block_size=4, max_model_len=256)


def test_attention_backend_choice(tiny_qwen2_dir):
    with pytest.raises(ValueError, match="attention_backend must be"):
        LLM("x", attention_backend="flash")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        LLM(
            tiny_qwen2_dir,
            dtype="float32",
            device="cpu",
            attention_backend="triton",
            num_gpu_blocks_override=128,
            max_model_len=256,
        )
    llm = LLM(tiny_qwen2_dir, dtype="float32", device="cpu", num_gpu_blocks_override=128, max_model_len=256)
    assert llm.llm_engine.core.runner.backend.name == "torch"  # auto on the CPU
