"""`kv_cache_dtype="fp8"` end to end on a tiny random Qwen2: capacity, closeness to a bf16 cache, the
scheduler's features on an fp8 cache, and k/v scales from a checkpoint.

Measured on the CPU (torch attention backend), bf16 model, fp8 cache against bf16 cache, 6 prompts x 32
greedy tokens: 98.4% of the greedy tokens agree (5 of 6 requests identical; one diverges at token 15),
teacher-forced top-1 agreement 95-100% per request, max |logit difference| 0.06-0.10 on logits of
magnitude ~3 (max |log-softmax difference| about the same). The tiny model's random logits are far flatter
than a real model's, so its top-1 flips more easily. Asserted: max |logit diff| < 0.25, greedy agreement
>= 90%, teacher-forced top-1 agreement >= 90%.

GPU tests (marked gpu): with `gpu_memory_utilization` sizing the pool, fp8 holds twice the blocks; the
Triton backend with an fp8 cache replays CUDA graphs to the same tokens as eager, and agrees with the
PyTorch reference backend on the same fp8 cache.
"""

from __future__ import annotations

import gc
import math
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwick import LLM, SamplingParams
from qwick.forward_context import set_forward_context
from qwick.layers.attention.backend import FP8_KV_DTYPE, AttentionRow
from tests.utils import make_tiny_model

PROMPTS = [
    list(range(10, 13)),
    [(7 * i) % 300 + 5 for i in range(37)],
    [(3 * i + 1) % 300 + 5 for i in range(17)],
    [42] * 9,
]


def _runner(llm: LLM):
    return llm.llm_engine.core.runner


def _logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits at every position of one sequence, in one prefill through the engine's model and KV
    pool (blocks 1..; the engine is idle). Attention reads every key back from the (fp8) cache."""
    runner = _runner(llm)
    n = len(token_ids)
    blocks = list(range(1, 1 + math.ceil(n / runner.block_size)))
    metadata = runner.backend.build_metadata([AttentionRow(0, n, blocks)])
    ids = torch.tensor(token_ids, dtype=torch.long, device=runner.device)
    with torch.inference_mode(), set_forward_context(metadata):
        hidden = runner.model(ids, torch.arange(n, device=runner.device))
        return runner.model.compute_logits(hidden).float().cpu()


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return same / sum(len(r) for r in a)


# ---- CPU -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,ratio", [("bfloat16", 2), ("float32", 4)])
def test_fp8_cache_halves_bytes_per_block_and_doubles_blocks(tiny_qwen2_dir, dtype, ratio):
    kw = dict(dtype=dtype, block_size=16, max_model_len=256, cpu_kv_cache_gib=0.01)
    auto, fp8 = LLM(tiny_qwen2_dir, **kw), LLM(tiny_qwen2_dir, kv_cache_dtype="fp8", **kw)
    ra, rf = _runner(auto), _runner(fp8)
    assert ra.kv_bytes_per_block() == ratio * rf.kv_bytes_per_block()
    # The same memory budget holds `ratio` times the blocks, and so the tokens.
    assert rf.num_blocks == pytest.approx(ratio * ra.num_blocks, abs=ratio)
    assert fp8.llm_engine.core.num_kv_tokens > (ratio - 0.1) * auto.llm_engine.core.num_kv_tokens
    for layer in rf.model.attention_layers():
        assert layer.kv_cache.dtype == FP8_KV_DTYPE
        assert layer.kv_cache.shape[1] == rf.num_blocks
        assert (layer.k_scale, layer.v_scale) == (1.0, 1.0)  # no scales in the checkpoint
    assert ra.model.attention_layers()[0].kv_cache.dtype == ra.dtype
    assert fp8.llm_engine.config.kv_cache_dtype == "fp8"
    assert LLM(tiny_qwen2_dir, kv_cache_dtype="fp8_e4m3", **kw).llm_engine.config.kv_cache_dtype == "fp8"


def test_fp8_cache_generates_close_to_bf16_cache(tiny_qwen2_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 300) for _ in range(n)] for n in (3, 17, 40, 100, 5, 64)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="bfloat16", num_gpu_blocks_override=256, block_size=4, max_model_len=256)
    llms = {kv: LLM(tiny_qwen2_dir, kv_cache_dtype=kv, **kw) for kv in ("auto", "fp8")}
    outs = {
        kv: [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        for kv, llm in llms.items()
    }
    assert _agreement(outs["auto"], outs["fp8"]) >= 0.9
    # Teacher-forced: both read the bf16-cache run's tokens; compare their logits position by position.
    for prompt, tokens in zip(prompts, outs["auto"]):
        seq = prompt + tokens
        ref, got = _logits(llms["auto"], seq), _logits(llms["fp8"], seq)
        assert torch.isfinite(got).all()
        assert (got - ref).abs().max().item() < 0.25
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


def _fp8_llm(path: str, **overrides) -> LLM:
    kw = dict(
        dtype="float32", kv_cache_dtype="fp8", num_gpu_blocks_override=128, block_size=4, max_model_len=256
    )
    return LLM(path, **{**kw, **overrides})


def _greedy(llm: LLM, prompts=PROMPTS, max_tokens=12):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def fp8_reference(tiny_qwen2_dir) -> list[list[int]]:
    """Greedy tokens with an fp8 cache: one engine, a roomy pool, no prefix caching."""
    return _tokens(_greedy(_fp8_llm(tiny_qwen2_dir, enable_prefix_caching=False)))


# Each feature keeps the tokens of the plain fp8 run (all identical on this machine; >= 90% asserted, since
# a recomputed or chunked k can differ in its last fp32 bit and round to a neighbouring fp8 value).
def test_fp8_cache_with_preemption(tiny_qwen2_dir, fp8_reference):
    llm = _fp8_llm(tiny_qwen2_dir, num_gpu_blocks_override=17, enable_prefix_caching=False, max_model_len=64)
    got = _tokens(_greedy(llm))
    stats = llm.llm_engine.core.scheduler.get_stats()
    assert stats.num_preemptions > 0 and stats.kv_cache_usage == 0.0
    assert [len(t) for t in got] == [12] * 4
    assert _agreement(fp8_reference, got) >= 0.9


def test_fp8_cache_with_chunked_prefill(tiny_qwen2_dir, fp8_reference):
    got = _tokens(_greedy(_fp8_llm(tiny_qwen2_dir, max_num_batched_tokens=5, max_num_seqs=3)))
    assert _agreement(fp8_reference, got) >= 0.9


def test_fp8_cache_with_prefix_caching(tiny_qwen2_dir, fp8_reference):
    llm = _fp8_llm(tiny_qwen2_dir, enable_prefix_caching=True)
    first = _greedy(llm)
    again = _greedy(llm)  # every prompt's full blocks come from the fp8 cache this time
    assert [o.num_cached_tokens for o in again] == [0, 36, 16, 8]
    assert _agreement(fp8_reference, _tokens(first)) >= 0.9
    assert _agreement(fp8_reference, _tokens(again)) >= 0.9


def _add_tensors(path: str, extra: dict[str, torch.Tensor]) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors.update(extra)
    save_file(tensors, file, metadata={"format": "pt"})


def test_checkpoint_kv_scales_are_loaded(tmp_path):
    plain = str(tmp_path / "plain")
    scaled = str(tmp_path / "scaled")
    make_tiny_model("qwen2", plain)
    make_tiny_model("qwen2", scaled)
    _add_tensors(
        scaled,
        {
            # compressed-tensors style, one scale per layer
            "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
            "model.layers.0.self_attn.v_scale": torch.tensor(2.0),
            # AutoFP8 style, a per-kv-head scale (its max is used), and a query scale qwick ignores
            "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.125, 0.25]),
            "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([4.0]),
            "model.layers.1.self_attn.q_proj.output_scale": torch.tensor([3.0]),
            "model.layers.1.self_attn.prob_scale": torch.tensor(1.0),
        },
    )
    kw = dict(dtype="float32", num_gpu_blocks_override=128, block_size=4, max_model_len=256)
    fp8 = LLM(scaled, kv_cache_dtype="fp8", **kw)
    layers = _runner(fp8).model.attention_layers()
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.5, 2.0), (0.25, 4.0)]
    # Power-of-two scales only move e4m3's exponent: away from the clamp and the subnormals the stored
    # values round the same, so the tokens match the unscaled checkpoint's (measured: all identical).
    reference = _tokens(_greedy(LLM(plain, kv_cache_dtype="fp8", **kw)))
    assert _agreement(reference, _tokens(_greedy(fp8))) >= 0.9
    # A 16-bit cache ignores the scales: exactly the unscaled checkpoint's tokens.
    auto_plain = _tokens(_greedy(LLM(plain, **kw)))
    assert _tokens(_greedy(LLM(scaled, **kw))) == auto_plain


def test_deprecated_kv_scale_sets_both(tmp_path):
    path = str(tmp_path / "kv_scale")
    make_tiny_model("qwen2", path)
    _add_tensors(path, {"model.layers.1.self_attn.kv_scale": torch.tensor(0.75)})
    llm = LLM(path, dtype="float32", kv_cache_dtype="fp8", num_gpu_blocks_override=64, max_model_len=256)
    layers = _runner(llm).model.attention_layers()
    assert [(a.k_scale, a.v_scale) for a in layers] == [(1.0, 1.0), (0.75, 0.75)]
    assert len(_greedy(llm, PROMPTS[:1], 4)[0].outputs[0].token_ids) == 4


# ---- GPU -------------------------------------------------------------------------------------------------
def _needs_fp8_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")


@pytest.mark.gpu
def test_fp8_doubles_gpu_kv_capacity(tmp_path):
    """Sized from free memory (gpu_memory_utilization), an fp8 cache holds twice the blocks of a bf16 one."""
    _needs_fp8_gpu()
    path = str(tmp_path / "wide")
    # Wider than the shared tiny model so a 5% pool is ~100k blocks, not millions.
    make_tiny_model(
        "qwen2", path, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4
    )
    blocks, tokens = {}, {}
    for kv in ("auto", "fp8"):
        llm = LLM(
            path,
            dtype="bfloat16",
            kv_cache_dtype=kv,
            gpu_memory_utilization=0.05,
            max_model_len=512,
            enforce_eager=True,
        )
        blocks[kv] = _runner(llm).num_blocks
        tokens[kv] = llm.llm_engine.core.num_kv_tokens
        assert _runner(llm).model.attention_layers()[0].kv_cache.dtype == (
            FP8_KV_DTYPE if kv == "fp8" else torch.bfloat16
        )
        out = _greedy(llm, PROMPTS[:2], 8)
        assert all(len(o.outputs[0].token_ids) == 8 for o in out)
        # Free this pool before the next engine profiles memory (its peak counts whatever is still held).
        _runner(llm)._release_kv_cache()
        del llm, out
        gc.collect()
        torch.cuda.empty_cache()
    assert 1.95 <= blocks["fp8"] / blocks["auto"] <= 2.05, blocks
    assert 1.95 <= tokens["fp8"] / tokens["auto"] <= 2.05, tokens


@pytest.mark.gpu
@pytest.mark.parametrize(
    "arch,overrides", [("qwen2", dict(hidden_size=256)), ("qwen3", dict(head_dim=128, num_attention_heads=8))]
)
def test_fp8_triton_graphs_match_eager_and_reference(tmp_path, arch, overrides):
    """Triton backend, fp8 cache: CUDA-graph decode gives eager's tokens exactly (head dims 64 and 128,
    GQA 2:1 / 4:1, chunked prefill mixed with decodes, prefix-cache hits on the second pass), and the
    PyTorch reference backend on the same fp8 cache, reading Triton's sequences, ranks each of Triton's greedy
    tokens within 0.1 of its best logit."""
    _needs_fp8_gpu()
    path = str(tmp_path / arch)
    make_tiny_model(arch, path, **overrides)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 300) for _ in range(n)] for n in (3, 17, 40, 100, 5, 64)]

    def generate(backend: str, eager: bool, dtype: str = "bfloat16"):
        llm = LLM(
            path,
            dtype=dtype,
            kv_cache_dtype="fp8",
            attention_backend=backend,
            enforce_eager=eager,
            num_gpu_blocks_override=256,
            block_size=16,
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=48,
        )
        first = _greedy(llm, prompts, 24)
        again = _greedy(llm, prompts[::-1], 24)
        replays = _runner(llm).num_graph_replays
        del llm
        torch.cuda.empty_cache()
        return _tokens(first + again), replays

    graphs, replays = generate("triton", eager=False)
    eager, eager_replays = generate("triton", eager=True)
    assert replays > 0 and eager_replays == 0
    for i, (a, b) in enumerate(zip(eager, graphs)):
        assert a == b, f"request {i}: CUDA-graph tokens differ from eager"
    # Greedy tokens of a tiny random model part ways at near-ties, and an fp8 cache turns a one-ulp difference
    # upstream into a whole e4m3 step, so compare teacher-forced: the reference backend reads each
    # sequence Triton produced, and every token Triton chose must be (near) its argmax too.
    reference = LLM(
        path,
        dtype="bfloat16",
        kv_cache_dtype="fp8",
        attention_backend="torch",
        enforce_eager=True,
        num_gpu_blocks_override=256,
        block_size=16,
        max_model_len=256,
    )
    worst, spread = 0.0, 0.0
    for prompt, tokens in zip(prompts + prompts[::-1], graphs):  # both passes, the second after prefix hits
        logits = _logits(reference, prompt + tokens[:-1])[len(prompt) - 1 :]
        chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        worst = max(worst, (logits.max(-1).values - chosen).max().item())
        spread = max(spread, logits.std(-1).max().item())
    print(f"reference's best logit minus Triton's token's, at most: {worst:.4f} (logit std {spread:.3f})")
    assert worst < 0.1
