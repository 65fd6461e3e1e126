"""The batch-1 int4 GEMVs against float64 dequantize-then-matmul: the fp32 one (`qwick.kernels.row_gemv`)
and the packed-fp16 one (`qwick.kernels.row_gemv_half2`, "f16x2").

The bit tricks must decode every code exactly: integer codes, zero points and inputs with unit scales
give an exact integer result (fp16 holds the f16x2 kernel's partial sums exactly too), checked for
equality; then whole products at the qwen2.5-7b decode shapes with split-K (counters reset on a second
call), bias, zero-point tensors, symmetric int4 with act-order, 64-, 128- and 256-wide groups, and the
f16x2 kernel's tiles of 8-32 words spanning groups. With TRITON_INTERPRET=1 both run on the CPU at small
shapes; the f16x2 kernel there computes its products in fp32 (the interpreter runs no PTX), so the GPU run
is what checks its inline assembly.
"""

from __future__ import annotations

import pytest
import torch
import triton

from qwick.quantization.formats import gptq, rtn
from qwick.quantization.formats.layout import QuantizedWeight, dequantize, pack_along_k
from tests.triton_utils import INTERPRET, gemv_workspace, triton_device

pytestmark = [pytest.mark.gpu, pytest.mark.interpret]


# (N, K): qwen2.5-7b qkv, o, gate_up, down; an N that is not a multiple of the tile, a K of 112 words
SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (1000, 1024), (1000, 896)]
if INTERPRET:
    SHAPES = [(96, 512), (40, 768)]
# the interpreter rounds fp32 -> bf16 toward zero (-371 -> -370, not -372), so bf16 is checked on GPUs only
X_DTYPES = [torch.float16] + ([] if INTERPRET else [torch.bfloat16])
KERNEL_X = [("fp32", torch.float32)] + [(kernel, t) for kernel in ("fp32", "f16x2") for t in X_DTYPES]


def _rtn_case(n: int, k: int, seed: int):
    """Where a test runs, its split-K scratch, the activations' dtype (fp16 under the interpreter, which
    rounds to bf16 toward zero), a seeded generator and an [n, k] round-to-nearest int4 weight (group 128)
    of unit-variance products."""
    dev = triton_device()
    gen = torch.Generator().manual_seed(seed)
    qw = rtn.quantize(torch.randn(n, k, generator=gen) / k**0.5, group_size=128).to(dev)
    return dev, gemv_workspace(dev), torch.float16 if INTERPRET else torch.bfloat16, gen, qw


def _gemv(kernel: str):
    from qwick.kernels.row_gemv import w4_row_gemv
    from qwick.kernels.row_gemv_half2 import w4_half2_gemv

    return w4_row_gemv if kernel == "fp32" else w4_half2_gemv


def _configs(kernel: str, n: int, kw: int, ws, group_words: int = 16):
    from qwick.kernels.row_gemv import RowGemvConfig, default_w4_config
    from qwick.kernels.row_gemv_half2 import default_half2_config, tile_words_for

    if kernel == "f16x2":  # tiles of 8-32 words, within or across groups; prefetch: odd tile counts per
        # split (the last B tile repeated, scaled by 0) and, at split 5 of small K, a split with no tiles;
        # a register cap
        return [
            default_half2_config(n, kw, ws.num_sms),
            RowGemvConfig(32, 8, 3),
            RowGemvConfig(16, 16, 2),
            RowGemvConfig(32, 8, 3, prefetch=True),
            RowGemvConfig(64, tile_words_for(kw), 1, prefetch=True),
            RowGemvConfig(16, 16, 5, prefetch=True),
            RowGemvConfig(32, 16, 2, max_registers=64),  # ptxas's register cap (spills on the GPU)
        ]
    return [
        default_w4_config(n, kw, group_words, ws.num_sms),
        RowGemvConfig(32, group_words, 1),
        RowGemvConfig(16, group_words, 4, prefetch=True),
        RowGemvConfig(64, group_words, 2, loop_stages=3),
    ]


@pytest.mark.parametrize("group", [64, 128, 256])
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("kernel,x_dtype", KERNEL_X)
def test_every_nibble_position_decodes_exactly(group, zeros, kernel, x_dtype):
    """Codes 0-15 at every position of a word, zero points 0-15, unit scales, small integer x: the sums
    are exact integers, rounded once to x's dtype, so any wrong nibble, shift, pair, group or offset shows
    as a mismatch; 16-bit activations take the two-per-load path, both halves of every pair."""
    dev = triton_device()
    gen = torch.Generator().manual_seed(group)
    n, k = 48, 4 * max(group, 256)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    z = torch.randint(0, 16, (n, k // group), generator=gen, dtype=torch.int32)
    weight = QuantizedWeight(
        qweight=pack_along_k(q, 4),
        scales=torch.ones(n, k // group),
        bits=4,
        group_size=group,
        zeros=z.to(torch.uint8) if zeros else None,
        zero_point=0 if zeros else 8,
    ).to(dev)
    x = torch.randint(-3, 4, (1, k), generator=gen).float()
    w = q - (z.repeat_interleave(group, dim=1) if zeros else 8)
    expected = (x.long() @ w.long().T).float().to(x_dtype)
    ws = gemv_workspace(dev)
    for cfg in [None] + _configs(kernel, 48, k // 8, ws, group // 8)[1:]:
        y = _gemv(kernel)(x.to(dev, x_dtype), weight, None, ws, cfg)
        assert y.dtype == x_dtype and torch.equal(y.cpu(), expected), cfg


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("form", ["rtn", "gptq_sym_act_order"])
@pytest.mark.parametrize("kernel", ["fp32", "f16x2"])
def test_w4_row_gemv_matches_dequantized_matmul(n, k, form, kernel):
    from qwick.kernels.row_gemv import w4_row_supported

    dev = triton_device()
    ws = gemv_workspace(dev)
    act = torch.float16 if INTERPRET else torch.bfloat16
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) / k**0.5
    if form == "rtn":  # asymmetric: a zero-point tensor
        qw = rtn.quantize(w, group_size=128).to(dev)
    else:  # symmetric (zero point 8) with a permuted K
        order = torch.randperm(k, generator=gen)
        qw = gptq.to_internal(**gptq.quantize(w, 128, sym=True, act_order=order)).to(dev)
    assert w4_row_supported(qw)
    w_deq = dequantize(qw).double()  # [N, K] in the input channels' order
    b = torch.randn(n, device=dev, dtype=act)
    for cfg in _configs(kernel, n, k // 8, ws):
        for _ in range(2):  # a second call reuses the self-reset split-K counters
            x = torch.randn(1, k, device=dev, dtype=act) * 4
            ref = x.double() @ w_deq.T + b.double()
            out = _gemv(kernel)(x, qw, b, ws, cfg)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 4e-3, (cfg, err)
    assert int(ws.counters.abs().sum()) == 0


def test_default_half2_launch_shapes_at_7b():
    """The H200 sweep's launch shapes (`default_half2_config`): 32-row tiles of 4 warps, K split up to 12
    programs per SM; 2 warps with the prefetch past K 8192 (down), 64 rows of 8 warps when N <= K (o)."""
    from qwick.kernels.row_gemv import RowGemvConfig
    from qwick.kernels.row_gemv_half2 import default_half2_config

    def cfg(n, k):
        return default_half2_config(n, k // 8, 132)

    assert cfg(4608, 3584) == RowGemvConfig(32, 32, 8)  # qkv
    assert cfg(37888, 3584) == RowGemvConfig(32, 32, 1)  # gate/up
    assert cfg(3584, 3584) == RowGemvConfig(64, 32, 8, num_warps=8)  # o
    assert cfg(3584, 18944) == RowGemvConfig(32, 32, 8, num_warps=2, prefetch=True)  # down


def test_half_pairs_reference_layout():
    """`half_pairs` (the torch form benchmarks feed the GEMV): int32 4w + p holds x[8w + p] / 64 in its low
    half and x[8w + p + 4] / 64 in its high half."""
    from qwick.kernels.row_gemv_half2 import X_DIV, half_pairs

    x = torch.arange(32, dtype=torch.float32).view(1, 32) - 7
    pairs = half_pairs(x)
    assert pairs.shape == (1, 16) and pairs.dtype == torch.int32
    halves = pairs.view(torch.float16).view(4, 4, 2).float() * X_DIV  # [word, p, low/high]
    words = x.view(4, 8)
    assert torch.equal(halves[:, :, 0], words[:, :4]) and torch.equal(halves[:, :, 1], words[:, 4:])


@pytest.mark.parametrize("n,k", SHAPES[:2])
def test_f16x2_reads_pairs_made_by_the_producer(n, k):
    """The `HalfPairs` operand written by RMSNorm (as the decoder makes it) instead of x: on a GPU the same
    bits as pairing x in registers; under the interpreter, whose emulation reads x unrounded, within the
    fp16 rounding of x / 64. Act-order weights (x gathered) and malformed pairs are refused."""
    from qwick.kernels.elementwise import rms_norm
    from qwick.kernels.row_gemv_half2 import X_DIV, w4_half2_gemv
    from qwick.layers.linear import HalfPairs

    dev, ws, act, gen, qw = _rtn_case(n, k, k)
    h = torch.randn(1, k, generator=gen).to(dev, act) * 3
    norm_w = torch.rand(k, generator=gen).to(dev, act) + 0.5
    paired = rms_norm(h, norm_w, 1e-6, quant=HalfPairs(X_DIV))
    b = torch.randn(n, device=dev, dtype=act)
    want = w4_half2_gemv(paired.x, qw, b, ws)
    got = w4_half2_gemv(paired.x, qw, b, ws, pairs=paired.pairs)
    if INTERPRET:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
    else:
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="pairs must be"):
        w4_half2_gemv(paired.x, qw, b, ws, pairs=paired.pairs[:, 1:])
    order = torch.randperm(k, generator=gen)
    act_order = gptq.quantize(torch.randn(n, k, generator=gen), 128, sym=True, act_order=order)
    qw_act = gptq.to_internal(**act_order)
    with pytest.raises(ValueError, match="act-order"):
        w4_half2_gemv(paired.x, qw_act.to(dev), b, ws, pairs=paired.pairs)


def test_f16x2_refusals():
    from qwick.kernels.row_gemv import RowGemvConfig
    from qwick.kernels.row_gemv_half2 import tile_words_for, w4_half2_gemv

    dev = triton_device()
    qw = rtn.quantize(torch.randn(64, 896), group_size=128).to(dev)  # 112 words per row
    ws = gemv_workspace(dev)
    with pytest.raises(ValueError, match="bf16/fp16"):
        w4_half2_gemv(torch.randn(1, 896, device=dev), qw, None, ws)
    with pytest.raises(ValueError, match="do not fit"):
        w4_half2_gemv(torch.randn(1, 896, device=dev).half(), qw, None, ws, RowGemvConfig(64, 32, 1))
    assert tile_words_for(112) == 16 and tile_words_for(448) == 32 and tile_words_for(8 * 13) == 8


@pytest.mark.parametrize("inter,k", [(48, 512), (40, 768)] if INTERPRET else [(18944, 3584), (40, 768)])
@pytest.mark.parametrize("paired_in", [False, True])
def test_gated_gemv_is_silu_and_mul_of_the_gemv(inter, k, paired_in):
    """`w4_half2_gated` on a [gate | up] weight: bit for bit `silu_and_mul` of `w4_half2_gemv` at the same
    launch shape, with and without the output's `HalfPairs` (and those equal to what `silu_and_mul`
    writes), from x or from its pairs, with a bias, at tile heights of 16-64 rows, an intermediate size
    that is not a multiple of the tile's half (40), and the 7b gate/up on GPUs."""
    from qwick.kernels.elementwise import rms_norm, silu_and_mul
    from qwick.kernels.row_gemv import RowGemvConfig
    from qwick.kernels.row_gemv_half2 import (
        X_DIV,
        gated_half2_config,
        tile_words_for,
        w4_half2_gated,
        w4_half2_gemv,
    )
    from qwick.layers.linear import HalfPairs, PairedRows

    n = 2 * inter
    dev, ws, act, gen, qw = _rtn_case(n, k, inter + k)
    h = torch.randn(1, k, generator=gen).to(dev, act) * 3
    x = rms_norm(h, torch.rand(k, generator=gen).to(dev, act) + 0.5, 1e-6, quant=HalfPairs(X_DIV))
    pairs = x.pairs if paired_in else None
    b = torch.randn(n, generator=gen).to(dev, act)
    kw = k // 8
    cfgs = [RowGemvConfig(32, tile_words_for(kw), 1), RowGemvConfig(16, 16, 1, prefetch=True)]
    cfgs.append(RowGemvConfig(64, tile_words_for(kw), 1, num_warps=8))
    if gated_half2_config(n, kw, ws.num_sms) is not None:
        cfgs.append(None)
    for cfg in cfgs:
        y = w4_half2_gemv(x.x, qw, b, ws, cfg or gated_half2_config(n, kw, ws.num_sms), pairs=pairs)
        want = silu_and_mul(y, HalfPairs(X_DIV))
        got = w4_half2_gated(x.x, qw, b, ws, cfg, pairs=pairs)
        assert got.shape == (1, inter) and torch.equal(got, want.x), cfg
        got = w4_half2_gated(x.x, qw, b, ws, cfg, pairs=pairs, out_pairs=HalfPairs(X_DIV))
        assert isinstance(got, PairedRows) and torch.equal(got.x, want.x), cfg
        assert torch.equal(got.pairs, want.pairs), cfg
    with pytest.raises(ValueError, match="one split"):
        w4_half2_gated(x.x, qw, b, ws, RowGemvConfig(32, 16, 2))


def test_normed_launch_only_with_a_short_tail():
    """`normed_half2_config`: the plain launch where its last program normalizes the row in at most 16
    values a thread (the 7b o projection's 8 warps), else None (the 7b down projection's 2 warps)."""
    from qwick.kernels.row_gemv_half2 import default_half2_config, normed_half2_config

    assert normed_half2_config(3584, 448, 132) == default_half2_config(3584, 448, 132)
    assert default_half2_config(3584, 448, 132).num_warps == 8
    assert default_half2_config(3584, 2368, 132).num_warps == 2
    assert normed_half2_config(3584, 2368, 132) is None


def test_gated_launch_only_with_one_split():
    """`gated_half2_config`: the plain launch where it has one split (7b and 14b gate/up), else None."""
    from qwick.kernels.row_gemv import RowGemvConfig
    from qwick.kernels.row_gemv_half2 import gated_half2_config

    assert gated_half2_config(37888, 448, 132) == RowGemvConfig(32, 32, 1)
    assert gated_half2_config(27648, 640, 132) == RowGemvConfig(32, 32, 1)
    assert gated_half2_config(9728, 112, 132) is None  # 0.5b: 304 tiles split 4


@pytest.mark.parametrize(
    "n,k", [(96, 512), (40, 768)] if INTERPRET else [(3584, 3584), (3584, 18944), (40, 768), (1000, 1024)]
)
@pytest.mark.parametrize("pairs_out", [False, True])
def test_normed_gemv_is_the_norm_of_the_gemv(n, k, pairs_out):
    """`w4_half2_normed`: the residual add + RMSNorm of `w4_half2_gemv` in its own launch, against
    `rms_norm` of the GEMV's output: the same residual bit for bit, the normalized row and its pairs within
    one bf16 step (the sum of squares may be added in another order on a GPU), at one split and at K
    splits (with an empty split), in 8, 4 and 2 warps (2 warps with the prefetch: 64 values a thread in
    the tail at 7b shapes) and the shape's default launch where the norm takes it (the 7b o projection's);
    twice per launch shape, so the tail's counter must have been reset."""
    from qwick.kernels.elementwise import rms_norm
    from qwick.kernels.row_gemv import RowGemvConfig
    from qwick.kernels.row_gemv_half2 import (
        X_DIV,
        normed_half2_config,
        tile_words_for,
        w4_half2_gemv,
        w4_half2_normed,
    )
    from qwick.layers.linear import HalfPairs, NormAfter, PairedRows

    dev, ws, act, gen, qw = _rtn_case(n, k, n + k)
    b = torch.randn(n, generator=gen).to(dev, act)
    norm_w = (torch.rand(n, generator=gen) + 0.5).to(dev, act)
    quant = HalfPairs(X_DIV) if pairs_out else None
    kw = k // 8
    cfgs = [
        RowGemvConfig(64, tile_words_for(kw), 1, num_warps=8),
        RowGemvConfig(32, 16, 5, prefetch=True),
        RowGemvConfig(32, tile_words_for(kw), 2, num_warps=2, prefetch=True),  # 64 values a thread at 7b
    ]
    if normed_half2_config(n, kw, ws.num_sms) is not None:
        cfgs.append(None)
    for cfg in cfgs:
        for _ in range(2):
            x = (torch.randn(1, k, generator=gen) * 2).to(dev, act)
            residual = (torch.randn(1, n, generator=gen) * 4).to(dev, act)
            want_res = residual.clone()
            y = w4_half2_gemv(x, qw, b, ws, cfg or normed_half2_config(n, kw, ws.num_sms))
            want = rms_norm(y, norm_w, 1e-6, residual=want_res, quant=quant)
            got = w4_half2_normed(x, qw, b, ws, NormAfter(norm_w, 1e-6, residual, quant), cfg)
            assert torch.equal(residual, want_res), cfg
            if pairs_out:
                assert isinstance(got, PairedRows)
                got_pairs = got.pairs.view(torch.float16).float()
                torch.testing.assert_close(
                    got_pairs, want.pairs.view(torch.float16).float(), rtol=1e-2, atol=1e-3
                )
                got, want = got.x, want.x
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
            if INTERPRET:
                assert torch.equal(got, want), cfg
    assert int(ws.counters.abs().sum()) == 0
    with pytest.raises(ValueError, match="residual"):
        w4_half2_normed(x, qw, b, ws, NormAfter(norm_w, 1e-6, residual[:, 1:]), cfgs[0])


@pytest.mark.parametrize("num_warps", [2, 8])
def test_normed_tail_pairs_are_the_pairs_of_its_row(num_warps):
    """`w4_half2_normed` with `HalfPairs` out, launched many times: its pairs are, bit for bit, those of the
    normalized row it wrote (`HalfPairs` of x: (x[8w + p], x[8w + p + 4]) / X_DIV in fp16). On an H100 the
    tail once wrote a stale last word at N = 40 in one launch of four or five (35th session)."""
    from qwick.kernels.row_gemv import RowGemvConfig
    from qwick.kernels.row_gemv_half2 import X_DIV, tile_words_for, w4_half2_normed
    from qwick.layers.linear import HalfPairs, NormAfter

    dev = triton_device()
    ws = gemv_workspace(dev)
    act = torch.float16 if INTERPRET else torch.bfloat16
    n, k = 40, 768
    gen = torch.Generator().manual_seed(5)
    qw = rtn.quantize(torch.randn(n, k, generator=gen) / k**0.5, group_size=128).to(dev)
    norm_w = (torch.rand(n, generator=gen) + 0.5).to(dev, act)
    cfg = RowGemvConfig(32, tile_words_for(k // 8), 2, num_warps=num_warps)
    for _ in range(2 if INTERPRET else 40):
        x = (torch.randn(1, k, generator=gen) * 2).to(dev, act)
        residual = (torch.randn(1, n, generator=gen) * 4).to(dev, act)
        got = w4_half2_normed(x, qw, None, ws, NormAfter(norm_w, 1e-6, residual, HalfPairs(X_DIV)), cfg)
        want = (got.x.float() / X_DIV).half().view(-1, 2, 4).transpose(1, 2).reshape(1, -1)
        assert torch.equal(got.pairs.view(torch.float16), want)


def test_preload_fits_the_7b_qkv_and_o_only():
    """`preload_fits`: the default launches whose splits hold at most two tiles, without the prefetch: the
    7b QKV and o projections (K split 8: seven splits of two tiles and an empty one), not gate/up (14 tiles
    in one split) or down (the prefetch, 10 tiles a split)."""
    from qwick.kernels.row_gemv import RowGemvConfig
    from qwick.kernels.row_gemv_half2 import default_half2_config, preload_fits

    assert preload_fits(default_half2_config(4608, 448, 132), 448)
    assert preload_fits(default_half2_config(3584, 448, 132), 448)
    assert not preload_fits(default_half2_config(37888, 448, 132), 448)
    assert not preload_fits(default_half2_config(3584, 2368, 132), 2368)
    assert not preload_fits(RowGemvConfig(32, 16, 2, prefetch=True), 64)


PRELOAD_SHAPES = [(96, 512), (40, 768)] if INTERPRET else [(4608, 3584), (3584, 3584), (40, 768)]


@pytest.mark.parametrize("n,k", PRELOAD_SHAPES)
@pytest.mark.parametrize("paired", [False, True])
def test_preloaded_gemv_is_the_loop_gemv(n, k, paired):
    """`preload=True` (a split's first two tiles, or the prefetch's first, loaded before the wait; launched
    as a programmatic dependent launch on a GPU that has it) and `trigger=True`: the same bits as the tile
    loop, plain, with the norm in its tail and gated, for splits of two tiles, of one, of more (the loop
    goes on after the two), empty ones, and with the prefetch."""
    from qwick.kernels.row_gemv import RowGemvConfig
    from qwick.kernels.row_gemv_half2 import (
        X_DIV,
        default_half2_config,
        half_pairs,
        preload_fits,
        tile_words_for,
        w4_half2_gated,
        w4_half2_gemv,
        w4_half2_normed,
    )
    from qwick.layers.linear import HalfPairs, NormAfter

    dev, ws, act, gen, qw = _rtn_case(n, k, n + 3 * k)
    b = torch.randn(n, generator=gen).to(dev, act)
    norm_w = (torch.rand(n, generator=gen) + 0.5).to(dev, act)
    kw = k // 8
    bw = tile_words_for(kw)
    tiles = kw // bw
    cfgs = [
        default_half2_config(n, kw, ws.num_sms),
        RowGemvConfig(32, bw, triton.cdiv(tiles, 2)),  # two tiles a split (the last may hold one)
        RowGemvConfig(32, bw, tiles),  # one tile a split
        RowGemvConfig(64, bw, tiles + 1, num_warps=8),  # one tile a split and an empty split
        RowGemvConfig(16, 16, triton.cdiv(kw // 16, 2)),  # two 16-word tiles a split
        RowGemvConfig(16, 8, 1),  # the whole row in one split: 8-12 tiles, or 56 at 7b
        RowGemvConfig(32, 16, 5, prefetch=True),  # the prefetch, with an empty split at small K
        RowGemvConfig(32, bw, 2, num_warps=2, prefetch=True),
    ]
    assert sum(preload_fits(cfg, kw) for cfg in cfgs) >= 4
    for cfg in cfgs:
        early = {"preload": True, "trigger": True}
        x = (torch.randn(1, k, generator=gen) * 2).to(dev, act)
        pairs = half_pairs(x) if paired else None
        want = w4_half2_gemv(x, qw, b, ws, cfg, pairs=pairs)
        assert torch.equal(w4_half2_gemv(x, qw, b, ws, cfg, pairs=pairs, **early), want), cfg
        residual = (torch.randn(1, n, generator=gen) * 4).to(dev, act)
        res_a, res_b = residual.clone(), residual.clone()
        normed = w4_half2_normed(x, qw, b, ws, NormAfter(norm_w, 1e-6, res_a, HalfPairs(X_DIV)), cfg, pairs)
        norm_b = NormAfter(norm_w, 1e-6, res_b, HalfPairs(X_DIV))
        pre = w4_half2_normed(x, qw, b, ws, norm_b, cfg, pairs, **early)
        assert torch.equal(res_a, res_b) and torch.equal(pre.x, normed.x), cfg
        assert torch.equal(pre.pairs, normed.pairs), cfg
        if cfg.split_k == 1 and cfg.block_n % 16 == 0 and n % 16 == 0:  # a [gate | up] weight of n rows
            gated = w4_half2_gated(x, qw, b, ws, cfg, pairs, HalfPairs(X_DIV))
            pre = w4_half2_gated(x, qw, b, ws, cfg, pairs, HalfPairs(X_DIV), **early)
            assert torch.equal(pre.x, gated.x) and torch.equal(pre.pairs, gated.pairs), cfg
    assert int(ws.counters.abs().sum()) == 0
