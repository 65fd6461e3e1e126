"""The Triton attention backend with an fp8 KV cache against the PyTorch reference with the same cache.

Every case runs one step through both backends (`run_case` of tests/layers/test_triton_attention.py with
`kv_fp8`) over an fp8 (e4m3) cache with per-layer k/v scales:
- the KV-cache writes must be byte-identical (both store `quantize_kv(x, scale)`: fp32 multiply by the
  reciprocal scale, clamp to +-448, round to nearest even);
- the outputs are compared with the reference run in fp32 over the same fp8 cache (exact attention over
  the quantized keys/values), at the bf16/fp16 tolerances of tests/layers/test_triton_attention.py: the
  fp8 cache adds no error there, since e4m3 values convert exactly to bf16/fp16 and the scales are applied
  in fp32 (k_scale folded into the softmax scale, v_scale on the output).

GPU tests; with TRITON_INTERPRET=1 they run on the CPU through Triton's interpreter (bf16 cases in fp16).
The interpreter's fp32 -> fp8 conversion does not round correctly (no carry into the exponent, ties away
from zero, no subnormal outputs), so there the inputs are made exactly representable (normal e4m3 values
times power-of-two scales) and the conversion has nothing to round; on a GPU, inputs are arbitrary.
"""

from __future__ import annotations

import random

import pytest
import torch

from qwick.layers.attention.backend import FP8_KV_DTYPE, AttentionRow, quantize_kv
from qwick.layers.attention.torch_ref import TorchAttentionBackend
from tests.layers.test_triton_attention import _backend, _lowp, _make_rows
from tests.layers.test_triton_attention import run_case as run_triton_case
from tests.triton_utils import INTERPRET, triton_device

pytestmark = pytest.mark.gpu


def _device() -> torch.device:
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    return triton_device()


def run_case(specs, **kwargs):
    _device()
    return run_triton_case(specs, kv_fp8=True, **kwargs)


# (head_dim, group, num_kv_heads, dtype): both head dims, GQA 7:1 (qwen2.5-7b), 4:1 (qwen3-8b), 1:1.
HEAD_CONFIGS = [
    (128, 7, 4, torch.bfloat16),
    (128, 4, 8, torch.float16),
    (128, 1, 4, torch.bfloat16),
    (64, 7, 2, torch.bfloat16),
    (64, 4, 2, torch.float16),
    (64, 1, 4, torch.bfloat16),
]
HEAD_IDS = [f"D{d}-G{g}-kv{h}-{str(t)[6:]}" for d, g, h, t in HEAD_CONFIGS]
SCALES = [(1.0, 1.0), (0.37, 1.7)]  # vLLM's default (uncalibrated), and calibrated-looking values
SCALE_IDS = ["unit-scales", "scales"]
DECODE_CONTEXTS = [0, 1, 15, 16, 17, 63, 64, 65, 200, 1000, 2047]
EXTEND_SPECS = [(0, 2), (0, 17), (0, 65), (5, 7), (16, 16), (15, 49), (100, 3), (1000, 129)]


@pytest.mark.parametrize("k_scale,v_scale", SCALES, ids=SCALE_IDS)
@pytest.mark.parametrize("head_dim,group,num_kv_heads,dtype", HEAD_CONFIGS, ids=HEAD_IDS)
def test_fp8_decode_rows(head_dim, group, num_kv_heads, dtype, k_scale, v_scale):
    specs = [(c, 1) for c in DECODE_CONTEXTS]
    run_case(
        specs,
        head_dim=head_dim,
        group=group,
        num_kv_heads=num_kv_heads,
        dtype=dtype,
        k_scale=k_scale,
        v_scale=v_scale,
    )


@pytest.mark.parametrize("k_scale,v_scale", SCALES, ids=SCALE_IDS)
@pytest.mark.parametrize("head_dim,group,num_kv_heads,dtype", HEAD_CONFIGS, ids=HEAD_IDS)
def test_fp8_extend_rows(head_dim, group, num_kv_heads, dtype, k_scale, v_scale):
    run_case(
        EXTEND_SPECS,
        head_dim=head_dim,
        group=group,
        num_kv_heads=num_kv_heads,
        dtype=dtype,
        k_scale=k_scale,
        v_scale=v_scale,
    )


@pytest.mark.interpret
@pytest.mark.parametrize("block_size,window", [(16, None), (4, None), (32, 50)])
def test_fp8_mixed_decode_and_extend(block_size, window):
    specs = [(30, 1), (0, 40), (7, 1), (130, 1), (33, 20), (0, 1), (64, 1), (500, 70), (1, 1)]
    for head_dim, group, num_kv_heads, dtype in HEAD_CONFIGS[::3]:
        run_case(
            specs,
            head_dim=head_dim,
            group=group,
            num_kv_heads=num_kv_heads,
            dtype=dtype,
            block_size=block_size,
            sliding_window=window,
            k_scale=0.5,
            v_scale=2.0,
        )


@pytest.mark.interpret
def test_fp8_float32_queries():
    run_case([(0, 19), (40, 1), (3, 5), (129, 1)], head_dim=64, group=2, dtype=torch.float32, block_size=4)


def test_fp8_cache_with_queries_past_fp16_range():
    """With an fp8 cache the queries go through fp16 as q / 256 (`_fp16_queries`): bf16 |q| up to ~1.3e5
    here, past fp16's 65504, must stay finite and exact. The division is done in fp32 first (written in
    Triton, the compiler moved it after the conversion to fp16, which then overflowed). GPU only: the
    interpreter's queries are fp16 themselves."""
    if INTERPRET:
        pytest.skip("the interpreter runs bf16 cases in fp16, which cannot hold these queries")
    specs = [(0, 5), (200, 1), (1000, 1), (37, 9)]
    run_case(specs, q_scale=3e4, k_scale=0.5, v_scale=2.0)


@pytest.mark.parametrize("splits", [None, 3, 16])
def test_fp8_split_kv_decode(splits):
    """Several splits per row (their partial outputs carry v_scale into the reduction)."""
    if INTERPRET and splits is None:
        pytest.skip("long contexts are too slow for the interpreter")
    contexts = (8192, 5000, 33) if splits is None else (0, 63, 300, 3000)
    tri = run_case(
        [(c, 1) for c in contexts],
        head_dim=128,
        group=7,
        num_kv_heads=4,
        k_scale=0.8,
        v_scale=1.3,
        backend_kwargs={"fixed_num_splits": splits} if splits else None,
    )
    assert tri.num_splits(len(contexts), 4, max(contexts)) > 1


def test_fp8_write_rounds_like_torch_on_arbitrary_inputs():
    """The write kernel's fp32 -> e4m3 conversion (round to nearest even, saturating, subnormals) equals
    torch's, on values of every magnitude, including beyond 448 and below e4m3's smallest normal."""
    if not torch.cuda.is_available():
        pytest.skip("the interpreter's fp8 rounding is not the GPU's (see the module docstring)")
    device = _device()
    bs, hkv, d, tokens = 16, 4, 128, 300
    tri = _backend(bs, device)
    table = list(range(1, tokens // bs + 2))
    md = tri.build_metadata([AttentionRow(0, tokens, table)])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        magnitude = torch.logspace(-12, 12, tokens, base=2.0, device=device)[:, None, None]
        k = (torch.randn(tokens, hkv, d, device=device) * magnitude).to(dtype)
        v = (torch.randn(tokens, hkv, d, device=device) * magnitude).to(dtype)
        for k_scale, v_scale in [(1.0, 1.0), (0.37, 1.7), (3.0, 0.011)]:
            cache = torch.zeros(2, len(table) + 1, bs, hkv, d, device=device, dtype=FP8_KV_DTYPE)
            tri.write_kv(k, v, cache, md.slot_mapping, k_scale, v_scale)
            flat = cache.view(torch.uint8).view(2, -1, hkv, d)[:, md.slot_mapping]
            assert torch.equal(flat[0], quantize_kv(k, k_scale).view(torch.uint8)), (dtype, k_scale)
            assert torch.equal(flat[1], quantize_kv(v, v_scale).view(torch.uint8)), (dtype, v_scale)


def test_scales_do_not_touch_16_bit_caches():
    """Scales passed with a bf16/fp16 cache are ignored: the result equals the unscaled call, bit for bit."""
    device = _device()
    dtype = _lowp(torch.bfloat16)
    rows, num_blocks = _make_rows([(20, 1), (0, 30), (70, 9)], 16, random.Random(5))
    torch.manual_seed(5)
    q = torch.randn(40, 8, 64, device=device).to(dtype)
    k = torch.randn(40, 2, 64, device=device).to(dtype)
    v = torch.randn(40, 2, 64, device=device).to(dtype)
    context = torch.randn(2, num_blocks, 16, 2, 64, device=device).to(dtype)
    tri = _backend(16, device)
    outs, caches = [], []
    for s in (1.0, 3.0):
        cache = context.clone()
        md = tri.build_metadata(rows)
        outs.append(tri.forward(q, k, v, cache, md, scale=0.125, sliding_window=None, k_scale=s, v_scale=s))
        caches.append(cache)
    assert torch.equal(outs[0], outs[1]) and torch.equal(caches[0], caches[1])


def test_fp8_decode_step_replays_in_a_cuda_graph():
    """With an fp8 cache and scales, a captured decode step replays to the eager result, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = _device()
    bs, hkv, g, d = 16, 4, 7, 128
    k_scale, v_scale = 0.6, 1.4
    rng = random.Random(3)
    rows, num_blocks = _make_rows([(c, 1) for c in (100, 1000, 17, 3000)], bs, rng, extra_blocks=0)
    rows = [AttentionRow(r.start_pos, 1, r.block_table + [num_blocks + i]) for i, r in enumerate(rows)]
    cache = quantize_kv(torch.randn(2, num_blocks + 4, bs, hkv, d, device=device), 1.0)
    q = torch.randn(4, hkv * g, d, device=device).to(torch.bfloat16)
    k = torch.randn(4, hkv, d, device=device).to(torch.bfloat16)
    v = torch.randn(4, hkv, d, device=device).to(torch.bfloat16)
    kw = dict(scale=d**-0.5, sliding_window=None, k_scale=k_scale, v_scale=v_scale)
    tri = _backend(bs, device, fixed_num_splits=16)
    md = tri.build_metadata(rows)
    tri.forward(q, k, v, cache, md, **kw)  # compile, allocate scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph = tri.forward(q, k, v, cache, md, **kw)
    for step in range(1, 4):
        advanced = [AttentionRow(r.start_pos + step, 1, r.block_table) for r in rows]
        md_new = tri.build_metadata(advanced)
        for name in ("slot_mapping", "seq_lens", "block_tables", "query_start_loc"):
            getattr(md, name).copy_(getattr(md_new, name))
        for t in (q, k, v):
            t.copy_(torch.randn_like(t, dtype=torch.float32))
        graph.replay()
        cache_eager = cache.clone()
        eager = tri.forward(q, k, v, cache_eager, md_new, **kw)
        assert torch.equal(out_graph, eager), f"step {step}"
        assert torch.equal(cache.view(torch.uint8), cache_eager.view(torch.uint8))
        ref = TorchAttentionBackend(bs, device)
        expected = ref.forward(
            q.float(), k.float(), v.float(), cache.clone(), ref.build_metadata(advanced), **kw
        )
        torch.testing.assert_close(out_graph.float(), expected, atol=2e-2, rtol=2e-2)
