"""4-bit weight-only (W4A16) linear layers loaded from AWQ and GPTQ checkpoints.

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
on CUDA with bf16/fp16 activations and at most 16 rows, the W4A16 Triton kernel (`qwick.kernels.w4a16`),
which computes the same dequantized weights (not yet run on a GPU in this project's tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from qwick.layers.linear import Linear, LinearMethod
from qwick.quantization.formats import awq as awq_codec
from qwick.quantization.formats import gptq as gptq_codec
from qwick.quantization.formats.layout import QuantizedWeight, dequantize
from qwick.quantization.formats.reference import dequant_matmul

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


class Int4LinearMethod(LinearMethod):
    """AWQ ("awq") or GPTQ ("gptq") 4-bit weights with fp16 group scales; see the module docstring."""

    quantized = True
    repacks_weight = True
    workspace = None

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
        layer.weight = nn.Parameter(qw.qweight.contiguous(), requires_grad=False)
        layer.scales = nn.Parameter(qw.scales.contiguous(), requires_grad=False)
        layer.zeros = None if qw.zeros is None else nn.Parameter(qw.zeros.contiguous(), requires_grad=False)
        layer.perm = None if qw.perm is None else nn.Parameter(qw.perm, requires_grad=False)
        self.zero_point = qw.zero_point
        self.bits = qw.bits
        self.internal_group_size = qw.group_size
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
            zero_point=self.zero_point,
            perm=layer.perm,
        )

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
            and 0 < x2.shape[0] <= 16
        ):
            from qwick.kernels.w4a16 import quant_matmul

            y = quant_matmul(x2, weight, layer.bias, self.workspace)
        else:
            y = self.apply_reference(layer, x2, weight)
        return y.reshape(*shape[:-1], y.shape[-1])

    def apply_reference(
        self, layer: Linear, x: torch.Tensor, weight: QuantizedWeight | None = None
    ) -> torch.Tensor:
        """Dequantize (fp32, exact, rounded once to x's dtype), then matmul."""
        weight = weight if weight is not None else self.quantized_weight(layer)
        bias = layer.bias.to(x.dtype) if layer.bias is not None else None
        return dequant_matmul(x, weight, bias)


def is_ignored(name: str, patterns: Sequence[str]) -> bool:
    """`modules_to_not_convert`: a module is left unquantized when a pattern is a substring of its name, as
    AutoAWQ and transformers match them ("visual", "model.layers.0.mlp", ...)."""
    return any(p and p in name for p in patterns)
