"""The quantized-weight matmul kernel against `formats.reference.dequant_matmul`, on every weight form:
int4 with zero-point tensors (AWQ / RTN), int4 symmetric with act-order (GPTQ), int4 with mins (GGUF Q4_K),
int8 containers (GGUF Q6_K, Q8_0); at the qwen2.5-7b decode shapes, M = 1..16 (split-K, counters reset on
a second call), and prefill M > 16. With TRITON_INTERPRET=1 it runs on the CPU at tiny shapes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwick.quantization.formats import gguf_quant, gptq, rtn
from qwick.quantization.formats.layout import QuantizedWeight, dequantize, fuse_n
from tests.triton_utils import INTERPRET, gemv_workspace, triton_device

pytestmark = [pytest.mark.gpu, pytest.mark.interpret]

# (N, K): qwen2.5-7b qkv, o, gate_up, down; an N that is not a multiple of the tile
SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (1000, 1024)]
GGUF_SHAPES = [(4608, 3584), (896, 4864)]
MS = [1, 3, 8, 16, 17, 100]
if INTERPRET:
    SHAPES = [(96, 512), (40, 768)]
    GGUF_SHAPES = [(40, 512)]
    MS = [1, 5, 16, 20]


def _random_gguf(qtype: int, n: int, k: int, seed: int) -> QuantizedWeight:
    """Random blocks with small finite fp16 fields (so that outputs stay in range)."""
    rng = np.random.default_rng(seed)
    block, size = gguf_quant.BLOCK_SIZES[qtype]
    data = rng.integers(0, 256, size=(n * (k // block), size), dtype=np.uint8)
    offsets = {gguf_quant.Q8_0: [0], gguf_quant.Q5_0: [0], gguf_quant.Q4_K: [0, 2], gguf_quant.Q6_K: [208]}
    for off in offsets[qtype]:
        d = (rng.standard_normal(data.shape[0]) * 1e-3).astype(np.float16)
        data[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    return gguf_quant.repack(data, qtype, (n, k))


FUSED = {  # 8-bit codes with fp32 scales and mins in groups of 16; 8-bit codes with per-group zero points
    "gguf-q4k+q4k+q6k": (gguf_quant.Q4_K, gguf_quant.Q4_K, gguf_quant.Q6_K),
    "gguf-q5_0+q5_0+q8_0": (gguf_quant.Q5_0, gguf_quant.Q5_0, gguf_quant.Q8_0),
}


def _weight(kind: str, n: int, k: int, dev: torch.device) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(n * 7 + k)
    if kind in FUSED:  # q/k/v of mixed types fused into one layer (`fuse_n`), as GGUF files have them
        sizes = [n - 2 * (n // 4), n // 4, n // 4]
        parts = [
            _random_gguf(t, rows, k, seed=n + k + i) for i, (t, rows) in enumerate(zip(FUSED[kind], sizes))
        ]
        return fuse_n(parts).to(dev)
    if kind.startswith("gguf"):
        qtype = {"gguf-q4k": gguf_quant.Q4_K, "gguf-q6k": gguf_quant.Q6_K, "gguf-q8": gguf_quant.Q8_0}[kind]
        return _random_gguf(qtype, n, k, seed=n + k).to(dev)
    w = torch.randn(n, k, generator=gen) / k**0.5
    if kind == "rtn-asym":
        return rtn.quantize(w.to(dev))
    if kind == "rtn-g64":
        return rtn.quantize(w.to(dev), 64, 4)
    order = torch.randperm(k, generator=gen)
    return gptq.to_internal(**gptq.quantize(w, 128, sym=True, act_order=order)).to(dev)


def _check(kind: str, n: int, k: int, ms: list[int], bias: bool) -> None:
    from qwick.kernels.w4a16 import QuantGemvConfig, default_config, quant_matmul
    from qwick.quantization.formats.reference import dequant_matmul

    dev = triton_device()
    dtype = torch.float16 if INTERPRET else torch.bfloat16
    ws = gemv_workspace(dev)
    qw = _weight(kind, n, k, dev)
    assert dequantize(qw).isfinite().all()
    b = torch.randn(n, device=dev, dtype=dtype) if bias else None
    for m in ms:
        configs = [default_config(m, n, k, qw.bits, ws.num_sms)]
        if m <= 16:
            configs += [
                QuantGemvConfig(32, 128, 1),
                QuantGemvConfig(64, 256, 4),
                QuantGemvConfig(16, 512, 2, 4, 3),
            ]
        else:
            configs += [QuantGemvConfig(64, 128, 1, 4, 3, block_m=32)]
        for cfg in configs:
            for _ in range(2 if cfg.split_k > 1 else 1):  # a second call reuses the self-reset counters
                x = torch.randn(m, k, device=dev, dtype=dtype)
                # the oracle: the same bf16/fp16-rounded weights, summed in float64
                w_rounded = dequantize(qw, dtype, original_order=False).double()
                xs = x.double() if qw.perm is None else x.double()[:, qw.perm]
                ref = xs @ w_rounded.T + (b.double() if bias else 0)
                out = quant_matmul(x, qw, b, ws, cfg)
                assert out.shape == (m, n) and out.dtype == dtype and not out.isnan().any()
                rel = ((out.double() - ref).norm() / ref.norm()).item()
                assert rel < 4e-3, (kind, m, cfg, rel)
                loose = dequant_matmul(x.float(), qw, b.float() if bias else None)
                assert ((out.float() - loose).norm() / loose.norm()).item() < 1e-2
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("kind", ["rtn-asym", "gptq-act-order"])
def test_int4_matches_reference(kind, n, k):
    _check(kind, n, k, MS, bias=kind == "rtn-asym")


@pytest.mark.parametrize("n,k", GGUF_SHAPES)
@pytest.mark.parametrize("kind", ["gguf-q4k", "gguf-q6k", "gguf-q8", *FUSED])
def test_gguf_matches_reference(kind, n, k):
    _check(kind, n, k, MS[:3] + MS[-1:], bias=True)


@pytest.mark.parametrize("kind", ["rtn-asym", "gptq-act-order"])
@pytest.mark.parametrize("n,k", SHAPES[:2])
def test_dequantize_int4_is_bit_identical_to_the_reference(kind, n, k):
    """The prefill path's Triton dequantization gives exactly `formats.layout.dequantize`'s weights, in
    stored column order, in both activation dtypes."""
    from qwick.kernels.w4a16 import dequantize_int4

    dev = triton_device()
    qw = _weight(kind, n, k, dev)
    for dtype in (torch.float16,) if INTERPRET else (torch.bfloat16, torch.float16):
        expected = dequantize(qw, dtype, original_order=False)
        assert torch.equal(dequantize_int4(qw, dtype), expected)


TILED_MS = [17, 40, 100] if not INTERPRET else [17, 33]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("kind", ["rtn-asym", "gptq-act-order", "rtn-g64"])
def test_tiled_int4_matches_reference(kind, n, k):
    """`w4_tiled_matmul` (int4 at 17+ rows): the default launch shape, forced K splits (twice, over the
    self-reset counters) and other M tiles, against the float64 product of the same rounded weights."""
    from qwick.kernels.w4a16 import TiledW4Config, tiled_w4_config, w4_tiled_matmul

    dev = triton_device()
    dtype = torch.float16 if INTERPRET else torch.bfloat16
    ws = gemv_workspace(dev)
    qw = _weight(kind, n, k, dev)
    w_rounded = dequantize(qw, dtype, original_order=False).double()
    bias = torch.randn(n, device=dev, dtype=dtype) if kind == "rtn-asym" else None
    for m in TILED_MS:
        configs = [
            tiled_w4_config(m, n, k, qw.group_size, ws.num_sms),
            TiledW4Config(32, 32, 8, 4 if n <= 8192 else 2, num_warps=2, num_stages=2),  # fits the workspace
        ]
        if qw.group_size >= 128:  # 16-word tiles (groups of 64 codes are 8 words)
            configs += [
                TiledW4Config(16, 64, 16, 2),
                TiledW4Config(32, 64, 16, 2, nibble_dots=True),
                TiledW4Config(16, 64, 16, 4 if n <= 8192 else 2, nibble_dots=True),
                TiledW4Config(32, 128, 16, 1, nibble_dots=True),
            ]
        for cfg in configs:
            for _ in range(2 if cfg.split_k > 1 else 1):
                x = torch.randn(m, k, device=dev, dtype=dtype)
                xs = x.double() if qw.perm is None else x.double()[:, qw.perm]
                ref = xs @ w_rounded.T + (bias.double() if bias is not None else 0)
                out = w4_tiled_matmul(x, qw, bias, ws, cfg)
                assert out.shape == (m, n) and out.dtype == dtype
                rel = ((out.double() - ref).norm() / ref.norm()).item()
                assert rel < 4e-3, (kind, m, cfg, rel)
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.parametrize("kind", ["rtn-asym", "gptq-act-order", "rtn-g64"])
@pytest.mark.parametrize("half_decode", [False, True])
def test_tiled_int4_multiplies_the_reference_weights_bit_for_bit(kind, half_decode):
    """One-hot rows of x pick single weights: y[m, n] = W[n, k_m] with nothing to round (the fp32 sum has
    one nonzero term), so the tiled kernel's decoded weights must equal `dequantize`'s bit for bit, on
    every variant (reshape, nibble pairs), across K splits, in fp32 decode math and in packed fp16 math
    (`half_decode`, fp16 x and scales; bf16 x takes the fp32 math whatever the switch)."""
    from qwick.kernels.w4a16 import TiledW4Config, w4_tiled_matmul

    dev = triton_device()
    n, k = SHAPES[0]
    qw = _weight(kind, n, k, dev)
    ws = gemv_workspace(dev)
    dtypes = [torch.float16] if INTERPRET else [torch.float16, torch.bfloat16]
    for dtype in dtypes:
        w = dequantize(qw, dtype, original_order=True)  # [N, K] in x's column order
        for m in (5, 16, 20):
            cols = torch.randperm(k, generator=torch.Generator().manual_seed(m))[:m].to(dev)
            x = torch.zeros(m, k, device=dev, dtype=dtype)
            x[torch.arange(m, device=dev), cols] = 1.0
            configs = [TiledW4Config(32, 64, 8, 2)]
            if qw.group_size >= 128:
                pairs = ((16, 2), (32, 1))  # (BLOCK_M, split_k)
                configs += [TiledW4Config(b, 64, 16, split, nibble_dots=True) for b, split in pairs]
            for cfg in configs:
                y = w4_tiled_matmul(x, qw, None, ws, cfg, half_decode=half_decode)
                assert torch.equal(y, w[:, cols].T), (kind, dtype, m, cfg)


def test_tiled_int4_launch_shapes_follow_the_sweep():
    """`tiled_w4_config` at the 7b shapes on 132 SMs (the seventeenth session's sweep): nibble-pair
    dots, 4 warps, on 16-row tiles up to 16 rows, 32-row tiles up to 32 and 64-row tiles above; 128
    outputs except for qkv and o at 17-64 rows (and down at 33-64); K split in four except for gate/up at
    33+ rows (two), and never into splits of less than two tiles of K. Groups of 64 codes: the reshape."""
    from qwick.kernels.w4a16 import tiled_w4_config

    shapes = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
    expected = {  # (block_m, block_n, split_k) of qkv, o, gate_up, down
        (2, 16): [(16, 128, 4)] * 4,
        (17, 32): [(32, 64, 4), (32, 64, 4), (32, 128, 4), (32, 128, 4)],
        (33, 64): [(64, 64, 4), (64, 64, 4), (64, 128, 2), (64, 64, 4)],
        (65, 128): [(64, 128, 4), (64, 128, 4), (64, 128, 2), (64, 128, 4)],
    }
    for rows, shapes_expected in expected.items():
        for m in rows:
            configs = [tiled_w4_config(m, n, k, 128, 132) for n, k in shapes.values()]
            assert [(c.block_m, c.block_n, c.split_k) for c in configs] == shapes_expected, m
            assert all(c.nibble_dots and c.num_warps == 4 for c in configs)
    # 14b (the twentieth session's sweep): qkv takes 128 outputs at 17-64 rows, gate/up K in four at 33-64.
    shapes14 = {"qkv": (7168, 5120), "o": (5120, 5120), "gate_up": (27648, 5120), "down": (5120, 13824)}
    expected14 = {
        32: [(32, 128, 4), (32, 64, 4), (32, 128, 4), (32, 128, 4)],
        64: [(64, 128, 4), (64, 64, 4), (64, 128, 4), (64, 64, 4)],
        128: [(64, 128, 4), (64, 128, 4), (64, 128, 2), (64, 128, 4)],
    }
    for m, shapes_expected in expected14.items():
        configs = [tiled_w4_config(m, n, k, 128, 132) for n, k in shapes14.values()]
        assert [(c.block_m, c.block_n, c.split_k) for c in configs] == shapes_expected, m
    assert tiled_w4_config(20, 512, 128, 128, 132).split_k == 1
    group64 = tiled_w4_config(20, 512, 512, 64, 132)  # a group of 64 codes is 8 words: too short a dot
    assert (group64.block_w, group64.nibble_dots) == (8, False)


def test_tiled_int4_default_launch_splits_k_only_where_the_workspace_holds_it():
    """The default launch of M's power-of-two bucket halves its K splits until the partials fit the
    workspace: gate/up at 65-128 rows splits K in two with 16M floats, not at all with serving's 8M."""
    from qwick.kernels.w4a16 import _default_tiled_launch, tiled_w4_config

    gate_up = (37888, 3584, 128, 132)
    assert tiled_w4_config(128, *gate_up).split_k == 2
    assert _default_tiled_launch(128, *gate_up, 1 << 24, 1 << 16).split_k == 2
    assert _default_tiled_launch(128, *gate_up, 1 << 23, 1 << 16).split_k == 1
    assert _default_tiled_launch(16, *gate_up, 1 << 23, 1 << 16).split_k == 4  # 4 x 16 x 37888 fits
    assert _default_tiled_launch(16, *gate_up, 1 << 23, 1 << 8).split_k == 1  # too few counters
    assert _default_tiled_launch(64, 27648, 5120, 128, 132, 1 << 23, 1 << 16).split_k == 4  # 14b, 7.1M floats


def test_tiled_int4_refuses_what_it_cannot_take():
    from qwick.kernels.w4a16 import TiledW4Config, w4_tiled_matmul

    dev = triton_device()
    ws = gemv_workspace(dev)
    qw = _weight("rtn-asym", 96, 512, dev)
    x = torch.randn(20, 512, device=dev, dtype=torch.float16)
    with pytest.raises(ValueError, match="bf16/fp16"):
        w4_tiled_matmul(x.float(), qw, None, ws)
    with pytest.raises(ValueError, match="must divide groups"):
        w4_tiled_matmul(x, qw, None, ws, TiledW4Config(32, 64, 32, 1))  # 32 words > a 16-word group
    with pytest.raises(ValueError, match="tl.dot needs 16"):
        w4_tiled_matmul(x, qw, None, ws, TiledW4Config(32, 64, 8, 1, nibble_dots=True))
    with pytest.raises(ValueError, match="x \\[M, 512\\]"):
        w4_tiled_matmul(x[:, :256], qw, None, ws)
