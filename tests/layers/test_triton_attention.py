"""The Triton attention backend against the PyTorch reference (the oracle), on the GPU.

Every case runs the same step through both backends. The KV-cache writes must be bit-identical. Outputs
are compared against the reference run in fp32 on the same (low-precision) inputs, with tolerances:

- bf16: atol = rtol = 2e-2. bf16 keeps 8 significant bits (a rounding step is 2**-8 ~ 3.9e-3 relative):
  the output is rounded once (<= 3.9e-3 of |o| <= max|v|), and P is rounded to bf16 before P@V as in
  flash attention (a relative 3.9e-3 per weight, averaging out over keys). 2e-2 is ~5 rounding steps at
  |o| ~ 1, and the reference backend in bf16 shows the same size of error against fp32 (logged too).
- fp16: atol = rtol = 4e-3 (11 significant bits, 2**-11 ~ 4.9e-4 per rounding; ~8 steps).
- fp32: atol = rtol = 1e-4 (IEEE dot products; only the summation order differs).

Set QWICK_ATTN_ERR_LOG=path to append each case's max error (and the reference's own low-precision
error) there. Without a GPU, TRITON_INTERPRET=1 runs them on the CPU through Triton's interpreter (slow;
bf16 cases run in fp16 there, since the interpreter mishandles bf16 dots; the engine test is skipped).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from qwick.layers.attention.backend import (
    FP8_KV_DTYPE,
    AttentionRow,
    kv_layout_of,
    quantize_kv,
    to_kv_layout,
)
from qwick.layers.attention.torch_ref import TorchAttentionBackend
from tests.triton_utils import INTERPRET, triton_device

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}
FP8_MIN_NORMAL = 2.0**-6


def _lowp(dtype: torch.dtype) -> torch.dtype:
    """Triton's CPU interpreter mishandles bf16 dot products: there, bf16 cases run in fp16."""
    return torch.float16 if INTERPRET and dtype == torch.bfloat16 else dtype


def _backend(
    block_size: int,
    device: torch.device,
    longest_first: bool | None = None,
    fixed_num_splits: int | None = None,
    **tunables,
):
    """A Triton backend; `longest_first` None keeps the default decode row order; `tunables` set the
    backend's attributes of those names."""
    from qwick.layers.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(block_size, device, fixed_num_splits)
    if longest_first is not None:
        backend.longest_first = longest_first
    for name, value in tunables.items():
        assert hasattr(backend, name), name
        setattr(backend, name, value)
    return backend


def _log(case: str, err: float, ref_err: float) -> None:
    path = os.environ.get("QWICK_ATTN_ERR_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{case}\tmax_err={err:.3e}\tref_lowp_err={ref_err:.3e}\n")


def _make_rows(specs, block_size, rng, extra_blocks=3):
    """specs: (context_len, query_len) per row -> rows with shuffled, disjoint block tables."""
    need = [(c + q + block_size - 1) // block_size for c, q in specs]
    ids = list(range(1, sum(need) + extra_blocks + 1))  # block 0 is the null block
    rng.shuffle(ids)
    rows, at = [], 0
    for (c, q), n in zip(specs, need):
        rows.append(AttentionRow(c, q, ids[at : at + n]))
        at += n
    return rows, len(ids) + 1


def kv_values(shape, device, scale: float = 1.0) -> torch.Tensor:
    """N(0, 1) * scale in fp32, for an fp8 cache. Under the interpreter, whose fp32 -> fp8 conversion does
    not round correctly, snapped to normal e4m3 values first (with power-of-two scales, see `fp8_scales`),
    so that quantizing them has nothing to round."""
    x = torch.randn(shape, device=device)
    if INTERPRET:
        x = x.to(FP8_KV_DTYPE).float()
        x = torch.where(x.abs() < FP8_MIN_NORMAL, torch.zeros_like(x), x)
    return x * scale


def fp8_scales(k_scale: float, v_scale: float) -> tuple[float, float]:
    """Under the interpreter, the nearest powers of two (so `x / scale` of an exact input stays exact)."""
    if not INTERPRET:
        return k_scale, v_scale
    p2 = lambda s: 2.0 ** round(torch.log2(torch.tensor(s)).item())  # noqa: E731
    return p2(k_scale), p2(v_scale)


def run_case(
    specs,
    *,
    num_kv_heads=2,
    group=7,
    head_dim=128,
    dtype=torch.bfloat16,
    block_size=16,
    sliding_window=None,
    seed=0,
    backend_kwargs=None,
    q_scale=2.0,
    kv_fp8=False,
    k_scale=1.0,
    v_scale=1.0,
    kv_layout="NHD",
):
    """One step through both backends: the cache writes must be byte-identical, and the Triton output
    within `TOL` of the reference's in fp32. With `kv_fp8` the cache is float8 e4m3 with per-layer scales,
    and the fp32 oracle reads the same fp8 pages (exact attention over the quantized keys and values).
    `kv_layout`: how the Triton backend's copy of the cache is stored (the reference's is NHD)."""
    device = triton_device()
    dtype = _lowp(dtype)
    if kv_fp8:
        k_scale, v_scale = fp8_scales(k_scale, v_scale)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows, num_blocks = _make_rows(specs, block_size, rng)
    num_heads = num_kv_heads * group
    tokens = sum(q for _, q in specs)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    q = (q_scale * torch.randn(tokens, num_heads, head_dim, device=device)).to(dtype)
    if kv_fp8:
        kv_cache = torch.stack(
            [
                quantize_kv(kv_values(shape, device, k_scale), k_scale),
                quantize_kv(kv_values(shape, device, v_scale), v_scale),
            ]
        )
        k = kv_values((tokens, num_kv_heads, head_dim), device, k_scale).to(dtype)
        v = kv_values((tokens, num_kv_heads, head_dim), device, v_scale).to(dtype)
    else:
        kv_cache = torch.randn(2, *shape, device=device).to(dtype)
        k = torch.randn(tokens, num_kv_heads, head_dim, device=device).to(dtype)
        v = torch.randn(tokens, num_kv_heads, head_dim, device=device).to(dtype)
    kw = dict(scale=head_dim**-0.5, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale)

    tri = _backend(block_size, device, **(backend_kwargs or {}))
    cache_t = to_kv_layout(kv_cache, kv_layout)
    assert kv_layout_of(cache_t) == kv_layout
    out_t = tri.forward(q, k, v, cache_t, tri.build_metadata(rows), **kw)

    ref = TorchAttentionBackend(block_size, device)
    cache_r = kv_cache.clone()
    out_r = ref.forward(q, k, v, cache_r, ref.build_metadata(rows), **kw)
    cache_32 = kv_cache.clone() if kv_fp8 else kv_cache.float()
    out_32 = ref.forward(q.float(), k.float(), v.float(), cache_32, ref.build_metadata(rows), **kw)

    assert out_t.shape == q.shape and out_t.dtype == q.dtype and cache_t.dtype == kv_cache.dtype
    cache_t = cache_t.contiguous()  # compared value by value whatever the layout
    assert torch.equal(cache_t.view(torch.uint8), cache_r.view(torch.uint8)), "KV-cache write differs"
    if kv_fp8:
        assert torch.equal(cache_32.view(torch.uint8), cache_r.view(torch.uint8))
    assert torch.isfinite(out_t).all() and torch.isfinite(out_r).all()
    err = (out_t.float() - out_32).abs().max().item()
    ref_err = (out_r.float() - out_32).abs().max().item()
    name = (
        f"{'fp8-kv ' if kv_fp8 else ''}{str(dtype)[6:]} D={head_dim} G={group} kv={num_kv_heads} "
        f"bs={block_size} win={sliding_window} scales={k_scale},{v_scale} "
        f"rows={specs[:6]}{'...' if len(specs) > 6 else ''}"
    )
    _log(name, err, ref_err)
    tol = TOL[dtype]
    torch.testing.assert_close(out_t.float(), out_32, atol=tol, rtol=tol, msg=lambda m: f"{name}\n{m}")
    return tri


# (head_dim, group, num_kv_heads, dtype): every GQA ratio of the bench shapes, both head dims, both
# 16-bit types. 7:1 is qwen2.5-0.5b/7b, 5:1 qwen2.5-14b, 4:1 qwen3-8b.
HEAD_CONFIGS = [
    (128, 7, 4, torch.bfloat16),
    (128, 5, 8, torch.bfloat16),
    (128, 4, 8, torch.float16),
    (128, 1, 4, torch.bfloat16),
    (64, 7, 2, torch.bfloat16),
    (64, 5, 2, torch.float16),
    (64, 4, 2, torch.bfloat16),
    (64, 1, 4, torch.float16),
]
HEAD_IDS = [f"D{d}-G{g}-kv{h}-{str(t)[6:]}" for d, g, h, t in HEAD_CONFIGS]
INTERPRETED = {"D128-G7-kv4-bfloat16", "D64-G5-kv2-float16"}  # the configs the CPU CI also interprets


def head_params() -> list:
    """HEAD_CONFIGS as test parameters, the INTERPRETED ones marked `interpret`."""
    return [
        pytest.param(*c, id=i, marks=[pytest.mark.interpret] if i in INTERPRETED else [])
        for c, i in zip(HEAD_CONFIGS, HEAD_IDS)
    ]


# Decode contexts around block (16) and tile (64) boundaries, plus a few longer ones.
DECODE_CONTEXTS = [0, 1, 14, 15, 16, 17, 63, 64, 65, 127, 200, 511, 1000, 2047, 4100]
# (cached prefix, new tokens): no prefix, partial block, exact blocks, several blocks, tile edges.
EXTEND_SPECS = [
    (0, 2),
    (0, 16),
    (0, 17),
    (0, 64),
    (0, 65),
    (0, 300),
    (5, 7),
    (16, 16),
    (15, 49),
    (48, 100),
    (100, 3),
    (1000, 129),
    (2000, 64),
]


@pytest.mark.parametrize("head_dim,group,num_kv_heads,dtype", head_params())
def test_decode_rows(head_dim, group, num_kv_heads, dtype):
    specs = [(c, 1) for c in DECODE_CONTEXTS]
    run_case(specs, head_dim=head_dim, group=group, num_kv_heads=num_kv_heads, dtype=dtype)


@pytest.mark.parametrize("head_dim,group,num_kv_heads,dtype", HEAD_CONFIGS[::4], ids=HEAD_IDS[::4])
def test_decode_rows_at_large_batch(head_dim, group, num_kv_heads, dtype):
    """75 decode rows: at 64 rows and more the decode kernel runs its large-batch tiles."""
    specs = [(c + i, 1) for i in range(5) for c in DECODE_CONTEXTS]
    tri = run_case(specs, head_dim=head_dim, group=group, num_kv_heads=num_kv_heads, dtype=dtype)
    assert tri._decode_cfg(head_dim, 2, False, len(specs)) != tri._decode_cfg(head_dim, 2, False, 1)


@pytest.mark.interpret
@pytest.mark.parametrize("longest_first", [True, False])
@pytest.mark.parametrize("head_dim,group,num_kv_heads,dtype", HEAD_CONFIGS[::4], ids=HEAD_IDS[::4])
def test_decode_row_order(head_dim, group, num_kv_heads, dtype, longest_first):
    """Decode rows beside prefill rows, launched longest context first (`longest_first`, the default) or
    in row order: the same outputs, and the plan lists the decode rows in that order."""
    specs = [(30, 1), (0, 40), (700, 1), (130, 1), (33, 20), (0, 1), (64, 1), (2000, 1)]
    tri = run_case(
        specs, head_dim=head_dim, group=group, num_kv_heads=num_kv_heads, dtype=dtype,
        backend_kwargs={"longest_first": longest_first},
    )  # fmt: skip
    rows, _ = _make_rows(specs, 16, random.Random(0))
    order = tri._plan(tri.build_metadata(rows)).decode_rows.tolist()
    assert order == ([7, 2, 3, 6, 0, 5] if longest_first else [0, 2, 3, 5, 6, 7])


@pytest.mark.interpret
def test_longest_first_is_the_default():
    from qwick.layers.attention.triton_backend import TritonAttentionBackend

    assert TritonAttentionBackend(16, "cpu").longest_first


@pytest.mark.parametrize("head_dim,group,num_kv_heads,dtype", head_params())
def test_extend_rows(head_dim, group, num_kv_heads, dtype):
    run_case(EXTEND_SPECS, head_dim=head_dim, group=group, num_kv_heads=num_kv_heads, dtype=dtype)


@pytest.mark.interpret
@pytest.mark.parametrize("block_size", [16, 4, 32])
@pytest.mark.parametrize("head_dim,group,num_kv_heads,dtype", HEAD_CONFIGS[::3], ids=HEAD_IDS[::3])
def test_mixed_decode_and_extend(block_size, head_dim, group, num_kv_heads, dtype):
    specs = [(30, 1), (0, 40), (7, 1), (130, 1), (33, 20), (0, 1), (64, 1), (500, 70), (1, 1)]
    run_case(
        specs, head_dim=head_dim, group=group, num_kv_heads=num_kv_heads, dtype=dtype, block_size=block_size
    )


@pytest.mark.interpret
@pytest.mark.parametrize("window", [1, 16, 50, 128, 4096])
@pytest.mark.parametrize("head_dim,group,num_kv_heads,dtype", HEAD_CONFIGS[:1] + HEAD_CONFIGS[5:6])
def test_sliding_window(window, head_dim, group, num_kv_heads, dtype):
    specs = [(c, 1) for c in (0, 10, 100, 1000)] + [(0, 200), (90, 40), (300, 130), (1500, 70)]
    run_case(
        specs,
        head_dim=head_dim,
        group=group,
        num_kv_heads=num_kv_heads,
        dtype=dtype,
        sliding_window=window,
    )


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_and_small_head_dims(dtype):
    # fp32 through IEEE dots; head_dim 16/32 (the tiny test models) are padded to tl.dot's minimum.
    for head_dim in (128, 64, 32, 16):
        specs = [(0, 19), (40, 1), (3, 5), (129, 1), (200, 33)]
        run_case(specs, head_dim=head_dim, group=2, num_kv_heads=2, dtype=dtype, block_size=4)
    # Pages longer than fp32's 16-key tiles: a key's place in its page then changes from tile to tile.
    run_case([(0, 50), (70, 1), (33, 40)], head_dim=64, group=2, num_kv_heads=2, dtype=dtype, block_size=32)


@pytest.mark.parametrize("head_dim,group,num_kv_heads,dtype", HEAD_CONFIGS[:3], ids=HEAD_IDS[:3])
def test_long_prompts_beside_decode_rows(head_dim, group, num_kv_heads, dtype):
    """Whole prompts of 600 and 2048 tokens (many query tiles) in one step with decode rows."""
    specs = [(0, 600), (70, 1), (0, 2048), (5, 1)]
    run_case(specs, head_dim=head_dim, group=group, num_kv_heads=num_kv_heads, dtype=dtype)


@pytest.mark.parametrize("head_dim,group,num_kv_heads,dtype", HEAD_CONFIGS[:3], ids=HEAD_IDS[:3])
def test_long_prefill_chunks(head_dim, group, num_kv_heads, dtype):
    """Chunks of `long_prefill_queries` queries or more (the deeper-pipelined launch), behind a cached
    prefix and from scratch, beside a short prompt and a decode row."""
    specs = [(3000, 4100), (0, 4096), (0, 50), (900, 1)]
    tri = run_case(specs, head_dim=head_dim, group=group, num_kv_heads=num_kv_heads, dtype=dtype)
    assert tri._extend_cfg(head_dim, 2, 4100)["num_stages"] == 3


@pytest.mark.parametrize("context", [8192, 32768])
@pytest.mark.parametrize("batch", [1, 3])
def test_long_context_decode_split_kv(context, batch):
    specs = [(context - 37 * i, 1) for i in range(batch)]
    tri = run_case(specs, head_dim=128, group=7, num_kv_heads=4, dtype=torch.bfloat16, seed=context + batch)
    assert tri.num_splits(batch, 4, context) > 1  # the split-KV path and its reduction ran


@pytest.mark.interpret
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64])
def test_fixed_split_counts(splits):
    # Fixed counts (as a CUDA-graph runner would set): more splits than tiles leaves some splits empty.
    specs = [(c, 1) for c in (0, 5, 63, 64, 300, 3000)] + [(10, 30)]
    run_case(specs, backend_kwargs={"fixed_num_splits": splits}, group=5, num_kv_heads=2)


# Head-major pages (`kv_layout` "HND"): the same kernels through the cache's strides.
HND_SPECS = [(c, 1) for c in (0, 15, 16, 17, 130, 1000)] + [(0, 40), (33, 20), (500, 70)]


@pytest.mark.parametrize("head_dim,group,num_kv_heads,dtype", head_params())
@pytest.mark.parametrize("block_size", [16, 4])
def test_head_major_cache_layout(block_size, head_dim, group, num_kv_heads, dtype):
    run_case(
        HND_SPECS,
        head_dim=head_dim,
        group=group,
        num_kv_heads=num_kv_heads,
        dtype=dtype,
        block_size=block_size,
        kv_layout="HND",
    )


@pytest.mark.interpret
def test_head_major_cache_layout_fp8_and_split_kv():
    specs = [(c, 1) for c in (3, 300, 3000)] + [(20, 30)]
    run_case(specs, kv_layout="HND", kv_fp8=True, group=5, num_kv_heads=2, k_scale=0.5, v_scale=2.0)
    run_case(specs, kv_layout="HND", backend_kwargs={"fixed_num_splits": 7}, group=7, num_kv_heads=4)


def test_chunked_prefill_matches_one_shot():
    """A prompt fed in chunks (each chunk attends the cache the previous ones wrote) equals one shot."""
    device = triton_device()
    torch.manual_seed(1)
    bs, hkv, g, d, length = 16, 2, 4, 128, 333
    dtype = _lowp(torch.bfloat16)
    table = list(range(1, (length + bs - 1) // bs + 1))[::-1]
    q = torch.randn(length, hkv * g, d, device=device).to(dtype)
    k = torch.randn(length, hkv, d, device=device).to(dtype)
    v = torch.randn(length, hkv, d, device=device).to(dtype)
    num_blocks = len(table) + 1
    ref = TorchAttentionBackend(bs, device)
    cache_r = torch.zeros(2, num_blocks, bs, hkv, d, device=device)
    rows = [AttentionRow(0, length, table)]
    expected = ref.forward(
        q.float(), k.float(), v.float(), cache_r, ref.build_metadata(rows), scale=d**-0.5, sliding_window=None
    )
    tri = _backend(bs, device)
    for chunk in (1, 7, 16, 64, 100):
        cache = torch.zeros(2, num_blocks, bs, hkv, d, device=device, dtype=dtype)
        outs, start = [], 0
        while start < length:
            n = min(chunk, length - start)
            md = tri.build_metadata([AttentionRow(start, n, table)])
            sl = slice(start, start + n)
            outs.append(tri.forward(q[sl], k[sl], v[sl], cache, md, scale=d**-0.5, sliding_window=None))
            start += n
        got = torch.cat(outs).float()
        tol = TOL[dtype]
        msg = lambda m, c=chunk: f"chunk {c}: {m}"
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol, msg=msg)
        assert torch.equal(cache.float(), cache_r.to(dtype).float())


@pytest.mark.interpret
def test_negative_slots_are_skipped():
    device = triton_device()
    bs, hkv, d = 16, 2, 64
    tri = _backend(bs, device)
    rows = [AttentionRow(0, 5, [1]), AttentionRow(3, 1, [2])]
    md = tri.build_metadata(rows)
    md.slot_mapping[1] = -1  # a padding token: its k/v must not land anywhere
    cache = torch.zeros(2, 3, bs, hkv, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(6, hkv, d, device=device).to(torch.bfloat16)
    v = torch.randn(6, hkv, d, device=device).to(torch.bfloat16)
    tri.write_kv(k, v, cache, md.slot_mapping)
    assert torch.equal(cache[0, 1, 0], k[0]) and torch.equal(cache[1, 1, 4], v[4])
    assert torch.count_nonzero(cache[:, 1, 1]) == 0  # slot of token 1 untouched
    assert torch.equal(cache[0, 2, 3], k[5])
    assert torch.count_nonzero(cache[:, 0]) == 0  # null block untouched
    assert torch.count_nonzero(cache) == 2 * 5 * hkv * d


@pytest.mark.interpret
@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,dtype",
    [(28, 4, 128, torch.bfloat16), (10, 2, 64, torch.float16), (4, 4, 64, torch.float32)],
)
def test_rope_fused_with_the_kv_write(heads, kv_heads, head_dim, dtype, kv_layout, kv_fp8):
    """`write_kv_rope` gives what `rotary_in_place` then `write_kv` give: q rotated in place, the same cache
    bytes, padding slots (< 0) unwritten; the k input is left unrotated. The model's q / k / v are views of
    the packed QKV output, as here."""
    from qwick.kernels.elementwise import rotary_in_place
    from qwick.layers.rotary import RopeStep

    device = triton_device()
    dtype = _lowp(dtype)
    block_size, num_blocks, max_len = 16, 6, 4096
    positions = torch.tensor([0, 1, 17, 511, 4000, 95], device=device)
    slots = torch.tensor([16, 17, 33, -1, 60, 95], device=device)
    tokens = len(positions)
    inv = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    emb = torch.arange(max_len, dtype=torch.float)[:, None] * inv[None, :]
    emb = torch.cat((emb, emb), dim=-1)
    rope = RopeStep(positions, emb.cos().to(device), emb.sin().to(device))
    k_scale, v_scale = (0.5, 2.0) if kv_fp8 else (1.0, 1.0)
    cache_dtype = FP8_KV_DTYPE if kv_fp8 else dtype
    empty = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, device=device, dtype=cache_dtype)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

    def views(qkv):
        q, k, v = qkv.split(sizes, dim=-1)
        return (x.view(tokens, -1, head_dim) for x in (q, k, v))

    qkv = torch.randn(tokens, sum(sizes), device=device).to(dtype)
    qkv_ref = qkv.clone()
    tri = _backend(block_size, device)
    tri.fuse_rope = True  # (`FUSE_ROPE`, the default)
    q, k, v = views(qkv)
    assert tri.fuses_rope(q, k, v, rope)
    cache = to_kv_layout(empty, kv_layout)
    tri.write_kv_rope(q, k, v, cache, slots, rope, k_scale, v_scale)

    q_ref, k_ref, v_ref = views(qkv_ref)
    rotary_in_place(q_ref, k_ref, positions, rope.cos_cache, rope.sin_cache)
    cache_ref = to_kv_layout(empty, kv_layout)
    tri.write_kv(k_ref, v_ref, cache_ref, slots, k_scale, v_scale)

    # The same bits: both kernels round the rotation's products in PTX the compiler cannot fuse into the
    # sum (`round_to`; before it, they came out a unit apart on the H200). In fp32, nothing is rounded
    # and the compiler may contract either product into an FMA: one unit at the scale of the values.
    def same(a: torch.Tensor, b: torch.Tensor, storage: torch.dtype) -> None:
        if INTERPRET or dtype != torch.float32:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        else:
            ulp = torch.finfo(storage).eps
            scale = b.float().abs().max().item()
            torch.testing.assert_close(a.float(), b.float(), rtol=ulp, atol=ulp * scale)

    same(q.contiguous(), q_ref.contiguous(), dtype)
    assert not torch.equal(k, k_ref) and torch.equal(v, v_ref)  # k as it came: rotated only in the cache
    same(cache.contiguous(), cache_ref.contiguous(), cache_dtype)
    cache = cache.contiguous().view(torch.uint8)
    written = cache.view(2, num_blocks * block_size, -1).any(-1).any(0).nonzero().flatten().tolist()
    assert written == sorted(s for s in slots.tolist() if s >= 0)
    # The PyTorch path's tables (gathered on the host) are not the kernel's: not fused; nor when off.
    assert not tri.fuses_rope(q, k, v, RopeStep(positions, rope.cos_cache, rope.sin_cache, q, q))
    tri.fuse_rope = False
    assert not tri.fuses_rope(q, k, v, rope)


def test_decode_step_replays_in_a_cuda_graph():
    """The decode path has no host sync and a static grid (fixed splits): capture once, then replay with
    new inputs and metadata copied into the captured tensors, as a CUDA-graph runner does."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda")
    bs, hkv, g, d = 16, 4, 7, 128
    rng = random.Random(3)
    rows, num_blocks = _make_rows([(c, 1) for c in (100, 1000, 17, 3000)], bs, rng, extra_blocks=0)
    rows = [AttentionRow(r.start_pos, 1, r.block_table + [num_blocks + i]) for i, r in enumerate(rows)]
    cache = torch.randn(2, num_blocks + 4, bs, hkv, d, device=device).to(torch.bfloat16)
    q = torch.randn(4, hkv * g, d, device=device).to(torch.bfloat16)
    k = torch.randn(4, hkv, d, device=device).to(torch.bfloat16)
    v = torch.randn(4, hkv, d, device=device).to(torch.bfloat16)
    tri = _backend(bs, device, fixed_num_splits=16)
    md = tri.build_metadata(rows)
    tri.forward(q, k, v, cache, md, scale=d**-0.5, sliding_window=None)  # compile, allocate scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph = tri.forward(q, k, v, cache, md, scale=d**-0.5, sliding_window=None)
    for step in range(1, 4):
        md_new = tri.build_metadata(_advance(rows, step))
        assert md_new.block_tables.shape == md.block_tables.shape
        for name in ("slot_mapping", "seq_lens", "block_tables", "query_start_loc"):
            getattr(md, name).copy_(getattr(md_new, name))
        for t in (q, k, v):
            t.copy_(torch.randn_like(t, dtype=torch.float32))
        graph.replay()
        eager = tri.forward(q, k, v, cache, md_new, scale=d**-0.5, sliding_window=None)
        assert torch.equal(out_graph, eager), f"step {step}"
        ref = TorchAttentionBackend(bs, device)
        expected = ref.forward(
            q.float(), k.float(), v.float(), cache.float(), ref.build_metadata(_advance(rows, step)),
            scale=d**-0.5, sliding_window=None,
        )  # fmt: skip
        torch.testing.assert_close(out_graph.float(), expected, atol=2e-2, rtol=2e-2)


def _advance(rows, step):
    return [AttentionRow(r.start_pos + step, 1, r.block_table) for r in rows]


# ---- the whole engine: greedy tokens equal with either backend -------------------------------------------
E2E_MODELS = [
    ("qwen2", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2), 16),  # head_dim 64
    ("qwen3", dict(head_dim=128, num_attention_heads=8, num_key_value_heads=2), 4),
]


@pytest.mark.parametrize("fuse_rope", [False, True], ids=["rope_apart", "rope_fused"])
@pytest.mark.parametrize("arch,overrides,block_size", E2E_MODELS, ids=[m[0] for m in E2E_MODELS])
def test_llm_greedy_equal_with_triton_backend(tmp_path, arch, overrides, block_size, fuse_rope, monkeypatch):
    """`fuse_rope`: RoPE applied by the Triton backend's KV write (`FUSE_ROPE`)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from qwick import LLM, SamplingParams
    from qwick.layers.attention import triton_backend
    from tests.utils import make_tiny_model

    monkeypatch.setattr(triton_backend, "FUSE_ROPE", fuse_rope)

    path = str(tmp_path / arch)
    make_tiny_model(arch, path, **overrides)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 300) for _ in range(n)] for n in (3, 17, 40, 100, 5, 64)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def generate(use_triton: bool) -> list[list[int]]:
        llm = LLM(
            path,
            dtype="float32",
            num_gpu_blocks_override=256,
            block_size=block_size,
            max_model_len=256,
            max_num_batched_tokens=48,  # chunked prefill, mixed with decodes
            enable_prefix_caching=True,
            attention_backend="triton" if use_triton else "torch",
            enforce_eager=not use_triton,  # the reference: torch attention, no CUDA graphs
        )
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts[::-1], params, use_tqdm=False)  # prefix-cache hits
        return [o.outputs[0].token_ids for o in first + again]

    ref = generate(False)
    got = generate(True)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a == b, f"request {i}: torch {a} vs triton {b}"


@pytest.mark.interpret
@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("splits,window", [(1, None), (3, None), (2, 20)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (28, 4, 128)])
def test_decode_kernel_writes_the_new_keys_itself(heads, kv_heads, head_dim, splits, window, kv_fp8):
    """`fuse_decode_write`: in a pure decode step the decode kernel rotates q and writes the rows' keys and
    values itself. The output and the cache are what `write_kv_rope` then the decode kernel give, a padding
    row (slot -1) writes nothing, and the q, k, v inputs are left as they came."""
    from qwick.layers.rotary import RopeStep

    device = triton_device()
    dtype = _lowp(torch.bfloat16)
    bs = 16
    rows, num_blocks = _make_rows([(0, 1), (15, 1), (40, 1), (100, 1), (0, 1)], bs, random.Random(0))
    positions = torch.tensor([r.start_pos for r in rows], device=device)
    inv = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    emb = torch.arange(256, dtype=torch.float)[:, None] * inv[None, :]
    emb = torch.cat((emb, emb), dim=-1)
    rope = RopeStep(positions, emb.cos().to(device), emb.sin().to(device))
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    torch.manual_seed(0)
    qkv = torch.randn(len(rows), sum(sizes), device=device).to(dtype)
    shape = (num_blocks, bs, kv_heads, head_dim)
    k_scale, v_scale = fp8_scales(0.5, 2.0) if kv_fp8 else (1.0, 1.0)
    if kv_fp8:
        cache = torch.stack([quantize_kv(kv_values(shape, device, s), s) for s in (k_scale, v_scale)])
        qkv[:, heads * head_dim :] = kv_values((len(rows), 2 * kv_heads * head_dim), device).to(dtype)
    else:
        cache = torch.randn(2, *shape, device=device).to(dtype)
    kw = dict(scale=head_dim**-0.5, sliding_window=window, k_scale=k_scale, v_scale=v_scale, rope=rope)
    tri = _backend(bs, device, fixed_num_splits=splits)
    outs, caches = [], []
    for fused in (True, False):
        tri.fuse_decode_write = fused
        x = qkv.clone()
        q, k, v = (t.view(len(rows), -1, head_dim) for t in x.split(sizes, dim=-1))
        md = tri.build_metadata(rows)
        md.slot_mapping[-1] = -1  # a CUDA graph's padding row
        assert tri.fuses_decode_write(q, k, v, rope, md) == fused
        c = cache.clone()
        outs.append(tri.forward(q, k, v, c, md, **kw))
        caches.append(c)
        if fused:
            assert torch.equal(x, qkv)  # q rotated in registers only, k rotated only into the cache
    assert not torch.equal(caches[0], cache)
    last = rows[-1].block_table[0]  # the padding row's slot was never written
    assert torch.equal(caches[0][:, last, 0].view(torch.uint8), cache[:, last, 0].view(torch.uint8))
    # The same cache bits, compiled too: both kernels round the rotation's products in PTX (`round_to`).
    # Before that, the compiler fused a different product into each kernel's sum, and fp8 codes at
    # head_dim 128 came out one e4m3 step apart on the H200.
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    if INTERPRET:
        assert torch.equal(outs[0], outs[1])
    else:  # two compiled variants of the decode kernel
        torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.interpret
@pytest.mark.parametrize("new_key_apart", [False, True])
@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize(
    "context,window", [(0, None), (30, None), (31, None), (32, None), (70, None), (70, 20)]
)
def test_decode_preload_gives_the_same_bits(context, window, kv_fp8, new_key_apart):
    """`decode_preload` (`DECODE_PRELOAD`, on): a lone decode row's kernel reads its first key tile before the
    new key is written (before the wait of an early launch) and takes that key from registers. The cache
    is bit for bit the one without it, and so is the output where the key is merged into the tile: new
    keys at the start, middle and end of a tile (and the next tile's first), past a window, a padding
    row's slot (-1) read as the cache holds it. With `decode_new_key_apart` (`DECODE_NEW_KEY_APART`)
    the tile's stale slot is masked and the new key scored apart: the same products summed in another
    order, so the output is the same to within rounding."""
    from qwick.layers.rotary import RopeStep

    device = triton_device()
    dtype = _lowp(torch.bfloat16)
    heads, kv_heads, head_dim, bs = 8, 2, 64, 16
    for slot in (None, -1):
        rows, num_blocks = _make_rows([(context, 1)], bs, random.Random(context))
        positions = torch.tensor([context], device=device)
        inv = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        emb = torch.arange(128, dtype=torch.float)[:, None] * inv[None, :]
        emb = torch.cat((emb, emb), dim=-1)
        rope = RopeStep(positions, emb.cos().to(device), emb.sin().to(device))
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        torch.manual_seed(context)
        qkv = torch.randn(1, sum(sizes), device=device).to(dtype)
        shape = (num_blocks, bs, kv_heads, head_dim)
        k_scale, v_scale = fp8_scales(0.5, 2.0) if kv_fp8 else (1.0, 1.0)
        if kv_fp8:
            cache = torch.stack([quantize_kv(kv_values(shape, device, s), s) for s in (k_scale, v_scale)])
            qkv[:, heads * head_dim :] = kv_values((1, 2 * kv_heads * head_dim), device).to(dtype)
        else:
            cache = torch.randn(2, *shape, device=device).to(dtype)
        kw = dict(scale=head_dim**-0.5, sliding_window=window, k_scale=k_scale, v_scale=v_scale, rope=rope)
        tri = _backend(bs, device, fixed_num_splits=1)
        tri.decode_config = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
        tri.pdl_early_decode = True  # a GPU reads early in an early launch alone (waiting on nothing here)
        tri.decode_new_key_apart = new_key_apart
        outs, caches = [], []
        for preload in (True, False):
            tri.decode_preload = preload
            q, k, v = (t.view(1, -1, head_dim) for t in qkv.clone().split(sizes, dim=-1))
            md = tri.build_metadata(rows)
            if slot is not None:
                md.slot_mapping[0] = slot
            assert tri.fuses_decode_write(q, k, v, rope, md)
            c = cache.clone()
            outs.append(tri.forward(q, k, v, c, md, **kw))
            caches.append(c)
        assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
        assert torch.equal(caches[0].view(torch.uint8), cache.view(torch.uint8)) is (slot == -1)
        if new_key_apart:
            torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=1e-2, rtol=1e-2)
        else:
            assert torch.equal(outs[0], outs[1]), (context, window, slot)


@pytest.mark.interpret
@pytest.mark.parametrize("new_key_apart", [False, True])
@pytest.mark.parametrize("context", [0, 100, 255, 256, 400])
def test_lone_row_reads_its_short_context_in_one_tile(context, new_key_apart):
    """A lone decode row that reads early (`decode_preload`) takes its keys 256 at a time
    (`DECODE_PRELOAD_TILE`), so a short context is all read before the wait; longer ones loop over such
    tiles. Its output matches the row without the early reads (128-key tiles), within rounding, and the
    new key lands in the cache with the same bits."""
    from qwick.layers.attention.triton_backend import DECODE_PRELOAD_TILE
    from qwick.layers.rotary import RopeStep

    device = triton_device()
    dtype = _lowp(torch.bfloat16)
    heads, kv_heads, head_dim, bs = 8, 2, 128, 16
    rows, num_blocks = _make_rows([(context, 1)], bs, random.Random(context))
    inv = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    emb = torch.arange(512, dtype=torch.float)[:, None] * inv[None, :]
    emb = torch.cat((emb, emb), dim=-1)
    rope = RopeStep(torch.tensor([context], device=device), emb.cos().to(device), emb.sin().to(device))
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    torch.manual_seed(context)
    qkv = torch.randn(1, sum(sizes), device=device).to(dtype)
    cache = torch.randn(2, num_blocks, bs, kv_heads, head_dim, device=device).to(dtype)
    kw = dict(scale=head_dim**-0.5, sliding_window=None, k_scale=1.0, v_scale=1.0, rope=rope)
    tri = _backend(bs, device, fixed_num_splits=1)
    tri.pdl_early_decode = True  # a GPU reads early in an early launch alone (waiting on nothing here)
    tri.decode_new_key_apart = new_key_apart  # (`DECODE_NEW_KEY_APART`: the new key scored apart)
    assert tri._decode_cfg(head_dim, 2, False, 1, preload=True) == DECODE_PRELOAD_TILE
    assert tri._decode_cfg(head_dim, 2, False, 1) != DECODE_PRELOAD_TILE
    assert tri._decode_cfg(head_dim, 1, True, 1, preload=True) != DECODE_PRELOAD_TILE  # fp8 pages
    assert tri._decode_cfg(256, 2, False, 1, preload=True) != DECODE_PRELOAD_TILE  # too wide a tile
    outs, caches = [], []
    for preload in (True, False):
        tri.decode_preload = preload
        q, k, v = (t.view(1, -1, head_dim) for t in qkv.clone().split(sizes, dim=-1))
        c = cache.clone()
        outs.append(tri.forward(q, k, v, c, tri.build_metadata(rows), **kw))
        caches.append(c)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert not torch.equal(caches[0].view(torch.uint8), cache.view(torch.uint8))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.interpret
def test_decode_write_is_fused_by_default_and_never_in_mixed_steps():
    """The default: a pure decode step writes inside the decode kernel (into any cache), a mixed step
    through the separate write."""
    from qwick.layers.attention.triton_backend import TritonAttentionBackend
    from qwick.layers.rotary import RopeStep

    device = triton_device()
    tri = TritonAttentionBackend(16, device)
    rows, _ = _make_rows([(5, 1), (20, 1)], 16, random.Random(0))
    q, k, v = (torch.zeros(2, h, 64, device=device).to(_lowp(torch.bfloat16)) for h in (4, 2, 2))
    tables = torch.zeros(64, 64, device=device)
    rope = RopeStep(torch.tensor([5, 20], device=device), tables, tables)
    md = tri.build_metadata(rows)
    assert tri.fuses_decode_write(q, k, v, rope, md)
    mixed, _ = _make_rows([(5, 1), (20, 3)], 16, random.Random(0))
    assert not tri.fuses_decode_write(q, k, v, rope, tri.build_metadata(mixed))
