"""Linear layers whose weights may be packed from several checkpoint tensors.

QKV and gate/up projections are one matmul each: the checkpoint's separate q/k/v (or gate/up) tensors
are copied into row ranges of one weight at load time (`output_sizes` names the ranges), and so are their
quantization scales. How a weight is stored and applied is the layer's `LinearMethod`: unquantized here,
quantized ones in qwick/quantization; model files never know which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class RowQuant:
    """The per-row (per-token) quantization a linear method applies to its input: codes of `dtype` with
    scale = max(absmax of the row, min_amax) * fp32(1 / qmax). Asked for with `Linear.input_quant`, so the
    kernel that produces the input (RMSNorm, SiLU-and-mul) can write the codes in the same pass.

    `group`: one scale per `group` columns of a row instead (the absmax of those columns), so that a
    kernel with several programs per row needs no row-wide reduction."""

    dtype: torch.dtype
    qmax: float
    min_amax: float
    group: int | None = None


@dataclass
class QuantizedRows:
    """An input x [M, K] with its codes [M, K] and fp32 scales [M, 1] (or [M, ceil(K / group)]) under the
    consuming layer's `RowQuant`: bit for bit what the layer would compute from x itself."""

    x: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    group: int | None = None  # the `RowQuant.group` the codes were made with


@dataclass(frozen=True)
class HalfPairs:
    """The operand of the batch-1 int4 GEMV in packed fp16 (`qwick.kernels.row_gemv_half2`), asked for with
    `Linear.input_quant` like a `RowQuant`, so that the kernel producing the input (RMSNorm, SiLU-and-mul)
    writes it in the same pass instead of every GEMV program pairing the activations again: for each word
    of eight values x_0..x_7, four int32 holding (x_p, x_{p+4}) / `x_div` in fp16, x_p in the low half."""

    x_div: float


@dataclass
class PairedRows:
    """An input x [M, K] with its `HalfPairs` operand [M, K / 2] (int32): the pairs of x's own values."""

    x: torch.Tensor
    pairs: torch.Tensor


@dataclass
class NormAfter:
    """The residual add and RMSNorm that follow a layer (`RMSNorm.forward(y, residual, quant)`), for a
    method whose kernel runs them at the end of its own launch (`LinearMethod.apply_normed`): `residual`
    becomes y + residual in place, and the output is the RMSNorm of that (`weight`, `eps`), with the
    codes or pairs `quant` (the next layer's `input_quant`) asks for."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor
    quant: RowQuant | HalfPairs | None = None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias`, with a GEMV for single-token decode on the CPU.

    On the CPU a one-row matmul is memory-bound, and `torch.mv` streams the weight about twice as fast as
    `F.linear` in bfloat16 (21 vs 11 GB/s measured on this project's 2-core Xeon) and as fast in float32.
    """
    if x.shape[0] == 1 and x.dim() == 2 and x.device.type == "cpu":
        y = torch.mv(weight, x[0])
        if bias is not None:
            y = y + bias
        return y.unsqueeze(0)
    return F.linear(x, weight, bias)


class LinearMethod:
    """How a linear layer stores and applies its weight. Quantized formats subclass this.

    This base class is the unquantized method: one `weight` [out, in] in the model's dtype.
    """

    repacks_weight = False  # True when `process_weights_after_loading` changes the weight's layout
    # Quantized methods are chosen per layer when the model is built and kept; unquantized layers get the
    # device's kernel choice (`select_linear_method`) once the weights are in.
    quantized = False
    # True when its one-row CUDA launches let the kernel after them start early (programmatic dependent
    # launch, `qwick.kernels.pdl`): the input norm after a down projection and decode attention after a
    # QKV projection then launch early, waiting at their start. Elsewhere they launch as usual: an early
    # launch after a kernel that never lets it in cost 0.8-0.9% at batch 1 (38th session).
    lets_next_in = False

    def create_weights(self, layer: Linear) -> None:
        """Register the parameters the checkpoint fills (the bias is the layer's own)."""
        layer.weight = nn.Parameter(torch.empty(layer.output_size, layer.input_size), requires_grad=False)

    def load_extra(self, layer: Linear, param_name: str, tensor: torch.Tensor, shard: int) -> bool:
        """Take a checkpoint tensor the layer has no parameter for (e.g. a scale this method does not use);
        True when it was taken, False makes the load fail."""
        return False

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Turn the loaded checkpoint weight into the form `apply` wants (repack, quantize, ...)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, layer.weight, layer.bias)

    def input_quant(self, layer: Linear, x: torch.Tensor) -> RowQuant | HalfPairs | None:
        """The per-row quantization `apply` would give `x` (only its rows, dtype and device matter), or
        the operand layout it would make of it, if any; an input that comes with it goes to
        `apply_quantized`."""
        return None

    def apply_quantized(self, layer: Linear, x: QuantizedRows | PairedRows) -> torch.Tensor:
        return self.apply(layer, x.x)

    def apply_normed(
        self, layer: Linear, x: torch.Tensor | QuantizedRows | PairedRows, norm: NormAfter
    ) -> torch.Tensor | QuantizedRows | PairedRows | None:
        """`norm` applied to this layer's output in the matmul's own launch (`norm.residual` updated in
        place), or None when this method has no such kernel for x and the caller runs the two apart."""
        return None

    def apply_gated(
        self, layer: Linear, x: torch.Tensor | QuantizedRows | PairedRows, quant: RowQuant | HalfPairs | None
    ) -> torch.Tensor | QuantizedRows | PairedRows | None:
        """silu(gate) * up of a [gate | up] layer's output in one launch with the matmul, with the codes or
        pairs `quant` asks for (the next layer's `input_quant`); None when this method has no such kernel
        for x, and the caller runs the matmul and SiLU-and-mul apart."""
        return None

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ weight.T + bias` on a plain (not repacked) weight, e.g. a tied embedding as the LM head."""
        return linear(x, weight, bias)


class CpuPackedLinearMethod(LinearMethod):
    """bf16/fp16 weights pre-packed into oneDNN's blocked layout, as torch.compile does on CPUs.

    Measured on this project's 2-core Xeon (bf16, 9728x896 weights streamed from memory): 21-22 GB/s at
    1 and 16 rows, against 11-14 GB/s for `F.linear` on the plain weight.
    """

    repacks_weight = True

    def process_weights_after_loading(self, layer: Linear) -> None:
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.data, 16)
        layer.weight = nn.Parameter(packed, requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")


class CudaLinearMethod(LinearMethod):
    """Our skinny-GEMM kernel for decode-sized inputs (at most 16 rows) in bf16/fp16, cuBLAS otherwise.

    At batch 1 cuBLAS streams a 7B model's weights at ~3.3 TB/s; the split-K Triton kernel in
    `qwick.kernels.gemv` gets closer to the copy bandwidth (see BENCHMARKS.md). fp32 stays on cuBLAS, whose
    IEEE products the correctness tests compare against.
    """

    # SiLU-and-mul in the packed gate/up projection's skinny GEMM at 1-16 rows (`gemv(..., gated=True)`:
    # each tile holds gate rows and the matching up rows): one launch fewer per layer. H100, 7b shapes,
    # decode tok/s with it against without: batch 1 183.0, 183.1, 183.1 against 181.3, 181.2, 181.2
    # (+1.0%); batch 4 727.0, 726.9 against 718.4, 718.2 (+1.2%); batch 16 2840, 2842 against 2800, 2802
    # (+1.4%).
    gated_decode = True

    def __init__(self, device: torch.device) -> None:
        from qwick.kernels import gemv  # Triton: imported only on CUDA machines, once

        self.workspace = gemv.shared_workspace(device)
        self._gemv = gemv.gemv
        self._gated_config = gemv.gated_config
        self._max_m = gemv.MAX_M

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2 and 0 < x.shape[0] <= self._max_m and x.dtype in (torch.bfloat16, torch.float16):
            if x.stride(-1) != 1:
                x = x.contiguous()
            return self._gemv(x, weight, bias, self.workspace)
        return F.linear(x, weight, bias)

    def apply_gated(
        self, layer: Linear, x: torch.Tensor | QuantizedRows | PairedRows, quant: RowQuant | HalfPairs | None
    ) -> torch.Tensor | None:
        """With `gated_decode` on, decode-sized rows whose down projection wants plain values: the skinny
        GEMM with SiLU-and-mul in its epilogue, where its launch has one split (`gemv.gated_config`)."""
        if not (self.gated_decode and isinstance(x, torch.Tensor) and quant is None and x.dim() == 2):
            return None
        if not (0 < x.shape[0] <= self._max_m and x.dtype in (torch.bfloat16, torch.float16)):
            return None
        n, k = layer.weight.shape
        if layer.weight.dtype != x.dtype or self._gated_config(self.workspace, x.shape[0], n, k) is None:
            return None
        return self._gemv(x.contiguous(), layer.weight, layer.bias, self.workspace, gated=True)


def select_linear_method(device: torch.device, dtype: torch.dtype) -> LinearMethod:
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return CudaLinearMethod(device)
    if (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return CpuPackedLinearMethod()
    return LinearMethod()


class Linear(nn.Module):
    """`y = x @ W.T + b`, with W stored and applied by `method` (unquantized unless a quantization config
    hands the layer a quantized method when the model is built)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: int | list[int],
        bias: bool = False,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.input_size = input_size
        self.output_size = sum(self.output_sizes)
        self.method = method if method is not None else LinearMethod()
        self.method.create_weights(self)
        self.bias = nn.Parameter(torch.zeros(self.output_size), requires_grad=False) if bias else None
        # Decode attention follows it (a QKV projection): a few programs that load before they wait, so a
        # one-row launch may let it in at its start (`pdl_qkv_start` of the int4 and W8A8 methods).
        self.precedes_attention = False

    def forward(self, x: torch.Tensor | QuantizedRows | PairedRows) -> torch.Tensor:
        if isinstance(x, (QuantizedRows, PairedRows)):
            return self.method.apply_quantized(self, x)
        return self.method.apply(self, x)

    def gated(
        self, x: torch.Tensor | QuantizedRows | PairedRows, quant: RowQuant | HalfPairs | None
    ) -> torch.Tensor | QuantizedRows | PairedRows | None:
        """silu(gate) * up of this [gate | up] layer (two equal `output_sizes`) in one launch, when its
        method can (`LinearMethod.apply_gated`); None otherwise."""
        if len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]:
            return None
        return self.method.apply_gated(self, x, quant)

    def normed(
        self, x: torch.Tensor | QuantizedRows | PairedRows, norm: NormAfter
    ) -> torch.Tensor | QuantizedRows | PairedRows | None:
        """The RMSNorm `norm` of this layer's output (+ its residual, updated in place) in one launch with
        the matmul, when the method can (`LinearMethod.apply_normed`); None otherwise."""
        return self.method.apply_normed(self, x, norm)

    def input_quant(self, x: torch.Tensor) -> RowQuant | HalfPairs | None:
        """How this layer would quantize the rows of `x` (a tensor with its input's rows, dtype and device),
        for the kernel that produces the input to do it; None when it would not."""
        return self.method.input_quant(self, x)

    def load_shard(self, param_name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        """Copy a checkpoint tensor into its shard's rows of a parameter: weight, bias or a scale.

        Parameters are sharded along their output dimension. A method may mark its parameters with
        `output_dim` (1 for layouts stored [in, out], e.g. GPTQ/AWQ), `rows_per_entry` (outputs one entry
        along it covers: the block height of block-wise scales, 8 for eight 4-bit outputs packed in an
        int32) and `per_tensor_ok` (a one-value checkpoint scale fills the shard's rows).
        """
        param = getattr(self, param_name, None)
        if not isinstance(param, nn.Parameter):
            if self.method.load_extra(self, param_name, tensor, shard):
                return
            raise ValueError(f"checkpoint has a {param_name} that this layer does not")
        start = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        rows = getattr(param, "rows_per_entry", 1)
        if start % rows:
            raise ValueError(
                f"{param_name} shard {shard} starts at output row {start}, inside a {rows}-row block of its "
                "entries: a block-quantized or packed checkpoint needs packed shards that are whole blocks"
            )
        first, end = start // rows, (start + size + rows - 1) // rows
        target = param.data.narrow(getattr(param, "output_dim", 0), first, end - first)
        _check_dtype(param_name, tensor, target)
        if tuple(tensor.shape) != tuple(target.shape):
            if tensor.numel() == 1 and getattr(param, "per_tensor_ok", False):
                tensor = tensor.reshape(()).expand(target.shape)
            elif tensor.numel() == target.numel() and tensor.squeeze().shape == target.squeeze().shape:
                tensor = tensor.reshape(target.shape)  # e.g. a per-channel scale saved as [N] or [N, 1]
            else:
                raise ValueError(
                    f"shape mismatch for {param_name} shard {shard}: checkpoint {tuple(tensor.shape)}, "
                    f"model {tuple(target.shape)}"
                )
        target.copy_(tensor)


_PLAIN_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_dtype(param_name: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
    """Plain floats convert into each other; quantized storage (fp8, int8, packed ints) must match exactly,
    since a cast would silently turn codes into values or values into garbage codes."""
    if tensor.dtype == target.dtype or (tensor.dtype in _PLAIN_FLOATS and target.dtype in _PLAIN_FLOATS):
        return
    raise ValueError(
        f"checkpoint {param_name} is {tensor.dtype} but the model stores it as {target.dtype}: the "
        "checkpoint's quantization does not match its config.json (or the quantization= argument)"
    )


class VocabEmbedding(nn.Module):
    """Token embedding table. Allocated empty: the checkpoint (or dummy init) fills it, so no time is
    spent drawing 100M+ random numbers that get overwritten."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
