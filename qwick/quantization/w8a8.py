"""8-bit weights and 8-bit activations (FP8 e4m3 or INT8): the linear method behind "fp8", "int8" and
compressed-tensors' 8-bit schemes.

Weights are symmetric, with one fp32 scale per output channel ([N, 1], `weight_scale`) or per
[block_n, block_k] block ([ceil(N/bn), ceil(K/bk)], `weight_scale_inv` in Qwen/DeepSeek FP8 checkpoints,
`weight_scale` in compressed-tensors ones; both multiply). Activations are quantized on the fly: one scale
per token (per-channel weights), or per token and `block_k`-wide group of K (block weights), as the
DeepSeek/Qwen block recipe does. A checkpoint's static activation scales (`input_scale`) are not used:
per-token dynamic scales are at least as accurate and need no calibration.

What each path computes:
    y = dequant(quant(x)) @ dequant(W).T + b
- the reference path (CPUs, odd shapes): dequantize, then a plain matmul. With per-token x scales and
  per-channel W scales the scales factor out of each dot product, so the matmul runs on the 8-bit codes
  (exact in bf16/fp16/fp32) in the activation dtype and the scales are applied after;
- CUDA: `torch._scaled_mm` with row-wise scales (fp8; fast accumulation where K <= `fast_accum_max_k`),
  `torch._int_mm` then the scales (int8), block fp8 through a Triton block-scaled GEMM; activations quantized
  by one fused Triton kernel, bit-identical to the torch ops here (`qwick.kernels.w8a8`). Where the input
  comes from an RMSNorm or SiLU-and-mul, that kernel writes the per-token codes too (`input_quant` asks for
  them, `apply_quantized` takes them), which saves the quantization launch and a read of the activations for
  three of a layer's four projections;
- CUDA, fp8 per channel at 16 < M <= `rowwise_max_m` with a long K (the down projections at mid-size
  batches and short prompts), where cuBLAS's 128 x 128 output tiles are fewer than the SMs: a split-K
  Triton GEMM on the fp8 codes (`qwick.kernels.w8a8.rowwise_fp8_mm`), which keeps every SM streaming;
- CUDA, decode-sized bf16/fp16 inputs (M <= 16), per-channel scales: the skinny split-K GEMM of
  `qwick.kernels.gemv` streaming the 8-bit codes. Where the producing kernel wrote the activation codes
  (`decode_w8a8`), it multiplies codes by codes on the tensor cores (W8A8, as every other size): per-token
  codes from the RMSNorms before QKV and gate/up; codes with a scale per 512 columns from SiLU-and-mul
  before the down projection (`decode_w8a8_max_k`, `decode_group`), which it writes with many programs
  per row. The output projection's input comes without codes: there it computes `x @ dequant(W).T + b`
  (W8A16). So does the LM head's, but a layer that wide quantizes the rows itself and takes W8A8
  (`decode_quantize_min_n`).
  On CPUs, int8 per channel with bf16 inputs of at most 16 rows does the same (W8A16) through torch's
  int8 weight GEMM (`torch._weight_int8pack_mm`).

On-the-fly ("quantization='fp8'" on a bf16 checkpoint): the layer holds a plain weight while loading, and
`process_weights_after_loading` replaces it with codes and per-channel absmax scales (the bf16 copy is freed).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from qwick.layers.linear import Linear, LinearMethod, QuantizedRows, RowQuant, linear
from qwick.quantization.formats import cpu_int4

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
_QMAX = {FP8_DTYPE: 448.0, torch.int8: 127.0}
_MIN_AMAX = 1e-10  # an all-zero row gets a tiny scale (codes 0) instead of a division by zero
# Scales are absmax * fp32(1 / qmax): what torch's `absmax / qmax` computes on CUDA (a multiplication by the
# reciprocal), and what the Triton quantization kernel computes, so CPU, GPU and kernel agree bit for bit.
_INV_QMAX = {dtype: float(torch.tensor(1.0, dtype=torch.float32) / q) for dtype, q in _QMAX.items()}


def qmax(qdtype: torch.dtype) -> float:
    return _QMAX[qdtype]


def _to_codes(x: torch.Tensor, scale: torch.Tensor, qdtype: torch.dtype) -> torch.Tensor:
    """fp32 values / scale -> 8-bit codes: round to nearest (even), saturate."""
    q = x / scale
    if qdtype == torch.int8:
        q = q.round_()
    m = _QMAX[qdtype]
    return q.clamp_(-m, m).to(qdtype)


def quantize_per_token(x: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> codes [M, K] and fp32 scales [M, 1] (absmax / qmax per row)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=_MIN_AMAX) * _INV_QMAX[qdtype]
    return _to_codes(xf, scale, qdtype), scale


def quantize_per_token_group(
    x: torch.Tensor, qdtype: torch.dtype, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> codes [M, K] and fp32 scales [M, ceil(K / group)]: one scale per token and K-group."""
    m, k = x.shape
    groups = -(-k // group)
    xf = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=_MIN_AMAX) * _INV_QMAX[qdtype]
    q = _to_codes(xf, scale, qdtype).view(m, groups * group)[:, :k]
    return q.contiguous(), scale.squeeze(-1)


def quantize_weight_per_channel(w: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> codes [N, K] and fp32 scales [N, 1]."""
    return quantize_per_token(w, qdtype)


def quantize_weight_blockwise(
    w: torch.Tensor, qdtype: torch.dtype, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> codes [N, K] and fp32 scales [ceil(N/bn), ceil(K/bk)], one per [bn, bk] block."""
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    wf = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
    scale = wf.abs().amax(dim=(1, 3), keepdim=True).clamp_(min=_MIN_AMAX) * _INV_QMAX[qdtype]
    q = _to_codes(wf, scale, qdtype).view(nb * bn, kb * bk)[:n, :k]
    return q.contiguous(), scale.view(nb, kb)


def expand_block_scales(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Block scales [ceil(N/bn), ceil(K/bk)] -> one scale per element [N, K]."""
    n, k = shape
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


class W8A8LinearMethod(LinearMethod):
    """8-bit weights (per-channel or block scales) times activations quantized per token on the fly.

    `checkpoint`: the layer's parameters are the checkpoint's codes and scales; otherwise it loads a plain
    weight and quantizes it per channel after loading. `quantize_activations=False` is weight-only (W8A16):
    the weight is dequantized and multiplied by the unquantized activations.
    """

    quantized = True
    # Decode-sized inputs (M <= 16) with per-channel scales: our skinny Triton GEMM on the 8-bit codes and
    # unquantized activations (qwick.kernels.gemv, W8A16) instead of quantizing the activations for cuBLAS;
    # False keeps `_scaled_mm` / `_int_mm` (W8A8) for every M.
    skinny_gemm = True
    # Decode-sized inputs that come with their per-token codes (written by the RMSNorm before QKV and
    # gate/up, by SiLU-and-mul before down): the skinny GEMM takes codes times codes (W8A8), with no
    # conversion of the weight codes to bf16 and half the shared memory. On the H200 at qwen2.5-7b shapes
    # and M = 1, fp8: gate/up 53.3 -> 45.3 us, down 31.4 -> 28.6, QKV 14.4 -> 12.0
    # (benchmarks/w8a8_gemv_sweep.py). The numbers are those of every larger batch and of the prompt,
    # whose activations are quantized too. False keeps W8A16 at decode sizes.
    decode_w8a8 = True
    # Per-token codes only for K <= decode_w8a8_max_k: at a few rows the producing kernel quantizes each
    # row in one program, and over the down projection's 18944 columns SiLU-and-mul took 8.3 us with codes
    # against 1.8 without, more than the W8A8 GEMV saves there (~3 us); the RMSNorms cost 5.0 against 2.0
    # us (2.8 at 32 warps) for 2.4-8 us saved (an int8 decode-step profile on the H200,
    # benchmarks/decode_step_profile.py, and benchmarks/decode_quant_kernels.py). Longer inputs ask for
    # codes with a scale per `decode_group` columns instead, which SiLU-and-mul writes with one program per
    # group (at least as accurate as one scale per token; 1.69 us for the 7b row at groups of 512, in a
    # CUDA graph). 0 keeps W8A16 for them. With it, batch-1 decode at qwen2.5-7b shapes went from 321.0 to
    # 336.9 tok/s (fp8) and 333.6 to 341.9 (int8) on the H200 (BENCHMARKS.md, fifth session of 12-01).
    decode_w8a8_max_k = 8192
    decode_group = 512
    # Decode-sized inputs that come without codes (the o projection's, the LM head's): W8A16, except in
    # layers with at least this many outputs (LM heads), which quantize the rows in a launch of their own
    # (per token, as at every larger batch) and take codes times codes. There the W8A16 GEMV's conversion
    # of every fp8 code to bf16 costs far more than the launch: fp8's 7b head took 176.7 us in W8A16 where
    # the W8A8 gate/up streams 3.9 TB/s (BENCHMARKS.md, twenty-fourth and twenty-sixth sessions).
    decode_quantize_min_n = 65536
    # One fp8 decode row without codes (the o projection's) in a layer narrower than this: the CUDA-core
    # row GEMV (`qwick.kernels.row_gemv_w8`) instead of the tensor-core W8A16 one. At the 7b o projection
    # it takes 7.6 against 8.8 us in CUDA graphs on the H200; int8 gained nothing there (7.9-8.4 against
    # 8.2), so int8 takes it only where it launches early (`pdl_preload`; BENCHMARKS.md, 31st and 37th
    # sessions). 0 turns it off.
    row_gemv_max_n = 16384
    # That row GEMV (the o projection's, after decode attention, which lets it in at its start) launched
    # early by programmatic dependent launch, each split's first two tiles loaded before it waits
    # (`qwick.kernels.pdl`), as the int4 QKV and o GEMVs do; the same sums, so the same tokens. H100, 7b
    # shapes, batch 1: fp8 301.8 and 301.0 decode tok/s against 298.6 and 298.7 (+0.9%); int8 with its
    # o on the early row GEMV 299.7 and 299.5 against 298.2 and 298.2 on the tensor-core GEMV (+0.5%),
    # alternating in one call (37th session).
    pdl_preload = True
    # One decode row's W8A8 GEMVs (QKV, gate/up, down and the LM head, whose codes the kernel before
    # wrote) launched early, each split's first weight tile loaded before they wait, and letting the next
    # kernel in once past their loops: the QKV and gate/up GEMVs start while the one-program RMSNorm
    # before them runs, and with `lets_next_in` decode attention (after QKV) and the next layer's input
    # norm (after down) launch early too, as int4's `PackedLinearMethod.pdl_norm`. The same sums, so the
    # same tokens. H100, 7b shapes, batch 1, alternating in one call: fp8 325.5 and 325.9 decode tok/s
    # against 306.6 and 306.7 (+6.2%), int8 321.6 and 321.8 against 303.6 and 303.6 (+6.0%) (39th session).
    pdl_norm = True
    # The QKV GEMV lets decode attention in at its start, not past its loop, so that the attention's reads
    # before its wait (`triton_backend.DECODE_PRELOAD`) overlap the whole projection
    # (`Linear.precedes_attention`); figures beside `DECODE_PRELOAD` (40th session).
    pdl_qkv_start = True
    # One decode row's SiLU-and-mul in the gate/up GEMV's epilogue (`gemv(..., gated=True)`), so that the
    # SiLU-and-mul launch (1.8 us a layer on the 42nd session's fp8 critical path, H100) leaves the layer:
    # the last gate/up tile of each 512 outputs to finish writes the down projection's codes and scale,
    # the bits SiLU-and-mul writes (`gemv(..., out_quant=...)`), so the same tokens. On for the code types
    # listed. H100, 7b shapes, batch 1, three alternating pairs in two calls (52nd session): int8 336.96,
    # 336.97 and 337.04 decode tok/s against 331.74, 331.87 and 331.87 without (+1.6%); fp8 335.71,
    # 335.53 and 335.73 against 336.94, 337.49 and 337.44 (-0.5%). The 53rd session's critical path
    # (H100, us a layer): the group tail adds 2.1 (int8) and 3.7 (fp8) to the gate/up launch, down gains
    # 1.7 and the SiLU launch's 1.8-1.9 go; why fp8's tail costs more is not known (the compiled tail
    # and loop are the same length for both codes).
    gated_decode: frozenset[torch.dtype] = frozenset({torch.int8})
    # fp8 per channel, 16 < M <= rowwise_max_m, K >= rowwise_min_k (the down projections): our split-K
    # Triton GEMM (`qwick.kernels.w8a8.rowwise_fp8_mm`) where cuBLAS's 128 x 128 tiles leave SMs idle. On
    # the H200 at qwen2.5-7b's down projection it takes 34 / 32 / 34 us at M = 17 / 32 / 64 against
    # cuBLAS's 55 / 52 / 51 (benchmarks/fp8_mid_m_sweep.py), and in CUDA graphs 32.4 / 41.4 / 47.5 us at
    # 128 / 192 / 256 against 47.2 / 47.5 / 49.2 (benchmarks/rowwise_launch_diag.py); on the shorter-K
    # layers cuBLAS wins or ties within 1 us (BENCHMARKS.md, twenty-third session).
    # rowwise_max_m = 0 keeps `_scaled_mm` for every M.
    rowwise_max_m = 256
    rowwise_min_k = 12288
    # cuBLAS fp8 GEMMs with bf16/fp16 output: Hopper's fast accumulation (partial sums kept in the tensor
    # cores, not promoted to fp32 every few products) where K <= this. At qwen2.5-7b shapes it is 1.1-1.2x
    # faster on gate/up and QKV (M 64-8192), and its worst error grows from 3e-3 of the output's range (the
    # bf16 rounding) to 5-7e-3, well under what fp8 weight codes cost. Over K = 18944 (the down projection)
    # the error reaches 1.1e-2 for 1.0-1.1x, so longer sums stay exact (benchmarks/fp8_scaled_mm.py,
    # BENCHMARKS.md). CUTLASS-based engines run fast accumulation everywhere. fp32 models stay exact.
    fast_accum_max_k = 8192
    # `torch._scaled_mm` adds a bf16 bias in its epilogue: one launch fewer per biased layer (Qwen2's QKV:
    # 28 adds of 105 us each in an 8,192-token fp8 prefill step on the H200). Turned off for every layer
    # the first time the installed torch refuses it (`_scaled_mm_bf16`): one warning, not one per layer.
    scaled_mm_bias = True
    workspace = None

    def __init__(
        self,
        qdtype: torch.dtype,
        *,
        checkpoint: bool,
        block: tuple[int, int] | None = None,
        scale_name: str = "weight_scale",
        quantize_activations: bool = True,
    ) -> None:
        if qdtype not in _QMAX:
            raise ValueError(f"W8A8 stores fp8 e4m3 or int8 weights, not {qdtype}")
        if block is not None and (checkpoint is False or qdtype != FP8_DTYPE):
            raise ValueError("block-wise scales exist only in fp8 checkpoints")
        self.qdtype = qdtype
        self.checkpoint = checkpoint
        self.block = tuple(block) if block is not None else None
        self.scale_name = scale_name
        self.quantize_activations = quantize_activations
        self.row_quant = RowQuant(qdtype, _QMAX[qdtype], _MIN_AMAX)  # per-token activations, when quantized

    @property
    def lets_next_in(self) -> bool:  # type: ignore[override]
        """The one-row W8A8 GEMVs let the next kernel in with `pdl_norm` (`LinearMethod`): the per-channel
        codes path, where the GEMV multiplies activation codes (W8A16 and block scales never trigger)."""
        return self.pdl_norm and self.quantize_activations and self.decode_w8a8 and self.block is None

    def describe(self) -> str:
        kind = "fp8" if self.qdtype == FP8_DTYPE else "int8"
        weights = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "per channel"
        acts = ("per token" if not self.block else f"per token and {self.block[1]} columns") + ", dynamic"
        if not self.quantize_activations:
            acts = "unquantized (weight-only)"
        return f"{kind} weights {weights}, activations {acts}"

    # ---- parameters -----------------------------------------------------------------------------------
    def create_weights(self, layer: Linear) -> None:
        n, k = layer.output_size, layer.input_size
        if not self.checkpoint:  # plain weight until `process_weights_after_loading` quantizes it
            super().create_weights(layer)
            return
        layer.weight = nn.Parameter(torch.empty(n, k, dtype=self.qdtype), requires_grad=False)
        if self.block is None:
            scale = nn.Parameter(torch.empty(n, 1, dtype=torch.float32), requires_grad=False)
            scale.per_tensor_ok = True  # per-tensor checkpoint scales are kept per channel
        else:
            bn, bk = self.block
            blocks = torch.empty(-(-n // bn), -(-k // bk), dtype=torch.float32)
            scale = nn.Parameter(blocks, requires_grad=False)
            scale.rows_per_entry = bn
        layer.register_parameter(self.scale_name, scale)

    def load_extra(self, layer: Linear, param_name: str, tensor: torch.Tensor, shard: int) -> bool:
        if param_name == "input_scale":  # static activation scales: we quantize per token instead
            return True
        if param_name in ("weight_zero_point", "input_zero_point"):  # written by symmetric schemes too
            if torch.count_nonzero(tensor):
                raise ValueError(f"{param_name} is not zero: asymmetric 8-bit quantization is not supported")
            return True
        return False

    def weight_scale(self, layer: Linear) -> torch.Tensor:
        return getattr(layer, self.scale_name)

    def load_dense(self, layer: Linear, w: torch.Tensor) -> None:
        """Write a plain weight [N, K] into the layer's storage (dummy weights of a quantized checkpoint)."""
        if not self.checkpoint:
            layer.weight.data.copy_(w)
            return
        if self.block is None:
            q, s = quantize_weight_per_channel(w, self.qdtype)
        else:
            q, s = quantize_weight_blockwise(w, self.qdtype, self.block)
        layer.weight.data.copy_(q)
        self.weight_scale(layer).data.copy_(s)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if not self.checkpoint:
            q, s = quantize_weight_per_channel(layer.weight.data, self.qdtype)
            layer.weight = nn.Parameter(q, requires_grad=False)  # drops the plain copy
            layer.register_parameter(self.scale_name, nn.Parameter(s, requires_grad=False))
        if layer.weight.device.type == "cuda" and self.block is None:
            from qwick.kernels.gemv import shared_workspace  # Triton: CUDA machines only

            self.workspace = shared_workspace(layer.weight.device)

    def dense_weight(self, layer: Linear) -> torch.Tensor:
        """The dequantized weight [N, K] in fp32 (exports to transformers, the reference path)."""
        w = layer.weight
        if w.dtype not in _QMAX:  # on-the-fly, not processed yet
            return w.data.float()
        scale = self.weight_scale(layer)
        if self.block is None:
            return w.float() * scale
        return w.float() * expand_block_scales(scale, tuple(w.shape), self.block)

    # ---- matmul ---------------------------------------------------------------------------------------
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.device.type == "cuda":
            y = self._apply_cuda(layer, x2)
        elif self._cpu_int8_decode(x2):
            # W8A16 as on GPUs at decode sizes: torch's CPU int8 GEMM reads the codes as they are.
            y = torch._weight_int8pack_mm(
                x2.contiguous(), layer.weight, self.weight_scale(layer).view(-1).to(x2.dtype)
            )
            if layer.bias is not None:
                y = y + layer.bias
        else:
            y = self.apply_reference(layer, x2)
        return y.reshape(*shape[:-1], y.shape[-1])

    def _cpu_int8_decode(self, x: torch.Tensor) -> bool:
        """int8 per channel, decode-sized bf16 rows on a CPU: torch's int8 weight GEMM (1.6x the speed of
        bf16 weights at one row on this project's 2-core Xeon, where dequantizing every call was 1.5x
        slower than bf16). Its time grows with the rows, and it needs K a multiple of 16 (others crash
        the process: 64 is required here to stay clear of that)."""
        return (
            x.device.type == "cpu"
            and x.dtype == torch.bfloat16
            and 0 < x.shape[0] <= 16
            and self.qdtype == torch.int8
            and self.block is None
            and self.skinny_gemm
            and x.shape[1] % 64 == 0
            and hasattr(torch, "_weight_int8pack_mm")
            and cpu_int4.fast_cpu()  # else slower than dequantizing
        )

    def apply_reference(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """Dequantize, then matmul: the function every path computes (x [M, K])."""
        out_dtype = x.dtype
        if not self.quantize_activations:
            return linear(x, self.dense_weight(layer).to(out_dtype), layer.bias)
        if self.block is not None:
            bk = self.block[1]
            xq, xs = quantize_per_token_group(x, self.qdtype, bk)
            x_deq = xq.float() * xs.repeat_interleave(bk, dim=1)[:, : x.shape[1]]
            y = linear(x_deq, self.dense_weight(layer))
        else:
            # Scales factor out of every dot product: matmul the codes (exact in any float dtype) in the
            # activation dtype, as fast as the unquantized layer, then scale in fp32.
            xq, xs = quantize_per_token(x, self.qdtype)
            plain = (torch.bfloat16, torch.float16, torch.float32)
            mm_dtype = out_dtype if out_dtype in plain else torch.float32
            y = linear(xq.to(mm_dtype), layer.weight.to(mm_dtype)).float()
            y = y * xs * self.weight_scale(layer).view(1, -1)
        y = y.to(out_dtype)
        if layer.bias is not None:
            y = y + layer.bias
        return y

    def _quantize_x(self, x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Activation codes and scales: one fused Triton launch on GPUs (bit-identical to the torch ops)."""
        if x.device.type != "cuda":
            if group is None:
                return quantize_per_token(x, self.qdtype)
            return quantize_per_token_group(x, self.qdtype, group)
        from qwick.kernels.w8a8 import quantize_rows

        return quantize_rows(x.contiguous(), self.qdtype, _QMAX[self.qdtype], _MIN_AMAX, group)

    def _skinny(self, x: torch.Tensor) -> bool:
        """Decode-sized bf16/fp16 rows with per-channel scales: the skinny GEMM (W8A8 or W8A16)."""
        skinny = x.shape[0] <= 16 and x.dtype in (torch.bfloat16, torch.float16)
        return self.block is None and skinny and self.skinny_gemm and self.workspace is not None

    def _quantizes_decode_rows(self, n: int, k: int) -> bool:
        """Whether decode-sized rows that come without codes are quantized here for the W8A8 skinny GEMM
        (`decode_quantize_min_n`) rather than multiplied as they are (W8A16)."""
        wide = n >= self.decode_quantize_min_n and k <= self.decode_w8a8_max_k
        return self.decode_w8a8 and self.quantize_activations and wide

    def _row_gemv(self, x: torch.Tensor, n: int, k: int) -> bool:
        """One skinny row multiplied as it is (W8A16) in a layer narrower than `row_gemv_max_n`, with a K of
        at most `decode_w8a8_max_k` (the shapes measured) that the row GEMV's tiles divide: fp8 codes, or
        int8 ones where the GEMV launches early (`pdl_preload`)."""
        if x.shape[0] != 1 or n >= self.row_gemv_max_n:
            return False
        from qwick.kernels.pdl import pdl_supported
        from qwick.kernels.row_gemv_w8 import w8_row_block_k  # Triton: imported only where it runs

        if self.qdtype != FP8_DTYPE and not (self.pdl_preload and pdl_supported(x.device)):
            return False

        return k <= self.decode_w8a8_max_k and w8_row_block_k(k) is not None

    def _rowwise(self, x: torch.Tensor, n: int, k: int) -> bool:
        """fp8 per channel at 16 < M <= `rowwise_max_m` (bf16/fp16), K >= `rowwise_min_k`, where cuBLAS's
        128 x 128 output tiles number fewer than the SMs: the split-K Triton GEMM keeps them all streaming."""
        m = x.shape[0]
        if self.qdtype != FP8_DTYPE or self.block is not None or self.workspace is None:
            return False
        if not 16 < m <= self.rowwise_max_m or x.dtype not in (torch.bfloat16, torch.float16):
            return False
        return k >= self.rowwise_min_k and -(-m // 128) * -(-n // 128) < self.workspace.num_sms

    def _per_token_cuda(self, layer: Linear, x: torch.Tensor) -> bool:
        """Whether `_apply_cuda` takes `x` as per-token codes (the cuBLAS `_scaled_mm` / `_int_mm` paths; at
        decode sizes the skinny GEMM, if `decode_w8a8`)."""
        n, k = layer.weight.shape
        if x.device.type != "cuda" or self.block is not None or not self.quantize_activations:
            return False
        if x.shape[0] == 0:
            return False
        if self._skinny(x):
            return self.decode_w8a8 and (k <= self.decode_w8a8_max_k or self.decode_group > 0)
        align = 16 if self.qdtype == FP8_DTYPE else 8
        return k % align == 0 and n % align == 0

    def input_quant(self, layer: Linear, x: torch.Tensor) -> RowQuant | None:
        if not self._per_token_cuda(layer, x):
            return None
        if self._skinny(x) and layer.weight.shape[1] > self.decode_w8a8_max_k:
            group = self.decode_group
            if group < 256 or group & (group - 1):  # SiLU-and-mul's groups; the GEMV's tiles divide them
                raise ValueError(f"decode_group must be a power of two of at least 256 (or 0), not {group}")
            return RowQuant(self.qdtype, _QMAX[self.qdtype], _MIN_AMAX, group)
        return self.row_quant

    def _early_gemv(self, layer: Linear, x: torch.Tensor, rows: torch.Tensor, **kwargs) -> torch.Tensor:
        """The skinny GEMV of the activation codes `x` against the layer's codes; one decode row
        (`rows`: x's values) launched early with `pdl_norm` (`qwick.kernels.pdl`)."""
        from qwick.kernels.gemv import gemv
        from qwick.kernels.pdl import pdl_supported

        early = self.pdl_norm and rows.shape[0] == 1 and pdl_supported(rows.device)
        scale = self.weight_scale(layer)
        return gemv(
            x,
            layer.weight,
            layer.bias,
            self.workspace,
            weight_scale=scale,
            preload=early,
            trigger=early,
            **kwargs,
        )

    def apply_gated(
        self, layer: Linear, x: torch.Tensor | QuantizedRows, quant: RowQuant | None
    ) -> QuantizedRows | None:
        """With this method's code type in `gated_decode`, one decode row that comes with its codes, for a
        down projection that takes group-scaled codes (`quant`, of this method's type): the W8A8 gate/up
        GEMV with SiLU-and-mul and the codes `quant` asks for in its own launch."""
        if not (self.qdtype in self.gated_decode and isinstance(x, QuantizedRows) and x.group is None):
            return None
        if not (isinstance(quant, RowQuant) and quant.group is not None and quant.dtype == self.qdtype):
            return None
        rows = x.x
        if rows.dim() != 2 or rows.shape[0] != 1:
            return None
        if not (self._skinny(rows) and self._per_token_cuda(layer, rows)):
            return None
        n, k = layer.weight.shape
        cfg = self.workspace.config_for(1, n, k, 1, codes=True)
        if cfg.split_k != 1 or cfg.block_n % 2 or n % 2 or quant.group % (cfg.block_n // 2):
            return None
        return self._early_gemv(
            layer, x.codes, rows, x_scale=x.scales, out_dtype=rows.dtype, gated=True, out_quant=quant
        )

    def apply_quantized(self, layer: Linear, x: QuantizedRows) -> torch.Tensor:
        if x.x.dim() != 2 or not self._per_token_cuda(layer, x.x):
            return self.apply(layer, x.x)
        if x.group is not None and not self._skinny(x.x):  # group scales: only the skinny GEMM takes them
            return self.apply(layer, x.x)
        return self._apply_cuda(layer, x.x, (x.codes, x.scales), x.group)

    def _scaled_mm_bf16(
        self, xq: torch.Tensor, xs: torch.Tensor, layer: Linear, k: int
    ) -> tuple[torch.Tensor, bool]:
        """Row-wise scaled fp8 GEMM with bf16 output, and whether it added the layer's bias (a bf16 bias is
        fused where the installed torch takes it; the caller adds any other)."""
        kw = dict(
            scale_a=xs,
            scale_b=self.weight_scale(layer).view(1, -1),
            out_dtype=torch.bfloat16,
            use_fast_accum=k <= self.fast_accum_max_k,
        )
        bias = layer.bias
        if bias is not None and bias.dtype == torch.bfloat16 and self.scaled_mm_bias:
            try:
                return torch._scaled_mm(xq, layer.weight.t(), bias=bias, **kw), True
            except RuntimeError as e:  # an older torch or another backend: add the bias separately
                if isinstance(e, torch.OutOfMemoryError):
                    raise  # out of memory is not a refusal of the bias
                logger.warning("torch._scaled_mm refused a bias (%s); adding biases after the GEMM", e)
                W8A8LinearMethod.scaled_mm_bias = False
        return torch._scaled_mm(xq, layer.weight.t(), **kw), False

    def _apply_cuda(
        self,
        layer: Linear,
        x: torch.Tensor,
        codes: tuple[torch.Tensor, torch.Tensor] | None = None,
        group: int | None = None,
    ) -> torch.Tensor:
        """`codes`: x's codes and scales when the kernel that made x wrote them already (per token, or
        per `group` columns at decode sizes)."""
        n, k = layer.weight.shape
        if x.shape[0] == 0:
            return x.new_empty(0, n)
        if self._skinny(x):
            # Decode: stream the 8-bit codes against the activation codes (W8A8) where the producing
            # kernel wrote them, else against the unquantized activations (W8A16).
            from qwick.kernels.gemv import gemv
            from qwick.kernels.pdl import pdl_supported

            scale = self.weight_scale(layer)
            if codes is None and self._quantizes_decode_rows(n, k):
                codes = self._quantize_x(x)
            if codes is None and self._row_gemv(x, n, k):
                from qwick.kernels.row_gemv_w8 import w8_row_gemv

                preload = self.pdl_preload and pdl_supported(x.device)
                return w8_row_gemv(x, layer.weight, scale, layer.bias, self.workspace, preload=preload)
            if codes is None:
                return gemv(x.contiguous(), layer.weight, layer.bias, self.workspace, weight_scale=scale)
            xq, xs = codes
            at_start = self.pdl_qkv_start and layer.precedes_attention
            return self._early_gemv(
                layer, xq, x, x_scale=xs, out_dtype=x.dtype, x_group=group, trigger_at_start=at_start
            )
        if not self.quantize_activations:
            return self.apply_reference(layer, x)
        if self.block is not None:
            from qwick.kernels.w8a8 import block_scaled_mm

            xq, xs = self._quantize_x(x, self.block[1])
            y = block_scaled_mm(xq, xs, layer.weight, self.weight_scale(layer), self.block, x.dtype)
        elif self._rowwise(x, n, k):
            from qwick.kernels.w8a8 import rowwise_fp8_mm

            xq, xs = codes if codes is not None else self._quantize_x(x)
            scale = self.weight_scale(layer)
            return rowwise_fp8_mm(xq, xs, layer.weight, scale, layer.bias, self.workspace, x.dtype)
        elif self.qdtype == FP8_DTYPE and k % 16 == 0 and n % 16 == 0:
            xq, xs = codes if codes is not None else self._quantize_x(x)
            # Row-wise scaling: scale_a [M, 1], scale_b [1, N] in fp32, W column-major, bf16 out only.
            if x.dtype == torch.float32:
                # Row-wise scaling writes bf16 only, and that rounding flips fp8 activation codes in later
                # layers: in fp32, take the unscaled fp32 sums (tensor-wise scales of 1) and scale after.
                one = torch.ones((), dtype=torch.float32, device=x.device)
                acc = torch._scaled_mm(
                    xq,
                    layer.weight.t(),
                    scale_a=one,
                    scale_b=one,
                    out_dtype=torch.float32,
                    use_fast_accum=False,
                )
                y = acc * xs * self.weight_scale(layer).view(1, -1)
            else:
                y, biased = self._scaled_mm_bf16(xq, xs, layer, k)
                y = y.to(x.dtype)
                if biased:
                    return y
        elif self.qdtype == torch.int8 and k % 8 == 0 and n % 8 == 0:
            xq, xs = codes if codes is not None else self._quantize_x(x)
            m = xq.shape[0]
            if m <= 16:  # cuBLAS int8 GEMMs need more than 16 rows: pad with zero rows
                xq = F.pad(xq, (0, 0, 0, 32 - m))
            acc = torch._int_mm(xq, layer.weight.t())[:m]
            y = (acc.float() * xs * self.weight_scale(layer).view(1, -1)).to(x.dtype)
        else:
            return self.apply_reference(layer, x)
        if layer.bias is not None:
            y = y + layer.bias
        return y
