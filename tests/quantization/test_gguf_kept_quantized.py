"""`quantization="gguf"`: a .gguf model's linear layers keep the file's Q8_0 / Q5_0 / Q4_K / Q6_K blocks
(repacked into `QuantizedWeight`) instead of the float32 weights of the converted directory.

Repacking is lossless, so the kept-quantized model holds bit for bit the weights of the dequantized load
(its export equals the converted model.safetensors) and in float32 computes the same logits; it takes fewer
bytes. Tiny GGUF files mix the types the way llama.cpp's Q4_K_M files do (and a few it cannot keep: F16,
Q4_0, which load dequantized); the demo model is checked too.
"""

from __future__ import annotations

import logging
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file

from qwick import LLM, SamplingParams
from qwick.quantization.base import weight_bytes
from qwick.quantization.gguf import GgufLinearMethod
from tests.loader.test_gguf import TOKENS, _llama_cpp_permute, add_tokenizer
from tests.models.test_decoder_matches_transformers import LogitsRecorder

HIDDEN, HEADS, KV, HEAD_DIM, FFN, LAYERS = 256, 4, 2, 64, 512, 2
# Per layer: the GGUF type of each linear tensor. Layer 0 fuses Q4_K q/k with a Q6_K v (a Q4_K_M mix whose
# shards need the common 8-bit form); layer 1 has the demo model's Q5_0 q/k + Q8_0 v, and two types qwick
# cannot keep quantized (F16 attn_output, Q4_0 ffn_down), which load dequantized.
LAYER_TYPES = [
    dict(
        attn_q=QT.Q4_K,
        attn_k=QT.Q4_K,
        attn_v=QT.Q6_K,
        attn_output=QT.Q5_0,
        ffn_gate=QT.Q8_0,
        ffn_up=QT.Q8_0,
        ffn_down=QT.Q6_K,
    ),
    dict(
        attn_q=QT.Q5_0,
        attn_k=QT.Q5_0,
        attn_v=QT.Q8_0,
        attn_output=QT.F16,
        ffn_gate=QT.Q4_K,
        ffn_up=QT.Q4_K,
        ffn_down=QT.Q4_0,
    ),
]
PROMPTS = [
    list(range(10, 13)),
    [(7 * i) % 250 + 5 for i in range(37)],
    [(3 * i + 1) % 250 + 5 for i in range(17)],
]
MAX_TOKENS = 8


def _k_quant_blocks(qtype: QT, n: int, k: int, rng) -> np.ndarray:
    """Random Q4_K / Q6_K rows (gguf-py cannot quantize to them) with small, roughly centred values."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(n, k // block * size), dtype=np.uint8)
    blocks = data.reshape(-1, size)

    def put(offset: int, values: np.ndarray) -> None:
        blocks[:, offset : offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)

    d = rng.uniform(0.5, 1.5, size=len(blocks))
    if qtype == QT.Q4_K:  # W = d * sc * q - dmin * m, sc, m < 64, q < 16
        put(0, d * 3e-4)
        put(2, d * 3e-4 * 7.5)
    else:  # Q6_K: W = d * sc * (q - 32), sc int8
        put(208, d * 3e-5)
    return data


def write_mixed_gguf(path, arch: str = "qwen2", seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-mixed-{arch}")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        w.add_rope_dimension_count(HEAD_DIM)
    add_tokenizer(w, arch)

    def matrix(name: str, shape: tuple[int, int], qtype: QT) -> None:
        if qtype in (QT.Q4_K, QT.Q6_K):
            w.add_tensor(name, _k_quant_blocks(qtype, *shape, rng), raw_dtype=qtype)
            return
        value = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            value = _llama_cpp_permute(value, HEADS, HEADS if ".attn_q." in name else KV)
        if qtype == QT.F16:
            w.add_tensor(name, value.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)

    def vector(name: str, size: int, norm: bool = False) -> None:
        value = 1.0 + 0.1 * rng.standard_normal(size) if norm else 0.1 * rng.standard_normal(size)
        w.add_tensor(name, value.astype(np.float32))

    matrix("token_embd.weight", (len(TOKENS), HIDDEN), QT.Q8_0)
    shapes = dict(
        attn_q=(HEADS * HEAD_DIM, HIDDEN),
        attn_k=(KV * HEAD_DIM, HIDDEN),
        attn_v=(KV * HEAD_DIM, HIDDEN),
        attn_output=(HIDDEN, HEADS * HEAD_DIM),
        ffn_gate=(FFN, HIDDEN),
        ffn_up=(FFN, HIDDEN),
        ffn_down=(HIDDEN, FFN),
    )
    for i, types in enumerate(LAYER_TYPES):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", HIDDEN, norm=True)
        vector(p + "ffn_norm.weight", HIDDEN, norm=True)
        for part, qtype in types.items():
            matrix(f"{p}{part}.weight", shapes[part], qtype)
        if arch == "qwen2":
            for part in ("attn_q", "attn_k", "attn_v"):
                vector(f"{p}{part}.bias", shapes[part][0])
    vector("output_norm.weight", HIDDEN, norm=True)
    matrix("output.weight", (len(TOKENS), HIDDEN), QT.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QWICK_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def mixed_gguf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"mixed-{request.param}") / f"tiny-{request.param}.gguf"
    write_mixed_gguf(path, request.param)
    return str(path)


def _llm(path: str, dtype: str = "float32", **kwargs) -> LLM:
    return LLM(path, dtype=dtype, num_gpu_blocks_override=128, block_size=4, max_model_len=256, **kwargs)


def test_layers_keep_the_blocks(mixed_gguf, caplog):
    with caplog.at_level(logging.INFO, logger="qwick.quantization.gguf"):
        model = _llm(mixed_gguf, quantization="gguf").llm_engine.core.runner.model
    assert model.quant_config.name == "gguf"
    expected = {  # module -> (bits, group, form): forms as formats/gguf_quant.py maps each type
        "layers.0.self_attn.qkv_proj": (8, 16, "mins"),  # Q4_K + Q4_K + Q6_K: common 8-bit form
        "layers.0.self_attn.o_proj": (8, 32, 16),  # Q5_0: zero point 16
        "layers.0.mlp.gate_up_proj": (8, 32, 128),  # Q8_0: zero point 128
        "layers.0.mlp.down_proj": (8, 16, 32),  # Q6_K: zero point 32
        "layers.1.self_attn.qkv_proj": (8, 32, "zeros"),  # Q5_0 + Q8_0: per-group zero points
        "layers.1.mlp.gate_up_proj": (4, 32, "mins"),  # Q4_K
    }
    for name, (bits, group, form) in expected.items():
        layer = model.model.get_submodule(name)
        assert isinstance(layer.method, GgufLinearMethod), name
        assert layer.weight.dtype == torch.int32 and layer.weight.shape[1] * 32 // bits == layer.input_size
        assert (layer.method.bits, layer.method.internal_group_size) == (bits, group), name
        if form == "mins":
            assert layer.mins is not None and layer.mins.dtype == torch.float32 and layer.zeros is None
        elif form == "zeros":
            assert layer.zeros is not None and layer.mins is None
        else:
            assert layer.zeros is None and layer.mins is None and layer.method.zero_point == form
    for name, kind in (("layers.1.self_attn.o_proj", "F16"), ("layers.1.mlp.down_proj", "Q4_0")):
        layer = model.model.get_submodule(name)
        assert not layer.method.quantized and layer.weight.dtype == torch.float32
        assert f"model.{name} is stored as {kind}" in caplog.text
    head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
    assert head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32
    assert model.quant_config.tensors == {}  # the file's memory map is let go once loaded


def test_weights_are_those_of_the_dequantized_load(mixed_gguf):
    """Bit for bit: the export of the kept-quantized model is the converted directory's float32 tensors
    (llama's q/k row permutation undone on the repacked rows too)."""
    llm = _llm(mixed_gguf, quantization="gguf")
    converted = load_file(os.path.join(llm.llm_engine.model_path, "model.safetensors"))
    exported = dict(llm.llm_engine.core.runner.model.checkpoint_tensors())
    assert set(exported) == set(converted)
    for name, tensor in converted.items():
        assert torch.equal(exported[name].float().cpu(), tensor), name


def test_logits_match_the_dequantized_load(mixed_gguf):
    results = {}
    for mode in (None, "gguf"):
        llm = _llm(mixed_gguf, quantization=mode)
        recorder = LogitsRecorder(llm)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        results[mode] = [
            (o.outputs[0].token_ids, torch.stack(recorder.by_request[o.request_id]).cpu()) for o in outputs
        ]
    for (tokens, logits), (ref_tokens, ref_logits) in zip(results["gguf"], results[None]):
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-5)


def test_bfloat16_logits_close_and_fewer_bytes(mixed_gguf):
    prompt = PROMPTS[1]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    logits, sizes = {}, {}
    for mode in (None, "gguf"):
        llm = _llm(mixed_gguf, "bfloat16", quantization=mode)
        recorder = LogitsRecorder(llm)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        logits[mode] = torch.stack(recorder.by_request[out.request_id]).float().cpu()
        sizes[mode] = weight_bytes(llm.llm_engine.core.runner.model)
    # both round the same fp32 weights once to bf16; only the matmul kernels differ
    rel = ((logits["gguf"] - logits[None]).norm() / logits[None].norm()).item()
    assert rel < 1e-2, rel
    assert sizes["gguf"]["linear"] < 0.75 * sizes[None]["linear"], sizes
    assert sizes["gguf"]["total"] < sizes[None]["total"]


def test_lm_head_kept_quantized(mixed_gguf):
    """`quantize_lm_head`: the head keeps the file's Q6_K `output.weight` (bit for bit the converted float
    tensor) and the logits are the dequantized load's."""
    llm = _llm(mixed_gguf, quantization="gguf", quantize_lm_head=True)
    model = llm.llm_engine.core.runner.model
    head = model.lm_head
    assert isinstance(head.method, GgufLinearMethod) and head.method.types == ["Q6_K"]
    converted = load_file(os.path.join(llm.llm_engine.model_path, "model.safetensors"))
    assert torch.equal(head.method.dense_weight(head).float().cpu(), converted["lm_head.weight"])
    assert model.model.embed_tokens.weight.dtype == torch.float32
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ours = llm.generate(PROMPTS, params, use_tqdm=False)
    ref = _llm(mixed_gguf).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in ref]


def test_tied_lm_head_keeps_the_embedding_blocks(tmp_path):
    """A tied GGUF model has no `output.weight`: with `quantize_lm_head` the head repacks the token
    embedding's blocks, and the lookups keep the float table."""
    from tests.loader.test_gguf import write_gguf

    path = tmp_path / "tied.gguf"
    write_gguf(path, "qwen2", QT.Q8_0, tied=True)
    llm = _llm(str(path), quantization="gguf", quantize_lm_head=True)
    model = llm.llm_engine.core.runner.model
    assert model.tie_word_embeddings and isinstance(model.lm_head.method, GgufLinearMethod)
    assert model.lm_head.method.types == ["Q8_0"] and model.lm_head.weight.dtype == torch.int32
    embed = model.model.embed_tokens.weight
    assert embed.dtype == torch.float32
    assert torch.equal(model.lm_head.method.dense_weight(model.lm_head).float(), embed)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    ref = _llm(str(path)).generate(
        [PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids


def test_errors(mixed_gguf, tiny_qwen2_dir, tmp_path):
    with pytest.raises(ValueError, match="not a model converted from a GGUF file.*only .gguf models"):
        _llm(tiny_qwen2_dir, quantization="gguf")
    with pytest.raises(ValueError, match="cannot be combined with load_format='dummy'"):
        _llm(mixed_gguf, quantization="gguf", load_format="dummy")
    # the converted directory outlives a changed file: the blocks would not match its float tensors
    copy = tmp_path / "copy.gguf"
    with open(mixed_gguf, "rb") as f:
        copy.write_bytes(f.read())
    out = _llm(str(copy)).llm_engine.model_path
    os.utime(copy, ns=(0, 0))
    from qwick.loader.gguf import source_gguf

    with pytest.raises(ValueError, match="changed since"):
        source_gguf(out)
    os.remove(copy)
    with pytest.raises(ValueError, match="is gone"):
        source_gguf(out)


@pytest.mark.demo
def test_demo_model_kept_quantized(demo_model_dir):
    """The demo model (Q5_0, Q8_0, Q4_K, Q6_K linears): same greedy tokens and bf16 logits within kernel
    rounding of the dequantized load, decoder linear layers in about half the bytes."""
    prompt = "def fibonacci(n):\n    # return the n-th Fibonacci number\n"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    logits, tokens, sizes = {}, {}, {}
    for mode in (None, "gguf"):
        llm = LLM(None, quantization=mode, max_model_len=256, num_gpu_blocks_override=64)
        recorder = LogitsRecorder(llm)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        tokens[mode] = out.outputs[0].token_ids
        logits[mode] = torch.stack(recorder.by_request[out.request_id]).float()
        sizes[mode] = weight_bytes(llm.llm_engine.core.runner.model)
        del llm
    assert tokens["gguf"] == tokens[None]
    rel = ((logits["gguf"] - logits[None]).norm() / logits[None].norm()).item()
    assert rel < 2e-2, rel
    assert sizes["gguf"]["linear"] < 0.6 * sizes[None]["linear"], sizes
