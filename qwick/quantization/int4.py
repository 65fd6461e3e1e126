"""4-bit weight-only (W4A16) linear layers: AWQ and GPTQ checkpoints, and `quantization="int4"` (round to
nearest while loading an unquantized checkpoint, `Int4Config`).

The layer registers the checkpoint's own tensors (AWQ: qweight [K, N/8], qzeros [G, N/8], scales [G, N];
GPTQ: qweight [K/8, N], qzeros [G, N/8], scales [G, N], g_idx [K]), all sharded along dimension 1 so that
packed q/k/v and gate/up shards land in their columns (`rows_per_entry=8` where eight outputs share an
int32). `process_weights_after_loading` converts the fused tensors once into `QuantizedWeight`
(qwick/quantization/formats/layout.py) and frees the checkpoint tensors; the layer then holds

    weight   int32 [N, K/8]   codes packed along K (exported dequantized by `dense_weight`)
    scales   fp16 [N, G]
    zeros    uint8 [N, G]     only when zero points are not one constant
    perm     int64 [K]        only for act-order (desc_act) GPTQ: x is gathered by it

`apply`: dequantize, then matmul (`formats.reference.dequant_matmul`: the CPU path and the reference);
on CPUs with AVX2/AVX-512, 4-bit weights at decode sizes in bf16 go through torch's int4 GEMM instead
(`formats.cpu_int4`, ~10x faster than dequantizing every call).
On CUDA with bf16/fp16 activations, kernels that compute the same dequantized weights: one row (batch-1
decode) the packed-fp16 CUDA-core GEMV of `qwick.kernels.row_gemv_half2` (`decode_half2`; the fp32
`qwick.kernels.row_gemv` otherwise), 2-16 rows the tensor-core W4A16 kernel
(`qwick.kernels.w4a16`), more rows (prefill) one Triton kernel dequantizing the layer to bf16, then cuBLAS.
Weights outside the fast kernels' reach (GGUF's Q4_K mins, 8-bit containers) use the W4A16 kernel at 2-16
rows and the reference path otherwise.

`PackedLinearMethod` is that holding-and-applying part, shared by every format converted to
`QuantizedWeight`: AWQ / GPTQ (`Int4LinearMethod`), int4 on the fly (`RtnInt4LinearMethod`: a plain weight
while loading, RTN-quantized by `process_weights_after_loading`) and GGUF tensors kept quantized
(qwick/quantization/gguf.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from qwick.layers.linear import HalfPairs, Linear, LinearMethod, NormAfter, PairedRows, RowQuant
from qwick.quantization.base import QuantizationConfig
from qwick.quantization.formats import awq as awq_codec
from qwick.quantization.formats import cpu_int4, rtn
from qwick.quantization.formats import gptq as gptq_codec
from qwick.quantization.formats.layout import QuantizedWeight, compact_zeros, dequantize, pack_along_k
from qwick.quantization.formats.reference import dequant_matmul
from qwick.quantization.w8a8 import W8A8LinearMethod

if TYPE_CHECKING:
    from qwick.kernels.row_gemv import RowGemvConfig  # Triton: imported only where it runs

logger = logging.getLogger(__name__)

PACK = 8  # 4-bit values per int32

_CHECKPOINT_PARAMS = ("qweight", "qzeros", "scales")


def _param(data: torch.Tensor, *, output_dim: int = 1, rows_per_entry: int = 1) -> nn.Parameter:
    p = nn.Parameter(data, requires_grad=False)
    p.output_dim = output_dim
    p.rows_per_entry = rows_per_entry
    return p


def check_bits(fmt: str, config: dict) -> None:
    bits = config.get("bits", config.get("w_bit", 4))
    if int(bits) != 4:
        raise ValueError(
            f"{fmt} checkpoint with bits={bits}: qwick loads 4-bit {fmt} checkpoints only (bits=4)"
        )


def group_count(fmt: str, in_features: int, group_size: int) -> int:
    """Groups along K; group_size -1 means one group per output column (the whole K)."""
    if group_size in (-1, 0):
        return 1
    if group_size % PACK or in_features % group_size:
        raise ValueError(
            f"{fmt}: group_size {group_size} must be a multiple of {PACK} dividing the layer's "
            f"{in_features} input features"
        )
    return in_features // group_size


class PackedLinearMethod(LinearMethod):
    """A linear layer whose weight is a `QuantizedWeight` once loaded; subclasses say how it gets there.

    After `_install` the layer holds `weight` (int32 codes), `scales`, `zeros` / `mins` (or None) and `perm`
    (or None); `apply` runs the CUDA kernels of `_apply_cuda`, dequantize-then-matmul elsewhere.
    Subclasses: `Int4LinearMethod` (AWQ / GPTQ checkpoints), `RtnInt4LinearMethod` (int4 on the fly),
    `qwick.quantization.gguf.GgufLinearMethod` (GGUF blocks kept quantized).
    """

    quantized = True
    repacks_weight = True
    workspace = None
    # Batch-1 decode through the packed-fp16 GEMV (`qwick.kernels.row_gemv_half2`); False: the fp32 one.
    decode_half2 = True
    # That GEMV's operand (`HalfPairs`) written by the RMSNorm or SiLU-and-mul that produces its input, so
    # that its programs do not each pair the activations (576 SASS instructions against 640). On the H200,
    # qwen2.5-7b shapes, batch 1: 432.6 and 432.9 tok/s against 416.4 and 416.4 without (BENCHMARKS.md).
    paired_input = True
    # int4 weights with integer zero points (groups of 128+ codes) at `tiled_min_m` to `tiled_max_m` rows
    # go through the tiled W4A16 kernel (`qwick.kernels.w4a16.w4_tiled_matmul`: codes decoded once per
    # tile, in registers; `tiled_w4_config` has the launch shapes and the sweep's figures). H200, 7b
    # shapes, the four layers of a decoder layer, timed in CUDA graphs: at 2-16 rows 115-121 us against
    # 307-431 with the decode kernel `quant_matmul` (which is what groups of 64 codes still take), at 64
    # rows 184 against 327 with dequantize-then-cuBLAS (which writes the whole layer in bf16 each call).
    # 0 for `tiled_max_m`: off.
    tiled_min_m = 2
    tiled_max_m = 128
    # Above 64 rows, only layers of at least this many codes: at 128 rows gate/up and down take 136 and 90
    # us tiled against 188 and 100, but qkv and o 32 and 25 against 24 and 19 (the tiled kernel decodes
    # the codes again for each 64-row M tile; dequantizing costs the same at any row count).
    tiled_min_codes_above_64 = 1 << 25
    # fp16 models with fp16 scales (Qwen's official AWQ and GPTQ-Int4 releases): the tiled kernel decodes
    # the codes in packed fp16 math, the same weights bit for bit in ~20% fewer instructions (sm_90 code
    # of a 16-row tile). H200, 7b shapes in fp16, a decoder layer's four layers: 114 against 122 us at 16
    # rows, 172 against 187 at 64 (down alone is slower at 16-32 rows: 41 / 53 against 38 / 48 us); 64
    # concurrent fp16 int4 requests 9,379 against 8,763 out tok/s, 16 concurrent 3,524 against 3,513.
    tiled_half_decode = True
    # Batch-1 SiLU-and-mul in the packed gate/up projection's f16x2 GEMV (`w4_half2_gated`: each tile
    # holds gate rows and the matching up rows, so its epilogue writes silu(gate) * up and the down
    # projection's pairs), where the launch has one split (the 7b and 14b gate/up): one launch fewer per
    # layer. H100, 7b shapes, batch 1: 442.0, 441.9, 441.8 against 433.5, 433.0, 432.7 tok/s (+2.0%).
    gated_decode = True
    # Batch-1 residual add + RMSNorm after a projection in its f16x2 GEMV's launch (`w4_half2_normed`: the
    # launch's last program normalizes the row) where `normed_half2_config` takes it (the 7b o projection).
    # H100, 7b shapes, batch 1 with the gated gate/up: 442.95 and 442.56 tok/s against 442.02 and 442.07
    # (+0.2%; 36th session, after the fix of the tail's pairs, which the GPU tests then passed).
    normed_decode = True
    # Batch-1 f16x2 GEMVs whose splits hold at most two tiles (the 7b QKV and o projections) load their
    # weights before they wait for the kernel before, launched early by programmatic dependent launch
    # (`qwick.kernels.pdl`), on GPUs that have it: the QKV projection while the input RMSNorm runs (one
    # program), the o projection while decode attention runs (one program per kv head). The same sums bit
    # for bit. H100, 7b shapes, batch 1: 451.6 and 452.2 decode tok/s against 442.7 and 442.7 with
    # QWICK_PDL=0, alternating in one call (+2.1%; 36th session); 452.0 and 451.7 against 443.9 and 443.6
    # (+1.8%) in the 37th.
    pdl_preload = True
    # Batch 1 as an early-launched chain, on GPUs that have programmatic dependent launch: a GEMV lets the
    # next kernel in once its programs are past their loops, and that kernel loads its first weight tiles
    # (GEMVs) or nothing (norm, attention) before it waits. `pdl_norm`: down lets the next layer's input
    # norm in, which lets QKV in, and QKV lets decode attention in, which lets o in (`lets_next_in`).
    # `pdl_mlp`: o lets the gate/up GEMV in (two tiles preloaded); `pdl_down`: gate/up lets down in (one
    # tile). All three on. 7b shapes, batch 1, decode tok/s, round-robin in one call each: on an H100 in
    # the 38th session, 472.7 and 473.9 with `pdl_norm` against 462.5 and 463.7 without (+2.2%); on an
    # H200, 554.9 and 556.0 with all three against 529.6 and 530.5 without (+4.9%). The MLP chain lost on
    # H100s in the 38th (-7%) and the 41st (-10.9%; likely as gate/up's waiting programs took SM slots o
    # still needed) and was off until the 47th, which measured it on top of the 42nd-45th sessions'
    # defaults on an H100: 500.7, 500.8 and 503.4 against 488.1, 487.6, 487.8 and 487.6 (+2.7%), then as the
    # default 500.4 and 500.9 against 488.6 and 488.8 (+2.5%), alternating.
    pdl_mlp = True
    pdl_down = True
    pdl_norm = True
    # The QKV GEMV lets decode attention in at its start, not past its loop, so that the attention's reads
    # before its wait (`triton_backend.DECODE_PRELOAD`) overlap the whole projection
    # (`Linear.precedes_attention`); figures beside `DECODE_PRELOAD` (40th session).
    pdl_qkv_start = True

    @property
    def lets_next_in(self) -> bool:  # type: ignore[override]
        """The one-row QKV and down GEMVs (the f16x2 ones) let the next kernel in with `pdl_norm`
        (`LinearMethod`)."""
        return self.pdl_norm and self.decode_half2

    def _install(self, layer: Linear, qw: QuantizedWeight) -> None:
        """Make `qw` the layer's weight (replacing whatever the checkpoint layout was)."""
        layer.weight = nn.Parameter(qw.qweight.contiguous(), requires_grad=False)
        layer.scales = nn.Parameter(qw.scales.contiguous(), requires_grad=False)
        layer.zeros = None if qw.zeros is None else nn.Parameter(qw.zeros.contiguous(), requires_grad=False)
        layer.mins = None if qw.mins is None else nn.Parameter(qw.mins.contiguous(), requires_grad=False)
        layer.perm = None if qw.perm is None else nn.Parameter(qw.perm, requires_grad=False)
        self.zero_point = qw.zero_point
        self.bits = qw.bits
        self.internal_group_size = qw.group_size
        layer.cpu_int4_pack = None  # made again from this weight at the first CPU decode (`_cpu_pack`)
        if layer.weight.device.type == "cuda":
            from qwick.kernels.gemv import shared_workspace

            self.workspace = shared_workspace(layer.weight.device)

    def quantized_weight(self, layer: Linear) -> QuantizedWeight:
        return QuantizedWeight(
            qweight=layer.weight,
            scales=layer.scales,
            bits=self.bits,
            group_size=self.internal_group_size,
            zeros=layer.zeros,
            mins=getattr(layer, "mins", None),
            zero_point=self.zero_point,
            perm=layer.perm,
        )

    def dense_weight(self, layer: Linear) -> torch.Tensor:
        """The dequantized weight [N, K] in fp32, input channels in checkpoint order."""
        return dequantize(self.quantized_weight(layer), torch.float32)

    # ---- matmul ---------------------------------------------------------------------------------------
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        weight = self.quantized_weight(layer)
        if (
            x2.device.type == "cuda"
            and self.workspace is not None
            and x2.dtype in (torch.bfloat16, torch.float16)
        ):
            y = self._apply_cuda(layer, x2, weight)
        elif cpu_int4.supports(weight, x2):
            y = cpu_int4.matmul(x2, self._cpu_pack(layer, weight, x2.dtype), layer.bias)
        else:
            y = self.apply_reference(layer, x2, weight)
        return y.reshape(*shape[:-1], y.shape[-1])

    def _cpu_pack(self, layer: Linear, weight: QuantizedWeight, dtype: torch.dtype) -> cpu_int4.Int4Pack:
        """The weight in the CPU int4 kernel's layout, made at the first decode-sized call (the runner's
        startup warm-up) and kept (the codes once more, ~half a byte per weight beside the
        `QuantizedWeight` the other paths read)."""
        # Made again if the layer's tensors were replaced or written in place since (a reload).
        tensors = (layer.weight, layer.scales, layer.zeros, getattr(layer, "mins", None))
        stamp = (dtype, *((t.data_ptr(), t._version) for t in tensors if t is not None))
        cached = getattr(layer, "cpu_int4_pack", None)
        if cached is None or cached[0] != stamp:
            cached = layer.cpu_int4_pack = (stamp, cpu_int4.pack(weight, dtype))
        return cached[1]

    def input_quant(self, layer: Linear, x: torch.Tensor) -> HalfPairs | None:
        """The packed-fp16 GEMV's operand for a one-row input it will take, when `paired_input` is on."""
        if not (self.paired_input and self.decode_half2 and x.is_cuda and x.dim() == 2 and x.shape[0] == 1):
            return None
        from qwick.kernels.row_gemv_half2 import X_DIV, w4_half2_supported

        weight = self.quantized_weight(layer)  # (K, a multiple of its 64-256 groups, is whole words)
        if weight.perm is not None or not w4_half2_supported(weight, x):
            return None
        return HalfPairs(X_DIV)

    def apply_quantized(self, layer: Linear, x: PairedRows) -> torch.Tensor:
        """A one-row input with the pairs `input_quant` asked for: the packed-fp16 GEMV reads those."""
        from qwick.kernels.row_gemv_half2 import w4_half2_gemv

        if not isinstance(x, PairedRows):
            return self.apply(layer, x.x)
        weight = self.quantized_weight(layer)
        pdl = self._pdl(x.x, weight, "row", layer=layer)
        return w4_half2_gemv(x.x, weight, layer.bias, self.workspace, pairs=x.pairs, **pdl)

    def _pdl(
        self,
        x: torch.Tensor,
        weight: QuantizedWeight,
        role: str,
        cfg: RowGemvConfig | None = None,
        layer: Linear | None = None,
    ) -> dict[str, bool]:
        """The `preload` and `trigger` of a one-row f16x2 launch (`pdl_preload`, `pdl_mlp`, `pdl_down`,
        `pdl_norm`): role "row" (the QKV and down projections), "normed" (o) or "gated" (gate/up); `cfg`
        the launch's shape where it is not `default_half2_config`'s. Role "row" also gives
        `trigger_at_start` (`pdl_qkv_start`, for the `layer` before attention)."""
        from qwick.kernels.pdl import pdl_supported
        from qwick.kernels.row_gemv_half2 import default_half2_config, preload_fits

        if not pdl_supported(x.device):
            return {"preload": False, "trigger": False}
        if role == "gated":
            return {"preload": self.pdl_mlp, "trigger": self.pdl_down}
        n, kw = weight.shape[0], weight.shape[1] // 8
        cfg = cfg or default_half2_config(n, kw, self.workspace.num_sms)
        whole = self.pdl_preload and preload_fits(cfg, kw)
        if role == "normed":
            return {"preload": whole, "trigger": self.pdl_mlp}
        start = self.pdl_qkv_start and layer is not None and layer.precedes_attention
        return {"preload": whole or self.pdl_down, "trigger": self.pdl_norm, "trigger_at_start": start}

    def _fused_row(
        self,
        layer: Linear,
        x: torch.Tensor | PairedRows,
        on: bool,
        out: HalfPairs | RowQuant | None,
        config: str,
    ) -> tuple[torch.Tensor, torch.Tensor | None, QuantizedWeight, object] | None:
        """For the fused one-row launches (`apply_normed`, `apply_gated`) when switched `on`: x's row, its
        pairs (or None), the weight and the launch that `row_gemv_half2.<config>(n, kw, num_sms)` gives;
        None when the f16x2 GEMV does not take x, the launch has no such shape, or the next layer wants
        codes (`out`). Triton is imported only for CUDA rows."""
        rows = x.x if isinstance(x, PairedRows) else x
        if not (on and self.decode_half2 and isinstance(rows, torch.Tensor) and rows.is_cuda):
            return None
        if rows.dim() != 2 or rows.shape[0] != 1 or not (out is None or isinstance(out, HalfPairs)):
            return None
        from qwick.kernels import row_gemv_half2

        weight = self.quantized_weight(layer)
        if not row_gemv_half2.w4_half2_supported(weight, rows):
            return None
        cfg = getattr(row_gemv_half2, config)(weight.shape[0], weight.shape[1] // 8, self.workspace.num_sms)
        if cfg is None:
            return None
        return rows, x.pairs if isinstance(x, PairedRows) else None, weight, cfg

    def apply_normed(
        self, layer: Linear, x: torch.Tensor | PairedRows, norm: NormAfter
    ) -> torch.Tensor | PairedRows | None:
        """One row with `normed_decode` on: the f16x2 GEMV (reading x's pairs if it has them) with the norm
        in its launch's tail, when its launch fits the norm (`normed_half2_config`) and the next layer
        wants pairs or nothing."""
        fused = self._fused_row(layer, x, self.normed_decode, norm.quant, "normed_half2_config")
        res = norm.residual
        if fused is None or res.dtype != fused[0].dtype or not res.is_contiguous():
            return None
        from qwick.kernels.row_gemv_half2 import w4_half2_normed

        rows, pairs, weight, cfg = fused
        pdl = self._pdl(rows, weight, "normed", cfg)
        return w4_half2_normed(rows, weight, layer.bias, self.workspace, norm, cfg, pairs=pairs, **pdl)

    def apply_gated(
        self, layer: Linear, x: torch.Tensor | PairedRows, quant: HalfPairs | None
    ) -> torch.Tensor | PairedRows | None:
        """One row with `gated_decode` on: the f16x2 GEMV with SiLU-and-mul in its epilogue, when its
        launch has one split (`gated_half2_config`) and the down projection wants the pairs or nothing."""
        fused = self._fused_row(layer, x, self.gated_decode, quant, "gated_half2_config")
        if fused is None:
            return None
        from qwick.kernels.row_gemv_half2 import w4_half2_gated

        rows, pairs, weight, cfg = fused
        pdl = self._pdl(rows, weight, "gated")
        return w4_half2_gated(rows, weight, layer.bias, self.workspace, cfg, pairs, quant, **pdl)

    def _apply_cuda(self, layer: Linear, x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        """Batch 1: the CUDA-core GEMV; `tiled_min_m` to `tiled_max_m` rows (2-128; above 64 only large
        layers) the tiled W4A16 kernel, for integer zero points in groups of 128+ codes; other 2-16-row
        calls (groups of 64) the decode kernel `quant_matmul`; more (prefill, and large decode batches,
        where this rewrites the whole layer in bf16 every call): dequantize the layer into a transient
        bf16/fp16 weight with one Triton kernel, then cuBLAS."""
        from qwick.kernels.row_gemv import w4_row_gemv, w4_row_supported
        from qwick.kernels.row_gemv_half2 import w4_half2_gemv, w4_half2_supported
        from qwick.kernels.w4a16 import dequantize_int4, quant_matmul, w4_tiled_matmul

        m = x.shape[0]
        fast = w4_row_supported(weight)
        if m == 1 and self.decode_half2 and w4_half2_supported(weight, x):
            pdl = self._pdl(x, weight, "row", layer=layer)
            return w4_half2_gemv(x, weight, layer.bias, self.workspace, **pdl)
        if m == 1 and fast:
            return w4_row_gemv(x, weight, layer.bias, self.workspace)
        tiled = fast and self.tiled_min_m <= m <= self.tiled_max_m
        tiled = tiled and (m <= 64 or weight.shape[0] * weight.shape[1] >= self.tiled_min_codes_above_64)
        if 0 < m <= 16 and not (tiled and weight.group_size >= 128):
            return quant_matmul(x, weight, layer.bias, self.workspace)
        if tiled:
            return w4_tiled_matmul(x, weight, layer.bias, self.workspace, half_decode=self.tiled_half_decode)
        if fast and m > 0:
            if weight.perm is not None:  # act-order: K is stored grouped; gather x to match
                x = x.index_select(1, weight.perm)
            bias = layer.bias.to(x.dtype) if layer.bias is not None else None
            return F.linear(x, dequantize_int4(weight, x.dtype), bias)
        return self.apply_reference(layer, x, weight)

    def apply_reference(
        self, layer: Linear, x: torch.Tensor, weight: QuantizedWeight | None = None
    ) -> torch.Tensor:
        """Dequantize (fp32, exact, rounded once to x's dtype), then matmul."""
        weight = weight if weight is not None else self.quantized_weight(layer)
        bias = layer.bias.to(x.dtype) if layer.bias is not None else None
        return dequant_matmul(x, weight, bias)


class Int4LinearMethod(PackedLinearMethod):
    """AWQ ("awq") or GPTQ ("gptq") 4-bit weights with fp16 group scales; see the module docstring."""

    def __init__(self, fmt: str, group_size: int, *, zero_offset: int = 1, desc_act: bool = False) -> None:
        if fmt not in ("awq", "gptq"):
            raise ValueError(f"unknown 4-bit format {fmt!r}")
        self.fmt = fmt
        self.group_size = group_size
        self.zero_offset = zero_offset
        self.desc_act = desc_act
        self.g_idx: dict[int, torch.Tensor] = {}  # GPTQ: g_idx per packed shard, until processed

    def describe(self) -> str:
        group = "per column" if self.group_size in (-1, 0) else f"group {self.group_size}"
        order = ", act-order" if self.desc_act else ""
        return f"{self.fmt} int4 weights ({group}{order}), activations unquantized"

    # ---- parameters -----------------------------------------------------------------------------------
    def create_weights(self, layer: Linear) -> None:
        n, k = layer.output_size, layer.input_size
        for size in layer.output_sizes:
            if size % PACK:
                raise ValueError(f"{self.fmt}: output size {size} is not a multiple of {PACK}")
        groups = group_count(self.fmt, k, self.group_size)
        if self.fmt == "awq":
            layer.qweight = _param(torch.empty(k, n // PACK, dtype=torch.int32), rows_per_entry=PACK)
        else:
            if k % PACK:
                raise ValueError(f"gptq: input size {k} is not a multiple of {PACK}")
            layer.qweight = _param(torch.empty(k // PACK, n, dtype=torch.int32))
        layer.qzeros = _param(torch.empty(groups, n // PACK, dtype=torch.int32), rows_per_entry=PACK)
        layer.scales = _param(torch.empty(groups, n, dtype=torch.float16))

    def load_extra(self, layer: Linear, param_name: str, tensor: torch.Tensor, shard: int) -> bool:
        if param_name == "g_idx" and self.fmt == "gptq":
            if tuple(tensor.shape) != (layer.input_size,):
                raise ValueError(f"g_idx has shape {tuple(tensor.shape)}, expected ({layer.input_size},)")
            self.g_idx[shard] = tensor.to(device=layer.qweight.device, dtype=torch.int64)
            return True
        return False

    def _shared_g_idx(self, layer: Linear) -> torch.Tensor | None:
        if not self.g_idx:
            return None
        if len(self.g_idx) != len(layer.output_sizes):
            raise ValueError(
                f"g_idx is present for {len(self.g_idx)} of the {len(layer.output_sizes)} packed shards"
            )
        first = self.g_idx[0]
        for g in self.g_idx.values():
            if not torch.equal(g, first):
                raise ValueError(
                    "packed shards (q/k/v or gate/up) have different act-order permutations (g_idx); "
                    "they cannot be fused into one layer"
                )
        return first

    def process_weights_after_loading(self, layer: Linear) -> None:
        if not hasattr(layer, "qweight"):  # already processed
            return
        if self.fmt == "awq":
            qw = awq_codec.to_internal(layer.qweight.data, layer.qzeros.data, layer.scales.data)
        else:
            qw = gptq_codec.to_internal(
                layer.qweight.data,
                layer.qzeros.data,
                layer.scales.data,
                self._shared_g_idx(layer),
                zero_offset=self.zero_offset,
            )
        for name in _CHECKPOINT_PARAMS:  # free the checkpoint layout
            delattr(layer, name)
        self.g_idx = {}
        self._install(layer, qw)

    def dense_weight(self, layer: Linear) -> torch.Tensor:
        """The dequantized weight [N, K] in fp32, input channels in checkpoint order."""
        if hasattr(layer, "qweight"):  # not processed yet
            if self.fmt == "awq":
                return awq_codec.dequantize(layer.qweight.data, layer.qzeros.data, layer.scales.data)
            return gptq_codec.dequantize(
                layer.qweight.data,
                layer.qzeros.data,
                layer.scales.data,
                self._shared_g_idx(layer),
                zero_offset=self.zero_offset,
            )
        return super().dense_weight(layer)


# Rows quantized at a time on the fly: bounds the fp32 temporaries (a 7B gate_up is 37888 x 3584).
_RTN_ROWS = 4096


class RtnInt4LinearMethod(PackedLinearMethod):
    """`quantization="int4"`: a plain weight while loading, then round-to-nearest int4 in groups of
    `group_size` along K (`formats.rtn`), into the layout AWQ / GPTQ checkpoints are converted to.

    A layer whose K is not a multiple of the group stays unquantized: `create_weights` then sets
    `quantized = False` on this instance, and the model hands the layer the device's plain method.
    """

    def __init__(self, prefix: str, group_size: int = rtn.DEFAULT_GROUP_SIZE, *, sym: bool = False) -> None:
        self.prefix = prefix
        self.group_size = group_size
        self.sym = sym

    def describe(self) -> str:
        kind = "symmetric" if self.sym else "asymmetric"
        return f"int4 weights (round to nearest, {kind}, group {self.group_size}), activations unquantized"

    def create_weights(self, layer: Linear) -> None:
        super().create_weights(layer)  # the plain weight the checkpoint fills
        if layer.input_size % self.group_size:
            self.quantized = False
            logger.warning(
                "int4: %s has %d input features, not a multiple of the group size %d: left unquantized",
                self.prefix,
                layer.input_size,
                self.group_size,
            )

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = layer.weight.data
        if w.dtype == torch.int32:  # already processed
            return
        parts = [rtn.quantize_groups(rows, self.group_size, 4, self.sym) for rows in w.split(_RTN_ROWS)]
        q, zeros, scales = (torch.cat(t) for t in zip(*parts))
        zeros_t, zero_point = compact_zeros(zeros)
        qw = QuantizedWeight(
            pack_along_k(q, 4),
            scales,
            bits=4,
            group_size=self.group_size,
            zeros=zeros_t,
            zero_point=zero_point,
        )
        del q, parts
        self._install(layer, qw)  # drops the plain weight

    def dense_weight(self, layer: Linear) -> torch.Tensor:
        if layer.weight.dtype != torch.int32:  # not processed yet: the plain weight
            return layer.weight.data.float()
        return super().dense_weight(layer)


def is_ignored(name: str, patterns: Sequence[str]) -> bool:
    """`modules_to_not_convert`: a module is left unquantized when a pattern is a substring of its name, as
    AutoAWQ and transformers match them ("visual", "model.layers.0.mlp", ...)."""
    return any(p and p in name for p in patterns)


class Int4Config(QuantizationConfig):
    """`quantization="int4"`: bf16/fp16/fp32 checkpoints quantized while loading to int4 (W4A16), round to
    nearest, group size 128 along K, asymmetric (a zero point per group).

    Asymmetric because it is the more accurate of the two on the demo model (`qwick bench quality`, bf16,
    perplexity on the pinned stdlib files): unquantized 4.579, asymmetric 4.832, symmetric 5.118; greedy
    tokens identical to the unquantized model's 50.0% vs 41.6%, teacher-forced top-1 95.7% vs 93.0%. A
    group's [min, max] maps onto all 16 levels, where symmetric RTN wastes levels on the side of zero a
    group reaches less far. The zero points cost 1/128 byte per weight (179 vs 176 MiB of decoder linear
    layers, 683 MiB in bf16). The embeddings stay in the model dtype; a layer whose K is not a multiple of
    128 stays unquantized (logged). `Int4Config(sym=True)` is the symmetric variant.

    The LM head: int8 (W8A8, per-channel scales, as `quantization="int8"` makes it) unless asked otherwise.
    An 8-bit head costs +0.1% perplexity on the demo model where a 4-bit one costs +1.8%, and reads half a
    bf16 head's bytes (see BENCHMARKS.md); `quantize_lm_head=True` makes it int4 like the body, False
    keeps it in the model dtype.
    """

    name = "int4"
    can_quantize_lm_head = True
    default_lm_head = "int8"  # W8A8: `linear_method`
    sym = False
    group_size = rtn.DEFAULT_GROUP_SIZE

    def __init__(self, group_size: int | None = None, sym: bool | None = None) -> None:
        self.group_size = group_size if group_size is not None else type(self).group_size
        self.sym = sym if sym is not None else type(self).sym

    @classmethod
    def for_unquantized_checkpoint(cls) -> Int4Config:
        return cls()

    def describe(self) -> str:
        kind = "symmetric" if self.sym else "asymmetric"
        return f"int4 (quantized while loading: round to nearest, {kind}, group {self.group_size})"

    def linear_method(self, prefix: str, shard_names: Sequence[str]) -> LinearMethod | None:
        if prefix == "lm_head":
            head = self.lm_head_format()
            if head is None:
                return None
            if head == "int8":
                return W8A8LinearMethod(torch.int8, checkpoint=False)
        return RtnInt4LinearMethod(prefix, self.group_size, sym=self.sym)
