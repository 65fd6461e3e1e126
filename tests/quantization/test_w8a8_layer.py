"""The W8A8 linear method on its own: quantization error bounds, the reference matmul against an explicit
dequantize-then-matmul in float64, loading scales into packed shards, on-the-fly quantization's memory,
dummy weights."""

from __future__ import annotations

import pytest
import torch

from qwick.layers.linear import Linear
from qwick.quantization.w8a8 import (
    FP8_DTYPE,
    W8A8LinearMethod,
    expand_block_scales,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_blockwise,
    quantize_weight_per_channel,
)

QDTYPES = [FP8_DTYPE, torch.int8]


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3, 5] = 1.5  # an outlier: its row's scale is large, the rest of the row lands in small codes
    w[7] = 0.0  # an all-zero row
    return w


def _bound(w: torch.Tensor, scale: torch.Tensor, qdtype: torch.dtype) -> torch.Tensor:
    """Largest rounding error of symmetric absmax quantization, per element.

    int8: half a step. fp8 e4m3: half an ulp, 2^-4 of the value for normal codes (3 mantissa bits), and half
    the subnormal spacing 2^-9 (in units of the scale) below 2^-6.
    """
    if qdtype == torch.int8:
        return scale * 0.5 * (1 + 1e-6)
    return torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_per_channel_weight_error_bound(qdtype):
    w = _weight(64, 96)
    q, s = quantize_weight_per_channel(w, qdtype)
    assert q.dtype == qdtype and s.shape == (64, 1) and s.dtype == torch.float32
    assert (q[7].float() == 0).all() and torch.isfinite(s).all()
    err = (q.float() * s - w).abs()
    assert (err <= _bound(w, s, qdtype)).all()
    assert q.float().abs().amax(dim=1)[:7].min() >= (127 if qdtype == torch.int8 else 448)  # absmax hits qmax


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_per_token_and_group_activation_error_bound(qdtype):
    x = _weight(9, 300, seed=1) * 40
    q, s = quantize_per_token(x, qdtype)
    assert s.shape == (9, 1)
    assert ((q.float() * s - x).abs() <= _bound(x, s, qdtype)).all()
    q, s = quantize_per_token_group(x, qdtype, 128)  # 300 = 128 + 128 + 44
    assert s.shape == (9, 3) and q.shape == (9, 300)
    full = s.repeat_interleave(128, dim=1)[:, :300]
    assert ((q.float() * full - x).abs() <= _bound(x, full, qdtype)).all()
    assert full[3, 0] != full[3, 200]  # each group has its own scale


def test_block_weight_error_bound():
    w = _weight(300, 200)
    q, s = quantize_weight_blockwise(w, FP8_DTYPE, (128, 128))
    assert s.shape == (3, 2)
    full = expand_block_scales(s, (300, 200), (128, 128))
    assert ((q.float() * full - w).abs() <= _bound(w, full, FP8_DTYPE)).all()
    assert s[0, 0] == w[:128, :128].abs().max() * (1.0 / 448)


def _layer(method: W8A8LinearMethod, n: int, k: int, bias: bool, dtype=torch.float32) -> Linear:
    torch.set_default_dtype(dtype)
    try:
        layer = Linear(k, [n - 32, 32], bias=bias, method=method)
    finally:
        torch.set_default_dtype(torch.float32)
    w = _weight(n, k)
    method.load_dense(layer, w)
    if bias:
        layer.bias.data.copy_(torch.linspace(-1, 1, n))
    method.process_weights_after_loading(layer)
    return layer


def _fake_quant(x: torch.Tensor, qdtype: torch.dtype, group: int | None) -> torch.Tensor:
    if group is None:
        q, s = quantize_per_token(x, qdtype)
        return q.double() * s.double()
    q, s = quantize_per_token_group(x, qdtype, group)
    return q.double() * s.double().repeat_interleave(group, dim=1)[:, : x.shape[1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize(
    "qdtype,block,checkpoint",
    [(FP8_DTYPE, None, False), (torch.int8, None, False), (FP8_DTYPE, (128, 128), True)],
)
def test_reference_is_dequantize_then_matmul(qdtype, block, checkpoint, m, dtype):
    n, k = 256 + 32, 320
    method = W8A8LinearMethod(qdtype, checkpoint=checkpoint, block=block)
    layer = _layer(method, n, k, bias=True, dtype=dtype)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (m, n)
    expected = _fake_quant(x, qdtype, block[1] if block else None) @ method.dense_weight(layer).double().T
    expected += layer.bias.double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output rounding (and the product's)
    err = ((y.double() - expected).norm() / expected.norm()).item()
    assert err < tol


def test_on_the_fly_keeps_no_plain_copy():
    method = W8A8LinearMethod(FP8_DTYPE, checkpoint=False)
    layer = Linear(96, [32, 32], method=method)
    assert layer.weight.dtype == torch.float32  # plain while the checkpoint loads
    layer.load_shard("weight", _weight(32, 96), 0)
    layer.load_shard("weight", _weight(32, 96, seed=3), 1)
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (64, 1)
    assert layer.weight.untyped_storage().nbytes() == 64 * 96  # one byte per weight, nothing kept beside it
    assert {n for n, _ in layer.named_parameters()} == {"weight", "weight_scale"}


def test_scales_load_into_their_shards():
    method = W8A8LinearMethod(torch.int8, checkpoint=True)
    layer = Linear(16, [8, 4, 4], method=method)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (16, 1)
    layer.load_shard("weight_scale", torch.full((8, 1), 2.0, dtype=torch.bfloat16), 0)
    layer.load_shard("weight_scale", torch.tensor(3.0), 1)  # per tensor: fills the shard's rows
    layer.load_shard("weight_scale", torch.full((4,), 4.0), 2)  # [N] instead of [N, 1]
    assert layer.weight_scale.squeeze(1).tolist() == [2.0] * 8 + [3.0] * 4 + [4.0] * 4
    assert layer.method.load_extra(layer, "input_scale", torch.tensor(0.1), 0)  # static scales: unused
    layer.load_shard("weight_zero_point", torch.zeros(4, 1, dtype=torch.int8), 1)
    with pytest.raises(ValueError, match="asymmetric"):
        layer.load_shard("weight_zero_point", torch.ones(4, 1, dtype=torch.int8), 1)
    with pytest.raises(ValueError, match="bfloat16 but the model stores it as torch.int8"):
        layer.load_shard("weight", torch.zeros(8, 16, dtype=torch.bfloat16), 0)
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.load_shard("weight_scale", torch.ones(5, 1), 0)


def test_block_scales_load_by_row_blocks():
    method = W8A8LinearMethod(FP8_DTYPE, checkpoint=True, block=(128, 128), scale_name="weight_scale_inv")
    layer = Linear(200, [256, 128, 128], method=method)
    assert layer.weight_scale_inv.shape == (4, 2)
    for shard, rows in enumerate((2, 1, 1)):
        layer.load_shard("weight_scale_inv", torch.full((rows, 2), float(shard + 1)), shard)
    assert layer.weight_scale_inv[:, 0].tolist() == [1.0, 1.0, 2.0, 3.0]
    misaligned = Linear(200, [64, 64], method=W8A8LinearMethod(FP8_DTYPE, checkpoint=True, block=(128, 128)))
    with pytest.raises(ValueError, match="whole blocks"):
        misaligned.load_shard("weight_scale", torch.ones(1, 2), 1)


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("m", [1, 16, 17, 40])
def test_cuda_path_logic_on_cpu(qdtype, m):
    """The CUDA path's calls (`_scaled_mm` row-wise scales and W transposed, `_int_mm` with zero-row padding
    below 17 rows) run on CPU builds of torch too: same function as the reference, up to the bf16 output.
    The GPU kernels themselves are checked in tests/kernels/test_w8a8_kernels.py."""
    method = W8A8LinearMethod(qdtype, checkpoint=False)
    layer = _layer(method, 288, 320, bias=True, dtype=torch.bfloat16)
    x = (torch.randn(m, 320, generator=torch.Generator().manual_seed(4)) * 3).to(torch.bfloat16)
    try:
        y = method._apply_cuda(layer, x)
    except (RuntimeError, NotImplementedError) as e:  # a CPU build without these kernels
        pytest.skip(f"this torch has no CPU {qdtype} GEMM: {e}")
    ref = method.apply_reference(layer, x.float())
    assert y.dtype == torch.bfloat16 and y.shape == (m, 288)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 5e-3


@pytest.mark.parametrize("refuse", [False, True])
def test_fp8_gemm_fuses_a_bf16_bias_or_adds_it_after(refuse, monkeypatch):
    """`_scaled_mm` takes the QKV bias in its epilogue; where the installed torch refuses a bias, every layer
    adds it after the GEMM from then on (the next layer does not ask again). Either way the output is the
    reference's."""
    monkeypatch.setattr(W8A8LinearMethod, "scaled_mm_bias", True)  # restored after the test
    method = W8A8LinearMethod(FP8_DTYPE, checkpoint=False)
    layer = _layer(method, 288, 320, bias=True, dtype=torch.bfloat16)
    other = W8A8LinearMethod(FP8_DTYPE, checkpoint=False)
    other_layer = _layer(other, 288, 320, bias=True, dtype=torch.bfloat16)
    x = (torch.randn(40, 320, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16)
    real, biases = torch._scaled_mm, []

    def scaled_mm(*args, **kwargs):
        biases.append(kwargs.get("bias") is not None)
        if refuse and kwargs.get("bias") is not None:
            raise RuntimeError("Bias is not supported")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    try:
        outs = [method._apply_cuda(layer, x) for _ in range(2)]
        other_out = other._apply_cuda(other_layer, x)
    except (RuntimeError, NotImplementedError) as e:  # a CPU build without the fp8 GEMM
        pytest.skip(f"this torch has no CPU fp8 GEMM: {e}")
    ref = method.apply_reference(layer, x.float())
    for y in outs:
        assert ((y.float() - ref).norm() / ref.norm()).item() < 5e-3
    other_ref = other.apply_reference(other_layer, x.float())
    assert ((other_out.float() - other_ref).norm() / other_ref.norm()).item() < 5e-3
    assert biases == ([True, False, False, False] if refuse else [True, True, True])
    assert other.scaled_mm_bias is not refuse


def test_fp8_gemm_out_of_memory_is_not_a_refused_bias(monkeypatch):
    """An out-of-memory error inside the biased GEMM propagates; bias fusion stays on."""
    monkeypatch.setattr(W8A8LinearMethod, "scaled_mm_bias", True)
    method = W8A8LinearMethod(FP8_DTYPE, checkpoint=False)
    layer = _layer(method, 288, 320, bias=True, dtype=torch.bfloat16)
    x = torch.randn(40, 320).to(torch.bfloat16)

    def scaled_mm(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    with pytest.raises(torch.OutOfMemoryError):
        method._apply_cuda(layer, x)
    assert W8A8LinearMethod.scaled_mm_bias


def test_cpu_int8_decode_rows_take_the_int8_weight_gemm(monkeypatch):
    """On the CPU, int8 per-channel layers run bf16 inputs of at most 16 rows as W8A16 through torch's int8
    weight GEMM (as GPUs do at decode sizes); more rows, other K or dtypes keep the W8A8 reference."""
    if not hasattr(torch, "_weight_int8pack_mm"):
        pytest.skip("this torch has no CPU int8 weight GEMM")
    calls = []
    real = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    method = W8A8LinearMethod(torch.int8, checkpoint=False)
    layer = _layer(method, 288, 384, bias=True, dtype=torch.bfloat16)
    w16 = method.dense_weight(layer).double()
    for m in (1, 16, 17):
        x = (torch.randn(m, 384, generator=torch.Generator().manual_seed(m)) * 3).to(torch.bfloat16)
        y = layer(x)
        exact = x.double() @ w16.T + layer.bias.double()  # W8A16
        rel = ((y.double() - exact).norm() / exact.norm()).item()
        assert y.dtype == torch.bfloat16 and rel < (1e-2 if m <= 16 else 3e-2), (m, rel)
    assert calls == [1, 16]
    odd_k = _layer(W8A8LinearMethod(torch.int8, checkpoint=False), 288, 336, bias=False, dtype=torch.bfloat16)
    odd_k(torch.randn(1, 336).to(torch.bfloat16))  # K % 64 != 0 (K % 16 != 0 crashes the kernel): not taken
    fp8 = _layer(W8A8LinearMethod(FP8_DTYPE, checkpoint=False), 288, 384, bias=False, dtype=torch.bfloat16)
    fp8(torch.randn(1, 384).to(torch.bfloat16))
    assert calls == [1, 16]


def test_mid_m_fp8_gemm_takes_only_long_k_at_17_to_256_rows():
    """The routing rule measured on the H200: the split-K Triton fp8 GEMM serves per-channel fp8 layers with
    K >= 12288 (the down projections) at 16 < M <= 256 rows in bf16/fp16, and nothing else."""
    from types import SimpleNamespace

    fp8 = W8A8LinearMethod(FP8_DTYPE, checkpoint=False)
    fp8.workspace = SimpleNamespace(num_sms=132)  # what loading on an H200 sets up
    rows = lambda m, dtype=torch.bfloat16: torch.zeros(m, 8, dtype=dtype)  # noqa: E731
    assert fp8._rowwise(rows(17), 3584, 18944) and fp8._rowwise(rows(256), 3584, 18944)
    assert fp8._rowwise(rows(64, torch.float16), 5120, 13824)
    assert not fp8._rowwise(rows(16), 3584, 18944)  # decode sizes: the skinny GEMM
    assert not fp8._rowwise(rows(257), 3584, 18944)  # cuBLAS ties or wins from here
    assert not fp8._rowwise(rows(64), 4608, 3584)  # short K: cuBLAS wins
    assert not fp8._rowwise(rows(64, torch.float32), 3584, 18944)
    int8 = W8A8LinearMethod(torch.int8, checkpoint=False)
    int8.workspace = fp8.workspace
    assert not int8._rowwise(rows(64), 3584, 18944)


def test_one_fp8_decode_row_without_codes_takes_the_row_gemv():
    """The routing rule measured on the H200: one fp8 row (the o projection's input, which comes without
    codes) in a layer narrower than `row_gemv_max_n` with K <= `decode_w8a8_max_k` in 128-code tiles goes
    to `qwick.kernels.row_gemv_w8`; int8, LM heads, several rows, long or odd K keep the W8A16 GEMV."""
    fp8 = W8A8LinearMethod(FP8_DTYPE, checkpoint=False)
    row = lambda k, m=1: torch.zeros(m, k, dtype=torch.bfloat16)  # noqa: E731
    assert fp8._row_gemv(row(3584), 3584, 3584) and fp8._row_gemv(row(896), 896, 896)
    assert not W8A8LinearMethod(torch.int8, checkpoint=False)._row_gemv(row(3584), 3584, 3584)
    assert not fp8._row_gemv(row(3584), 152064, 3584)  # an LM head
    assert not fp8._row_gemv(row(3584, 2), 3584, 3584)
    assert not fp8._row_gemv(row(18944), 3584, 18944)  # a down projection: not measured
    assert not fp8._row_gemv(row(200), 3584, 200)
    fp8.row_gemv_max_n = 0
    assert not fp8._row_gemv(row(3584), 3584, 3584)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_codes_from_the_producing_kernel_are_used_as_given(qdtype):
    """Codes a norm or SiLU kernel wrote (`QuantizedRows`) replace the layer's own quantization: the same
    output when they are the same codes, a different one when they are not (so they are really read)."""
    method = W8A8LinearMethod(qdtype, checkpoint=False)
    layer = _layer(method, 288, 320, bias=True, dtype=torch.bfloat16)
    x = (torch.randn(40, 320, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16)
    try:
        own = method._apply_cuda(layer, x)
    except (RuntimeError, NotImplementedError) as e:  # a CPU build without these kernels
        pytest.skip(f"this torch has no CPU {qdtype} GEMM: {e}")
    codes, scales = quantize_per_token(x, qdtype)
    assert torch.equal(method._apply_cuda(layer, x, (codes, scales)), own)
    assert not torch.equal(method._apply_cuda(layer, x, (codes, scales * 2)), own)


def test_quantized_rows_on_the_cpu_take_the_plain_path():
    """Off CUDA no method asks for codes, and a layer handed some computes from x as usual."""
    from qwick.layers.linear import QuantizedRows

    method = W8A8LinearMethod(torch.int8, checkpoint=False)
    layer = _layer(method, 288, 320, bias=False, dtype=torch.bfloat16)
    x = torch.randn(40, 320, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    assert layer.input_quant(x) is None
    garbage = QuantizedRows(x, torch.zeros(40, 320, dtype=torch.int8), torch.ones(40, 1))
    assert torch.equal(layer(garbage), layer(x))


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_input_quant_asks_for_codes_where_cublas_runs(qdtype):
    """Codes are asked for exactly where `_apply_cuda` takes them: at decode sizes in bf16 only with
    `decode_w8a8` (else the W8A16 skinny GEMM), per group of columns for long inputs there; not for block
    scales, not for weight-only methods."""
    from qwick.layers.linear import RowQuant
    from qwick.quantization.w8a8 import _MIN_AMAX, qmax

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from qwick.kernels.gemv import shared_workspace

    method = W8A8LinearMethod(qdtype, checkpoint=False)
    layer = _layer(method, 288, 320, bias=False, dtype=torch.bfloat16).cuda()
    method.workspace = shared_workspace(torch.device("cuda"))  # what loading on the GPU sets up
    rows = lambda m, dtype=torch.bfloat16: torch.zeros(m, 320, dtype=dtype, device="cuda")  # noqa: E731
    assert layer.input_quant(rows(16)) == RowQuant(qdtype, qmax(qdtype), _MIN_AMAX)
    long_k = W8A8LinearMethod(qdtype, checkpoint=False)  # a down projection: group scales at decode sizes
    long_layer = _layer(long_k, 64, 12288, bias=False, dtype=torch.bfloat16).cuda()
    long_k.workspace = method.workspace
    long_rows = lambda m: torch.zeros(m, 12288, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    grouped = RowQuant(qdtype, qmax(qdtype), _MIN_AMAX, long_k.decode_group)
    assert long_layer.input_quant(long_rows(16)) == grouped
    assert long_layer.input_quant(long_rows(17)) == RowQuant(qdtype, qmax(qdtype), _MIN_AMAX)
    long_k.decode_group = 300  # SiLU-and-mul's groups are powers of two the GEMV's tiles divide
    with pytest.raises(ValueError, match="decode_group"):
        long_layer.input_quant(long_rows(16))
    long_k.decode_group = 0
    assert long_layer.input_quant(long_rows(16)) is None
    method.decode_w8a8 = False
    assert layer.input_quant(rows(16)) is None
    assert layer.input_quant(rows(17)) == RowQuant(qdtype, qmax(qdtype), _MIN_AMAX)
    assert layer.input_quant(rows(1, torch.float32)) == RowQuant(qdtype, qmax(qdtype), _MIN_AMAX)
    weight_only = W8A8LinearMethod(qdtype, checkpoint=False, quantize_activations=False)
    assert _layer(weight_only, 288, 320, bias=False).cuda().input_quant(rows(40)) is None


def test_only_the_codes_path_lets_the_next_kernel_in(monkeypatch):
    """`lets_next_in` (the early norm and decode attention after a projection): with `pdl_norm`, only the
    per-channel W8A8 decode GEMV on activation codes triggers; weight-only (W8A16) and block-scaled layers
    never do, and nothing does with `pdl_norm` off."""
    assert W8A8LinearMethod(FP8_DTYPE, checkpoint=False).lets_next_in
    assert W8A8LinearMethod(torch.int8, checkpoint=False).lets_next_in
    assert not W8A8LinearMethod(FP8_DTYPE, checkpoint=False, quantize_activations=False).lets_next_in
    assert not W8A8LinearMethod(FP8_DTYPE, checkpoint=True, block=(128, 128)).lets_next_in
    monkeypatch.setattr(W8A8LinearMethod, "decode_w8a8", False)
    assert not W8A8LinearMethod(FP8_DTYPE, checkpoint=False).lets_next_in
    monkeypatch.undo()
    monkeypatch.setattr(W8A8LinearMethod, "pdl_norm", False)
    assert not W8A8LinearMethod(FP8_DTYPE, checkpoint=False).lets_next_in
