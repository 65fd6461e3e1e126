"""The GPU W8A8 matmuls against dequantize-then-matmul in float64, on the same 8-bit codes. fp8 / int8 per
channel: for M <= 16 the skinny Triton GEMM on the 8-bit codes with unquantized activations (W8A16,
`qwick.kernels.gemv`), else `torch._scaled_mm` with row-wise scales / `torch._int_mm` then the scales (also
checked at M <= 16, zero rows padded for `_int_mm`), and for fp8 at 16 < M <= 256 where cuBLAS would leave SMs
idle, the split-K Triton GEMM `rowwise_fp8_mm`; fp8 128x128 blocks: the Triton block-scaled GEMM. cuBLAS's fp8
GEMMs accumulate fast (below fp32) where K <= 8192. Shapes: every linear layer of qwen2.5-7b and -14b, M from
1 (decode) to 4096 (a prefill chunk), bf16 activations with a bias. The only difference allowed is
accumulation order and precision, and the bf16 output's rounding.
Under TRITON_INTERPRET=1 (no GPU) the Triton kernels run on small shapes on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from qwick.kernels.codes import codes_of
from qwick.layers.linear import Linear
from qwick.quantization.w8a8 import (
    FP8_DTYPE,
    W8A8LinearMethod,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_blockwise,
)
from tests.triton_utils import INTERPRET, gemv_workspace
from tests.utils import QWEN_7B_14B_LINEAR_SHAPES, ROWS_1_TO_4096

pytestmark = pytest.mark.gpu

SHAPES = QWEN_7B_14B_LINEAR_SHAPES  # qwen2.5-7b then -14b: qkv, o, gate_up, down
MS = ROWS_1_TO_4096
MODES = {
    "fp8": dict(qdtype=FP8_DTYPE, checkpoint=False),
    "int8": dict(qdtype=torch.int8, checkpoint=False),
    "fp8-block": dict(qdtype=FP8_DTYPE, checkpoint=True, block=(128, 128), scale_name="weight_scale_inv"),
}
_layers: dict[tuple, Linear] = {}


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


def _layer(mode: str, n: int, k: int, device: torch.device) -> Linear:
    key = (mode, n, k)
    if key not in _layers:
        if len(_layers) >= 4:
            _layers.clear()
        method = W8A8LinearMethod(**MODES[mode])
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                layer = Linear(k, n, bias=True, method=method)
        finally:
            torch.set_default_dtype(torch.float32)
        gen = torch.Generator(device=device).manual_seed(n + k)
        w = torch.randn(n, k, generator=gen, device=device) * 0.02
        w[:, 7] *= 20  # an outlier column, as real activations/weights have
        method.load_dense(layer, w)
        layer.bias.data.normal_(0, 0.1, generator=gen)
        method.process_weights_after_loading(layer)
        _layers[key] = layer
    return _layers[key]


def _expected(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    method = layer.method
    n = layer.weight.shape[0]
    decode = x.shape[0] <= 16 and x.dtype != torch.float32 and method.skinny_gemm
    if method.block is None and decode and n < method.decode_quantize_min_n:
        x_deq = x.double()  # decode sizes: W8A16 (but in LM heads)
    elif method.block is None:
        xq, xs = quantize_per_token(x, method.qdtype)
        x_deq = xq.double() * xs.double()
    else:
        bk = method.block[1]
        xq, xs = quantize_per_token_group(x, method.qdtype, bk)
        x_deq = xq.double() * xs.double().repeat_interleave(bk, dim=1)[:, : x.shape[1]]
    return x_deq @ method.dense_weight(layer).double().T + layer.bias.double()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", MS)
def test_gpu_w8a8_matches_dequantized_float64(mode, n, k, m):
    device = _cuda()
    layer = _layer(mode, n, k, device)
    x = torch.randn(m, k, device=device, generator=torch.Generator(device=device).manual_seed(m))
    x = (x * torch.linspace(0.1, 3, k, device=device)).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert torch.isfinite(y).all()
    ref = _expected(layer, x)
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < 5e-3, f"relative error {rel:.2e}"  # bf16 output and bias rounding: ~2e-3
    worst = ((y.double() - ref).abs() / (ref.abs() + ref.abs().mean())).max().item()
    assert worst < 2e-2, f"worst element error {worst:.2e}"


@pytest.mark.parametrize("mode", ["fp8", "int8"])
@pytest.mark.parametrize("n,k", SHAPES[:4])
@pytest.mark.parametrize("m", [1, 7, 16])
def test_gpu_decode_sizes_with_codes_are_w8a8(mode, n, k, m, monkeypatch):
    """Decode-sized inputs that come with their codes (as the norm and SiLU kernels write them) go through
    the skinny GEMM as codes times codes: the per-token-quantized function, not W8A16's."""
    from qwick.kernels.w8a8 import quantize_rows
    from qwick.layers.linear import QuantizedRows
    from qwick.quantization.w8a8 import _MIN_AMAX, qmax

    device = _cuda()
    monkeypatch.setattr(W8A8LinearMethod, "decode_w8a8_max_k", 1 << 20)  # the down projection too
    layer = _layer(mode, n, k, device)
    assert layer.input_quant(torch.zeros(m, k, device=device, dtype=torch.bfloat16)) is not None
    x = torch.randn(m, k, device=device, generator=torch.Generator(device=device).manual_seed(m))
    x = (x * torch.linspace(0.1, 3, k, device=device)).to(torch.bfloat16)
    xq, xs = quantize_rows(x, layer.method.qdtype, qmax(layer.method.qdtype), _MIN_AMAX)
    y = layer(QuantizedRows(x, xq, xs))
    assert y.dtype == torch.bfloat16 and y.shape == (m, n) and torch.isfinite(y).all()
    ref = (xq.double() * xs.double()) @ layer.method.dense_weight(layer).double().T + layer.bias.double()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 5e-3
    w8a16 = x.double() @ layer.method.dense_weight(layer).double().T + layer.bias.double()
    assert ((y.double() - w8a16).norm() / w8a16.norm()).item() > 1e-3  # really the codes, not x


@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_gpu_one_o_projection_row_takes_the_row_gemv(mode, early, monkeypatch):
    """One decode row without codes at qwen2.5-7b's o projection: fp8 through the CUDA-core row GEMV
    (`qwick.kernels.row_gemv_w8`), int8 too where it launches early (`pdl_preload` on a GPU with PDL),
    else through the tensor-core W8A16 GEMV; all compute W8A16's function."""
    import qwick.kernels.row_gemv_w8 as row_gemv_w8
    from qwick.kernels.pdl import pdl_supported

    device = _cuda()
    calls = []
    real = row_gemv_w8.w8_row_gemv
    spy = lambda *a, **kw: calls.append(kw["preload"]) or real(*a, **kw)  # noqa: E731
    monkeypatch.setattr(row_gemv_w8, "w8_row_gemv", spy)
    layer = _layer(mode, 3584, 3584, device)
    monkeypatch.setattr(layer.method, "pdl_preload", early)
    x = torch.randn(1, 3584, device=device, generator=torch.Generator(device=device).manual_seed(1))
    x = (x * torch.linspace(0.1, 3, 3584, device=device)).to(torch.bfloat16)
    y = layer(x)
    ref = x.double() @ layer.method.dense_weight(layer).double().T + layer.bias.double()
    assert y.dtype == torch.bfloat16 and y.shape == (1, 3584)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 5e-3
    pdl = early and pdl_supported(device)
    assert calls == ([pdl] if mode == "fp8" or pdl else [])


@pytest.mark.parametrize("mode", ["fp8", "int8"])
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_decode_lm_head_quantizes_its_rows(mode, m, monkeypatch):
    """An LM-head-sized layer (qwen2.5-7b's 152064 x 3584) given decode-sized rows without codes quantizes
    them per token itself and multiplies codes by codes (W8A8), the function of every larger batch; with
    `decode_quantize_min_n` above its width it multiplies the rows as they are (W8A16)."""
    device = _cuda()
    layer = _layer(mode, 152064, 3584, device)
    x = torch.randn(m, 3584, device=device, generator=torch.Generator(device=device).manual_seed(m))
    x = (x * torch.linspace(0.1, 3, 3584, device=device)).to(torch.bfloat16)
    w = layer.method.dense_weight(layer).double()
    xq, xs = quantize_per_token(x, layer.method.qdtype)
    w8a8 = (xq.double() * xs.double()) @ w.T + layer.bias.double()
    w8a16 = x.double() @ w.T + layer.bias.double()

    def check(y: torch.Tensor, ref: torch.Tensor, other: torch.Tensor) -> None:
        assert y.dtype == torch.bfloat16 and y.shape == (m, 152064) and torch.isfinite(y).all()
        assert ((y.double() - ref).norm() / ref.norm()).item() < 5e-3
        assert ((y.double() - other).norm() / other.norm()).item() > 1e-3  # not the other function

    check(layer(x), w8a8, w8a16)
    monkeypatch.setattr(W8A8LinearMethod, "decode_quantize_min_n", 1 << 30)
    check(layer(x), w8a16, w8a8)


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_gpu_decode_long_inputs_take_group_scaled_codes(mode, monkeypatch):
    """A decode-sized input of a long-K layer (a down projection) asks for codes with a scale per
    `decode_group` columns, and the layer computes that function from them (W8A8, group scales)."""
    from qwick.kernels.elementwise import silu_and_mul
    from qwick.layers.linear import RowQuant
    from qwick.quantization.w8a8 import _MIN_AMAX, qmax

    device = _cuda()
    n, k = SHAPES[3]
    layer = _layer(mode, n, k, device)
    method = layer.method
    quant = layer.input_quant(torch.zeros(4, k, device=device, dtype=torch.bfloat16))
    assert quant == RowQuant(method.qdtype, qmax(method.qdtype), _MIN_AMAX, method.decode_group)
    h = torch.randn(4, 2 * k, device=device, generator=torch.Generator(device=device).manual_seed(9))
    rows = silu_and_mul(h.to(torch.bfloat16), quant)
    y = layer(rows)
    g = method.decode_group
    x_deq = rows.codes.double() * rows.scales.double().repeat_interleave(g, dim=1)[:, :k]
    ref = x_deq @ method.dense_weight(layer).double().T + layer.bias.double()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 5e-3
    monkeypatch.setattr(W8A8LinearMethod, "decode_group", 0)  # W8A16 for long inputs: no codes asked for
    assert layer.input_quant(rows.x) is None


@pytest.mark.parametrize("mode", ["fp8", "int8"])
@pytest.mark.parametrize("n,k", SHAPES[:4])
@pytest.mark.parametrize("m", [1, 7, 16])
def test_gpu_cublas_paths_at_decode_sizes(mode, n, k, m, monkeypatch):
    """With the skinny kernel off, decode-sized inputs go through `_scaled_mm` / padded `_int_mm`."""
    monkeypatch.setattr(W8A8LinearMethod, "skinny_gemm", False)
    test_gpu_w8a8_matches_dequantized_float64(mode, n, k, m)


@pytest.mark.parametrize("n,k", [SHAPES[0], SHAPES[3], SHAPES[5], SHAPES[7]])
@pytest.mark.parametrize("m", [17, 64, 128, 256])
@pytest.mark.parametrize("forced", [False, True])
def test_gpu_rowwise_fp8_in_the_layer(n, k, m, forced, monkeypatch):
    """The mid-M fp8 GEMM takes the down projections (K >= 12288) at 16 < M <= 256 and nothing else by
    default; forced on for every shape (K >= 0), it takes the narrow layers. Either way the result is
    the same function as `_scaled_mm`'s."""
    from qwick.kernels import w8a8 as kernels

    if forced:
        monkeypatch.setattr(W8A8LinearMethod, "rowwise_max_m", 256)
        monkeypatch.setattr(W8A8LinearMethod, "rowwise_min_k", 0)
    calls = []
    real = kernels.rowwise_fp8_mm
    monkeypatch.setattr(kernels, "rowwise_fp8_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    test_gpu_w8a8_matches_dequantized_float64("fp8", n, k, m)
    narrow = -(-m // 128) * -(-n // 128) < torch.cuda.get_device_properties(0).multi_processor_count
    assert bool(calls) == (narrow and (forced or k >= 12288))


def test_gpu_fast_accumulation_only_for_short_sums(monkeypatch):
    """bf16 fp8 layers ask cuBLAS for fast accumulation where K <= `fast_accum_max_k` (7b's QKV) and for
    exact sums over longer K (7b's down projection); the error bounds above hold for both."""
    device = _cuda()
    seen = []
    real = torch._scaled_mm
    monkeypatch.setattr(
        torch, "_scaled_mm", lambda *a, **kw: seen.append(kw["use_fast_accum"]) or real(*a, **kw)
    )
    m = W8A8LinearMethod.rowwise_max_m + 1  # above the mid-M rows that the split-K Triton GEMM takes
    for n, k in (SHAPES[0], SHAPES[3]):
        _layer("fp8", n, k, device)(torch.randn(m, k, device=device, dtype=torch.bfloat16))
    assert W8A8LinearMethod.fast_accum_max_k < SHAPES[3][1] and seen == [True, False]


def test_gpu_paths_are_the_fast_ones(monkeypatch):
    """The CUDA paths do not fall back to the reference at these shapes."""
    device = _cuda()
    for mode in MODES:
        layer = _layer(mode, 4608, 3584, device)
        monkeypatch.setattr(layer.method, "apply_reference", lambda *a, m=mode: pytest.fail(f"{m} fell back"))
        layer(torch.randn(3, 3584, device=device, dtype=torch.bfloat16))


@pytest.mark.interpret
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("n,k", [(256, 384), (200, 320)])
def test_block_kernel(m, n, k):
    """The Triton kernel alone; partial blocks along N and K (200 = 128 + 72, 320 = 2.5 x 128)."""
    if not INTERPRET:
        _cuda()
    from qwick.kernels.w8a8 import block_scaled_mm

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, generator=gen, device=device) * 0.02
    wq, ws = quantize_weight_blockwise(w, FP8_DTYPE, (128, 128))
    x = torch.randn(m, k, generator=gen, device=device)
    xq, xs = quantize_per_token_group(x, FP8_DTYPE, 128)
    y = block_scaled_mm(xq, xs, wq, ws, (128, 128), torch.float32)
    x_deq = xq.double() * xs.double().repeat_interleave(128, dim=1)[:, :k]
    w_deq = wq.double() * ws.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    torch.testing.assert_close(y.double(), x_deq @ w_deq.T, rtol=1e-5, atol=1e-5)


GEMV_SHAPES = [(96, 512), (40, 1100)] if INTERPRET else SHAPES


@pytest.mark.interpret
@pytest.mark.parametrize("qdtype", [FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("n,k", GEMV_SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gemv_on_8bit_weights(qdtype, n, k, m):
    """The skinny GEMM on 8-bit codes with per-channel scales (W8A16): default and forced split-K launch
    shapes (64 x 128 unsplit: the LM head's default), bias, a second call (the split-K counters reset
    themselves)."""
    from qwick.kernels.gemv import GemvConfig, default_config, gemv
    from qwick.quantization.w8a8 import quantize_weight_per_channel

    if INTERPRET:
        dev, x_dtype, tol = torch.device("cpu"), torch.float32, 1e-5
    else:
        dev, x_dtype, tol = _cuda(), torch.bfloat16, 5e-3
    ws = gemv_workspace(dev)
    gen = torch.Generator(device=dev).manual_seed(n * k + m)
    wq, wscale = quantize_weight_per_channel(torch.randn(n, k, generator=gen, device=dev), qdtype)
    bias = torch.randn(n, generator=gen, device=dev).to(x_dtype)
    default = default_config(m, n, k, ws.num_sms, w_bytes=1)
    for cfg in (default, GemvConfig(16, 128, 1), GemvConfig(32, 256, 4), GemvConfig(64, 128, 1)):
        for _ in range(2):
            x = torch.randn(m, k, generator=gen, device=dev).to(x_dtype)
            y = gemv(x, wq, bias, ws, cfg, weight_scale=wscale)
            ref = x.double() @ (wq.double() * wscale.double()).T + bias.double()
            assert y.dtype == x_dtype and torch.isfinite(y).all()
            assert ((y.double() - ref).norm() / ref.norm()).item() < tol, cfg
    assert int(ws.counters.abs().sum()) == 0


def _w8a8_gemv_case(qdtype: torch.dtype, n: int, k: int, m: int):
    """Device, output dtype, tolerance, workspace, generator, weight codes and scales, bias and the launch
    shapes to try for a W8A8 skinny-GEMM test (the interpreter computes in float32)."""
    from qwick.kernels.gemv import GemvConfig, default_config
    from qwick.quantization.w8a8 import quantize_weight_per_channel

    if INTERPRET:
        dev, out_dtype, tol = torch.device("cpu"), torch.float32, 1e-6
    else:
        dev, out_dtype, tol = _cuda(), torch.bfloat16, 5e-3
    ws = gemv_workspace(dev)
    gen = torch.Generator(device=dev).manual_seed(n * k + m + 1)
    wq, wscale = quantize_weight_per_channel(torch.randn(n, k, generator=gen, device=dev), qdtype)
    bias = torch.randn(n, generator=gen, device=dev).to(out_dtype)
    default = default_config(m, n, k, ws.num_sms, w_bytes=1, codes=True)
    configs = (default, GemvConfig(16, 128, 1), GemvConfig(32, 256, 4))
    return dev, out_dtype, tol, ws, gen, wq, wscale, bias, configs


def _check(y: torch.Tensor, ref: torch.Tensor, m: int, n: int, out_dtype: torch.dtype, tol: float, cfg):
    """The output's dtype, shape and finiteness, and its relative error against float64 `ref`."""
    assert y.dtype == out_dtype and y.shape == (m, n) and torch.isfinite(y).all()
    assert ((y.double() - ref).norm() / ref.norm()).item() < tol, cfg


@pytest.mark.interpret
@pytest.mark.parametrize("qdtype", [FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("n,k", GEMV_SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gemv_on_8bit_codes_both_sides(qdtype, n, k, m):
    """The skinny GEMM with activation codes too (W8A8): codes times codes, then the per-row and
    per-channel scales and the bias; int8 sums exact; split-K launch shapes; a second call."""
    from qwick.kernels.gemv import gemv

    dev, out_dtype, tol, ws, gen, wq, wscale, bias, configs = _w8a8_gemv_case(qdtype, n, k, m)
    for cfg in configs:
        for _ in range(2):
            xq, xs = quantize_per_token(torch.randn(m, k, generator=gen, device=dev), qdtype)
            y = gemv(xq, wq, bias, ws, cfg, weight_scale=wscale, x_scale=xs, out_dtype=out_dtype)
            ref = (xq.double() @ wq.double().T) * xs.double() * wscale.double().view(1, -1) + bias.double()
            _check(y, ref, m, n, out_dtype, tol, cfg)
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.interpret
@pytest.mark.parametrize("qdtype", [FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("n,k", [(96, 1536), (40, 1100)] if INTERPRET else [(3584, 18944), (5120, 13824)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gemv_with_group_scaled_codes(qdtype, n, k, m):
    """W8A8 skinny GEMM with a scale per 512 columns of x (`x_group`): each tile's sums scaled by its
    group's scale; split-K launches; a partial last group (1100); a second call; tiles deeper than a
    group are refused."""
    from qwick.kernels.gemv import GemvConfig, gemv

    dev, out_dtype, tol, ws, gen, wq, wscale, bias, configs = _w8a8_gemv_case(qdtype, n, k, m)
    for cfg in configs:
        for _ in range(2):
            x = torch.randn(m, k, generator=gen, device=dev) * torch.linspace(0.1, 5, k, device=dev)
            xq, xs = quantize_per_token_group(x, qdtype, 512)
            y = gemv(xq, wq, bias, ws, cfg, weight_scale=wscale, x_scale=xs, out_dtype=out_dtype, x_group=512)
            x_deq = xq.double() * xs.double().repeat_interleave(512, dim=1)[:, :k]
            ref = (x_deq @ wq.double().T) * wscale.double().view(1, -1) + bias.double()
            _check(y, ref, m, n, out_dtype, tol, cfg)
    with pytest.raises(ValueError, match="divide"):
        gemv(xq, wq, bias, ws, GemvConfig(16, 1024, 1), weight_scale=wscale, x_scale=xs, out_dtype=out_dtype,
             x_group=512)  # fmt: skip
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.interpret
@pytest.mark.parametrize("qdtype", [FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("inter,k", [(80, 512)] if INTERPRET else [(18944, 3584), (13824, 5120)])
@pytest.mark.parametrize("m", [1, 3])
def test_gated_w8a8_gemv_writes_silu_and_muls_group_codes(qdtype, inter, k, m):
    """`gemv(..., gated=True, out_quant=...)`: the last tile of each group of outputs to finish writes the
    group's codes and scale, bit for bit what `silu_and_mul_quant` with groups writes from the plain GEMV
    (a partial last group under the interpreter), twice in a row (the group counters reset themselves),
    launched early or not; groups that tiles do not divide, and codes of an ungated GEMV, are refused."""
    from dataclasses import replace

    from qwick.kernels.elementwise import silu_and_mul_quant
    from qwick.kernels.gemv import GemvConfig, gemv
    from qwick.layers.linear import RowQuant
    from qwick.quantization.w8a8 import _MIN_AMAX, qmax

    if INTERPRET and qdtype == FP8_DTYPE:
        pytest.skip("the interpreter's fp32 -> fp8 conversion is wrong near powers of two (127.9 -> 64)")
    dev, out_dtype, _, ws, gen, wq, wscale, bias, _ = _w8a8_gemv_case(qdtype, 2 * inter, k, m)
    cfg = ws.config_for(m, 2 * inter, k, 1, codes=True) if not INTERPRET else GemvConfig(32, 128, 1)
    group = 32 if INTERPRET else 512
    quant = RowQuant(qdtype, qmax(qdtype), _MIN_AMAX, group)
    for early in (False, True):  # twice: the group counters reset themselves
        xq, xs = quantize_per_token(torch.randn(m, k, generator=gen, device=dev), qdtype)
        codes = dict(weight_scale=wscale, x_scale=xs, out_dtype=out_dtype)
        want = silu_and_mul_quant(gemv(xq, wq, bias, ws, cfg, **codes), quant)
        got = gemv(xq, wq, bias, ws, cfg, **codes, gated=True, out_quant=quant, preload=early, trigger=early)
        assert got.group == group and torch.equal(got.x, want.x) and torch.equal(got.scales, want.scales)
        assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
        assert int(ws.counters.abs().sum()) == 0
    with pytest.raises(ValueError, match="must divide"):
        gemv(xq, wq, bias, ws, cfg, **codes, gated=True, out_quant=replace(quant, group=cfg.block_n // 4))
    with pytest.raises(ValueError, match="only a gated GEMV"):
        gemv(xq, wq, bias, ws, cfg, **codes, out_quant=quant)


@pytest.mark.interpret
@pytest.mark.parametrize("qdtype", [FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("n,k", [(96, 1024), (40, 1100)] if INTERPRET else [(4608, 3584), (3584, 18944)])
@pytest.mark.parametrize("group", [None, 512])
def test_preloaded_gemv_gives_the_same_bits(qdtype, n, k, group):
    """`gemv(..., preload=True, trigger=True)` (launched early where the device has programmatic dependent
    launch, each split's first weight tile loaded before it waits, the next kernel let in after its loop):
    the plain launch's bits for one row of W8A8 codes per row or per 512 columns and for W8A16, at split-K
    launches whose splits end mid-tile (1100) and one with empty splits (8 splits of 256 columns over
    1024: no preload there, it would read past K)."""
    from qwick.kernels.gemv import GemvConfig, gemv

    dev, out_dtype, _, ws, gen, wq, wscale, bias, configs = _w8a8_gemv_case(qdtype, n, k, 1)
    for cfg in (*configs, GemvConfig(32, 256, 8)):
        x = torch.randn(1, k, generator=gen, device=dev)
        if group is None:
            xq, xs = quantize_per_token(x, qdtype)
        else:
            xq, xs = quantize_per_token_group(x, qdtype, group)
        codes = dict(weight_scale=wscale, x_scale=xs, out_dtype=out_dtype, x_group=group)
        plain = gemv(xq, wq, bias, ws, cfg, **codes)
        early = gemv(xq, wq, bias, ws, cfg, **codes, preload=True, trigger=True)
        assert torch.equal(plain, early), cfg
        x16 = x.to(out_dtype)
        plain = gemv(x16, wq, bias, ws, cfg, weight_scale=wscale)
        assert torch.equal(plain, gemv(x16, wq, bias, ws, cfg, weight_scale=wscale, preload=True)), cfg
    assert int(ws.counters.abs().sum()) == 0


QUANT_SHAPES = [(1, 300), (5, 2100)] if INTERPRET else [(1, 3584), (5, 300), (33, 18944)]


@pytest.mark.interpret
@pytest.mark.parametrize("qdtype", [FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("m,k", QUANT_SHAPES)
def test_quantize_rows_is_bit_identical_to_torch(qdtype, group, m, k):
    """The fused activation quantization gives the torch reference's codes and scales bit for bit, ties
    (x / scale exactly between two integers) included."""
    from qwick.kernels.w8a8 import quantize_rows
    from qwick.quantization.w8a8 import _MIN_AMAX, qmax

    if INTERPRET and qdtype == FP8_DTYPE:
        pytest.skip("the interpreter's fp32 -> fp8 conversion is wrong near powers of two (127.9 -> 64)")
    dev = torch.device("cpu") if INTERPRET else _cuda()
    x = torch.randn(m, k, generator=torch.Generator(device=dev).manual_seed(k), device=dev) * 10
    x[0, 0] = 127.0  # absmax 127: the int8 scale is 1, and these are exact ties
    x[0, 1:6] = torch.tensor([0.5, 1.5, 2.5, -1.5, 0.0])
    x = x.to(torch.bfloat16)
    if m > 1:
        x[1] = 0.0  # an all-zero row
    q, s = quantize_rows(x, qdtype, qmax(qdtype), _MIN_AMAX, group)
    if group is None:
        q_ref, s_ref = quantize_per_token(x, qdtype)
    else:
        q_ref, s_ref = quantize_per_token_group(x, qdtype, group)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.interpret
@pytest.mark.parametrize("qdtype", [FP8_DTYPE, torch.int8])
def test_codes_of_every_bf16_value_are_torchs(qdtype):
    """`codes_of` divides by the scale through its reciprocal and an fma correction: every finite bf16
    value (both signs) quantized in rows whose absmax spans the range, including the ones that make the
    int8 scale 1 (ties) and the smallest scales, gives torch's codes bit for bit."""
    from qwick.kernels.w8a8 import quantize_rows
    from qwick.quantization.w8a8 import _MIN_AMAX, qmax

    if INTERPRET and qdtype == FP8_DTYPE:
        pytest.skip("the interpreter's fp32 -> fp8 conversion is wrong near powers of two (127.9 -> 64)")
    dev = torch.device("cpu") if INTERPRET else _cuda()
    finite = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    # and bf16 absmaxes drawn from 1e-10 up: about one in six makes x * (1 / scale) round some code wrong
    drawn = torch.randint(
        0x2EDC, 0x7F7F, (24,), generator=torch.Generator().manual_seed(0), dtype=torch.int32
    )
    amaxes = [127.0, 448.0, 1.0, 3.0e38, 1.1e-10] + drawn.to(torch.int16).view(torch.bfloat16).tolist()
    rows = []
    for amax in amaxes:
        values = finite[finite <= amax]
        row = torch.zeros(2 * finite.numel() + 1)
        row[: values.numel()] = values
        row[values.numel() : 2 * values.numel()] = -values
        row[-1] = torch.tensor(amax).to(torch.bfloat16).float()
        rows.append(row)
    x = torch.stack(rows).to(torch.bfloat16).to(dev)
    q, s = quantize_rows(x, qdtype, qmax(qdtype), _MIN_AMAX)
    q_ref, s_ref = quantize_per_token(x, qdtype)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@triton.jit
def _fp8_quotients(x_ptr, s_ptr, q_ptr, N, BLOCK: tl.constexpr):
    """`codes_of`'s fp32 values at fp8's qmax for rows of x, one scale a row."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * N + cols, mask=cols < N)
    tl.store(q_ptr + row * N + cols, codes_of(x, tl.load(s_ptr + row), 448.0, False), mask=cols < N)


@pytest.mark.interpret
def test_codes_of_quotients_are_divisions_with_the_sign_of_zero():
    """`codes_of`'s fp32 quotients at fp8's qmax (before any fp8 conversion, which the interpreter gets
    wrong) are IEEE division's bit for bit, sign included: -0.0 must stay -0.0, whose fp8 code (0x80) is
    not +0's. Below 1e-20 (subnormal x, or the remainder underflowing) only the sign must agree: every
    code there is 0. A first corrected form took the remainder as x - q * scale, which sums +0 and -0 to
    +0, and passed every int8 test; only the fp8 GPU tests saw it."""
    from qwick.kernels.codes import inv_qmax
    from tests.triton_utils import triton_device

    dev = triton_device()
    finite = torch.arange(0, 0x7F80, 97, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    values = torch.cat([finite, -finite, torch.tensor([0.0, -0.0, 1e-40, -1e-40])])
    amaxes = torch.tensor([448.0, 1.0, 3.0e38, 1e-10, 7.5])
    x = torch.where(values.abs() <= amaxes[:, None], values, 0.0).to(dev)  # the last four in every row
    scales = (amaxes * inv_qmax(448.0)).to(dev)
    q = torch.empty_like(x)
    _fp8_quotients[(x.shape[0],)](x, scales, q, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]))
    want = (x / scales[:, None]).clamp(-448.0, 448.0)
    assert torch.signbit(want[:, -3]).all() and torch.signbit(q[:, -3]).all()
    tiny = want.abs() < 1e-20  # where the remainder underflows: codes 0 either way, but of the same sign
    assert torch.equal(q[~tiny].view(torch.int32), want[~tiny].view(torch.int32))
    assert torch.equal(torch.signbit(q), torch.signbit(want)) and bool((q[tiny].abs() < 1e-20).all())


ROWWISE_CASES = (
    [(17, 96, 384), (70, 200, 1100), (130, 64, 256)]
    if INTERPRET
    else [
        (17, 3584, 18944),
        (64, 4608, 3584),
        (100, 37888, 3584),
        (192, 3584, 18944),
        (256, 3584, 3584),
        (256, 5120, 13824),
    ]
)


@pytest.mark.interpret
@pytest.mark.parametrize("m,n,k", ROWWISE_CASES)
def test_rowwise_fp8_mm(m, n, k):
    """The mid-M fp8 GEMM (per-token x per-channel scales, split-K) against float64 on the same codes: the
    default launch shape and forced ones (no split; a 4-way split; tiles loaded through TMA), with and
    without a bias, twice (the split-K counters reset themselves); partial row, column and K tiles
    included."""
    from qwick.kernels.w8a8 import RowwiseConfig, rowwise_config, rowwise_fp8_mm
    from qwick.quantization.w8a8 import quantize_weight_per_channel

    dev = torch.device("cpu") if INTERPRET else _cuda()
    ws = gemv_workspace(dev)
    gen = torch.Generator(device=dev).manual_seed(m * n + k)
    wq, wscale = quantize_weight_per_channel(torch.randn(n, k, generator=gen, device=dev) * 0.02, FP8_DTYPE)
    out_dtype = torch.float32 if INTERPRET else torch.bfloat16
    tol = 1e-5 if INTERPRET else 5e-3
    forced = [RowwiseConfig(64, 128, 128, 1, 4, 3), RowwiseConfig(64, 64, 128, 4, 4, 3)]
    tma = RowwiseConfig(64, 64, 128, 2, 4, 3, tma=True)  # tensor descriptors: rows of whole 16-byte units
    if k % 16 == 0:
        forced.append(tma)
    else:
        with pytest.raises(ValueError, match="16-byte"):
            rowwise_fp8_mm(*quantize_per_token(torch.ones(m, k, device=dev), FP8_DTYPE), wq, wscale, None, ws,
                           torch.float32, tma)  # fmt: skip
    # a forced split runs only where the shared workspace holds its partials (the default lowers its
    # split until it does; an oversized one must be refused, not write past the buffer)
    tiles_m = -(-m // 64)
    fits = [c for c in forced if ws.fits(c.split_k, tiles_m * 64, n, tiles_m * -(-n // c.block_n))]
    for cfg in forced:
        if cfg not in fits:
            with pytest.raises(ValueError, match="workspace too small"):
                rowwise_fp8_mm(
                    *quantize_per_token(torch.ones(m, k, device=dev), FP8_DTYPE),
                    wq,
                    wscale,
                    None,
                    ws,
                    out_dtype,
                    cfg,
                )
    configs = [rowwise_config(m, n, k, ws), *fits]
    for cfg in configs:
        for bias in (None, torch.randn(n, generator=gen, device=dev).to(out_dtype)):
            x = torch.randn(m, k, generator=gen, device=dev) * torch.linspace(0.1, 3, k, device=dev)
            xq, xs = quantize_per_token(x, FP8_DTYPE)
            y = rowwise_fp8_mm(xq, xs, wq, wscale, bias, ws, out_dtype, cfg)
            ref = (xq.double() @ wq.double().T) * xs.double() * wscale.double().view(1, -1)
            if bias is not None:
                ref += bias.double()
            assert y.dtype == out_dtype and y.shape == (m, n) and torch.isfinite(y).all()
            assert ((y.double() - ref).norm() / ref.norm()).item() < tol, cfg
    if k % 16 == 0:  # codes viewed out of a wider buffer (rows of K + 8 bytes): no tensor descriptor fits
        xq, xs = quantize_per_token(torch.randn(m, k + 8, generator=gen, device=dev), FP8_DTYPE)
        xq, ref = xq[:, :k], (xq[:, :k].double() @ wq.double().T) * xs.double() * wscale.double().view(1, -1)
        y = rowwise_fp8_mm(xq, xs, wq, wscale, None, ws, out_dtype)  # the default falls back to plain loads
        assert ((y.double() - ref).norm() / ref.norm()).item() < tol
        with pytest.raises(ValueError, match="16-byte"):
            rowwise_fp8_mm(xq, xs, wq, wscale, None, ws, out_dtype, tma)
    assert int(ws.counters.abs().sum()) == 0
