"""The fp8 KV cache in the PyTorch reference backend (CPU): what is stored, and what attention costs.

Stored values: `quantize_kv(x, s) = (x * (1 / s)).clamp(-448, 448).to(float8_e4m3fn)`, read back as
`fp8.to(dtype) * s`. e4m3 keeps 4 significant bits: a stored value is within 2**-4 (6.25%) of the true
one, relative (half of that with round-to-nearest, before the 448 clamp).

Attention with an fp8 cache against the same step with a bf16 cache (random q, k, v; q ~ N(0, 4) so the
softmax is peaked, as in the Triton tests), measured on this machine over the 12 cases below:
max |fp8 - bf16| 0.16-0.24 (a row attending one or two keys returns a quantized v: up to 2**-4 of
|v| ~ 3.5), mean |fp8 - bf16| 0.013-0.014, relative RMS error 0.043-0.046 (outputs |o| ~ 0.3 on average).
The bounds asserted are about 1.5-2x those: max 0.5, mean 0.025, relative RMS 0.07. For scale, a bf16 cache
itself is 0.02 (max) from fp32 on these inputs.
"""

from __future__ import annotations

import random

import pytest
import torch

from qwick.layers.attention.backend import (
    FP8_KV_DTYPE,
    AttentionRow,
    is_fp8_kv,
    kv_cache_torch_dtype,
    quantize_kv,
)
from qwick.layers.attention.torch_ref import TorchAttentionBackend

CPU = torch.device("cpu")
MAX_ERR, MEAN_ERR, REL_RMS = 0.5, 0.025, 0.07


def _make_rows(specs, block_size, rng):
    """specs: (context_len, query_len) per row -> rows with shuffled, disjoint block tables."""
    need = [(c + q + block_size - 1) // block_size for c, q in specs]
    ids = list(range(1, sum(need) + 3))  # block 0 is the null block
    rng.shuffle(ids)
    rows, at = [], 0
    for (c, q), n in zip(specs, need):
        rows.append(AttentionRow(c, q, ids[at : at + n]))
        at += n
    return rows, len(ids) + 1


def test_kv_cache_torch_dtype():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("auto", torch.float32) == torch.float32
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == FP8_KV_DTYPE == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float16) == FP8_KV_DTYPE
    assert is_fp8_kv(FP8_KV_DTYPE) and not is_fp8_kv(torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_torch_dtype("int8", torch.bfloat16)


def test_quantize_kv_scales_rounds_and_clamps():
    x = torch.tensor([0.0, 1.0, -2.5, 3.0, 250.0, 1000.0, -1e6, 0.001], dtype=torch.bfloat16)
    q = quantize_kv(x, 1.0)
    assert q.dtype == FP8_KV_DTYPE
    # 250 -> 256 (e4m3 steps are 16 in [128, 256)); beyond 448 saturates (no inf/NaN in e4m3fn).
    expected = [0.0, 1.0, -2.5, 3.0, 256.0, 448.0, -448.0, 2**-9]  # 0.001: the nearest subnormal
    assert q.float().tolist() == expected
    # With a scale, x / scale is stored: 1000 / 4 = 250 -> 256, read back as 256 * 4.
    q4 = quantize_kv(x, 4.0)
    assert q4.float().tolist()[5] == 256.0
    assert (q4.float() * 4.0)[5].item() == 1024.0
    # The multiply by the reciprocal equals the division for power-of-two scales, and is within one
    # fp8 rounding of it otherwise.
    y = torch.randn(10_000) * 30
    for scale in (0.5, 2.0, 8.0):
        assert torch.equal(
            quantize_kv(y, scale).view(torch.uint8),
            (y / scale).clamp(-448, 448).to(FP8_KV_DTYPE).view(torch.uint8),
        )
    z = quantize_kv(y, 0.37).float() * 0.37
    assert ((z - y).abs() <= y.abs() * 2**-4 + 1e-3).all()


def _step(specs, *, head_dim, group, num_kv_heads, k_scale=1.0, v_scale=1.0, block_size=16, seed=0):
    """One step of attention with a bf16 cache and with an fp8 cache over the same (random) context."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows, num_blocks = _make_rows(specs, block_size, rng)
    tokens = sum(q for _, q in specs)
    context = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    q = (2.0 * torch.randn(tokens, num_kv_heads * group, head_dim)).to(torch.bfloat16)
    k = torch.randn(tokens, num_kv_heads, head_dim).to(torch.bfloat16)
    v = torch.randn(tokens, num_kv_heads, head_dim).to(torch.bfloat16)
    backend = TorchAttentionBackend(block_size, CPU)

    def run(cache):
        md = backend.build_metadata(rows)
        out = backend.forward(
            q, k, v, cache, md, scale=head_dim**-0.5, sliding_window=None, k_scale=k_scale, v_scale=v_scale
        )
        return out, md

    cache_16 = context.to(torch.bfloat16)
    out_16, _ = run(cache_16)
    cache_8 = torch.stack([quantize_kv(context[0], k_scale), quantize_kv(context[1], v_scale)])
    out_8, md = run(cache_8)
    return out_16, out_8, cache_8, md, (k, v)


CASES = [(128, 7, 2), (128, 4, 8), (128, 1, 4), (64, 7, 2), (64, 4, 2), (64, 1, 4)]
SPECS = [(c, 1) for c in (0, 1, 15, 16, 17, 100, 500)] + [(0, 40), (33, 20), (200, 70)]


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 1.7)], ids=["unit-scales", "scales"])
@pytest.mark.parametrize("head_dim,group,num_kv_heads", CASES, ids=[f"D{d}-G{g}-kv{h}" for d, g, h in CASES])
def test_fp8_cache_close_to_bf16_cache(head_dim, group, num_kv_heads, k_scale, v_scale):
    out_16, out_8, cache_8, md, (k, v) = _step(
        SPECS, head_dim=head_dim, group=group, num_kv_heads=num_kv_heads, k_scale=k_scale, v_scale=v_scale
    )
    assert out_8.dtype == torch.bfloat16 and out_8.shape == out_16.shape
    assert torch.isfinite(out_8.float()).all()
    # The new tokens' k/v landed in their slots as quantize_kv bytes; the cache stayed fp8.
    assert cache_8.dtype == FP8_KV_DTYPE
    flat = cache_8.view(torch.uint8).view(2, -1, num_kv_heads, head_dim)
    assert torch.equal(flat[0, md.slot_mapping], quantize_kv(k, k_scale).view(torch.uint8))
    assert torch.equal(flat[1, md.slot_mapping], quantize_kv(v, v_scale).view(torch.uint8))
    err = (out_8.float() - out_16.float()).abs()
    rel_rms = (err.square().mean() / out_16.float().square().mean()).sqrt().item()
    assert err.max().item() < MAX_ERR, err.max().item()
    assert err.mean().item() < MEAN_ERR, err.mean().item()
    assert rel_rms < REL_RMS, rel_rms


def test_scales_keep_large_values_in_range():
    """k/v beyond e4m3's 448 clip with unit scales; a scale that brings them in range restores them."""
    head_dim, group, num_kv_heads = 64, 4, 2
    specs = [(50, 1), (0, 30)]
    rng = random.Random(1)
    torch.manual_seed(1)
    rows, num_blocks = _make_rows(specs, 16, rng)
    big = 1000.0
    context = big * torch.randn(2, num_blocks, 16, num_kv_heads, head_dim)
    q = (torch.randn(31, num_kv_heads * group, head_dim) / big).to(torch.bfloat16)
    k = (big * torch.randn(31, num_kv_heads, head_dim)).to(torch.bfloat16)
    v = (big * torch.randn(31, num_kv_heads, head_dim)).to(torch.bfloat16)
    backend = TorchAttentionBackend(16, CPU)

    def run(cache, scale):
        md = backend.build_metadata(rows)
        kw = dict(scale=head_dim**-0.5, sliding_window=None, k_scale=scale, v_scale=scale)
        return backend.forward(q, k, v, cache, md, **kw).float()

    ref = run(context.to(torch.bfloat16), 1.0)
    clipped = run(quantize_kv(context, 1.0), 1.0)
    scaled = run(quantize_kv(context, 16.0), 16.0)
    err_scaled = (scaled - ref).abs().max().item() / big
    err_clipped = (clipped - ref).abs().max().item() / big
    # Measured: 0.12 of `big` with scale 16, 2.4 clipped.
    assert err_scaled < 0.3 and err_clipped > 1.0, (err_scaled, err_clipped)


def test_scales_are_ignored_by_16_bit_caches():
    specs = [(20, 1), (0, 9)]
    rows, num_blocks = _make_rows(specs, 16, random.Random(2))
    torch.manual_seed(2)
    q = torch.randn(10, 4, 32).to(torch.bfloat16)
    k = torch.randn(10, 2, 32).to(torch.bfloat16)
    v = torch.randn(10, 2, 32).to(torch.bfloat16)
    context = torch.randn(2, num_blocks, 16, 2, 32).to(torch.bfloat16)
    backend = TorchAttentionBackend(16, CPU)
    outs, caches = [], []
    for s in (1.0, 3.0):
        cache = context.clone()
        md = backend.build_metadata(rows)
        outs.append(backend.forward(q, k, v, cache, md, scale=0.2, sliding_window=None, k_scale=s, v_scale=s))
        caches.append(cache)
    assert torch.equal(outs[0], outs[1]) and torch.equal(caches[0], caches[1])


def test_fp8_cache_with_fp32_queries_and_sliding_window():
    """fp32 models (the CPU default without native bf16) and sliding-window layers read fp8 caches too."""
    specs = [(c, 1) for c in (3, 40, 300)] + [(10, 25)]
    rows, num_blocks = _make_rows(specs, 8, random.Random(3))
    torch.manual_seed(3)
    tokens = sum(q for _, q in specs)
    q = torch.randn(tokens, 8, 64)
    k = torch.randn(tokens, 2, 64)
    v = torch.randn(tokens, 2, 64)
    context = torch.randn(2, num_blocks, 8, 2, 64)
    backend = TorchAttentionBackend(8, CPU)
    for window in (None, 16):
        kw = dict(scale=0.125, sliding_window=window)
        ref = backend.forward(q, k, v, context.clone(), backend.build_metadata(rows), **kw)
        got = backend.forward(q, k, v, quantize_kv(context, 1.0), backend.build_metadata(rows), **kw)
        assert got.dtype == torch.float32
        err = (got - ref).abs()
        assert err.max().item() < MAX_ERR and err.mean().item() < MEAN_ERR, (window, err.max(), err.mean())
