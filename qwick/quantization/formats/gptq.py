"""GPTQ checkpoints as AutoGPTQ / GPTQModel write them (the format of Qwen's -GPTQ-Int4 releases).

Per linear layer with weight W [N, K] (out x in), 4 bits, G groups:

    qweight  int32 [K / 8, N]   packed along the *input* rows: word r of column n holds rows 8r..8r+7,
                                row 8r + i in bits 4i..4i+3 (sequential)
    qzeros   int32 [G, N / 8]   zero points packed along N, sequential, stored *minus one* in the
                                original ("gptq", v1) format: symmetric checkpoints store 8 as 7
                                (0x77777777 words); GPTQModel's "gptq_v2" stores the zero itself
    scales   fp16 [G, N]
    g_idx    int32 [K]          group of each input channel: k // group_size, or with act-order
                                (desc_act) a permutation of that (channels quantized in order of
                                decreasing Hessian diagonal, groups formed in that order)

    W[n, k] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]

In v1 a zero point of 0 has no faithful encoding (-1 does not fit 4 bits). We write it as 15 and read
(stored + 1) mod 16 per nibble, as AutoGPTQ's reference dequantizer does; vLLM's exllama kernel reads
16 there and GPTQModel's v1->v2 conversion carries into the next nibble, so such (asymmetric v1)
checkpoints are ambiguous in the wild. Symmetric ones (all of Qwen's) never hit it.

config.json: "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
"desc_act": ..., "sym": ..., optional "checkpoint_format": "gptq" | "gptq_v2"}.
"""

from __future__ import annotations

from typing import Any

import torch

from qwick.quantization.formats import rtn
from qwick.quantization.formats.layout import QuantizedWeight, _to_int32, compact_zeros, pack_along_k

BITS = 4
PACK = 32 // BITS
_SHIFTS = tuple(range(0, 32, BITS))


def quantization_config(
    group_size: int = rtn.DEFAULT_GROUP_SIZE, desc_act: bool = False, sym: bool = True, v2: bool = False
) -> dict[str, Any]:
    """The `quantization_config` AutoGPTQ writes (as in Qwen2.5-*-GPTQ-Int4); `v2` marks GPTQModel's v2."""
    config: dict[str, Any] = {
        "quant_method": "gptq",
        "bits": BITS,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "damp_percent": 0.01,
        "static_groups": False,
        "true_sequential": True,
    }
    if v2:
        config["checkpoint_format"] = "gptq_v2"
    return config


def zero_offset(config: dict[str, Any]) -> int:
    """What to add to stored zero points: 1 for the original format, 0 for GPTQModel's "gptq_v2"."""
    fmt = config.get("checkpoint_format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"unsupported GPTQ checkpoint_format {fmt!r}")
    return 0 if fmt == "gptq_v2" else 1


def _unpack_words(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Sequential nibbles of int32 `packed`, spread along `dim` (0: rows, 1: columns), as int32."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    p = packed.to(torch.int32)
    if dim == 0:  # [R, C] -> [R * 8, C]
        values = (p.unsqueeze(1) >> shifts.view(1, PACK, 1)) & 0xF
        return values.reshape(p.shape[0] * PACK, p.shape[1])
    values = (p.unsqueeze(-1) >> shifts) & 0xF  # [R, C] -> [R, C * 8]
    return values.reshape(p.shape[0], p.shape[1] * PACK)


def _pack_words(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `_unpack_words` for values in 0..15."""
    v = values.to(torch.int64)
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=values.device)
    if dim == 0:
        if v.shape[0] % PACK:
            raise ValueError(f"{v.shape[0]} rows is not a multiple of {PACK}")
        words = (v.view(-1, PACK, v.shape[1]) << shifts.view(1, PACK, 1)).sum(1)
    else:
        if v.shape[1] % PACK:
            raise ValueError(f"{v.shape[1]} columns is not a multiple of {PACK}")
        words = (v.view(v.shape[0], -1, PACK) << shifts).sum(-1)
    return _to_int32(words)


def unpack(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    *,
    zero_offset: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K], zeros uint8 [N, G], scales fp16 [N, G], g_idx int64 [K]).

    Without g_idx (a checkpoint that omits it), groups are consecutive runs of K / G channels.
    """
    k = qweight.shape[0] * PACK
    n_groups, n = scales.shape
    if qweight.shape[1] != n or tuple(qzeros.shape) != (n_groups, n // PACK):
        raise ValueError(
            f"inconsistent GPTQ tensors: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}"
        )
    if g_idx is None:
        if k % n_groups:
            raise ValueError(f"K={k} is not a multiple of {n_groups} groups and the checkpoint has no g_idx")
        g_idx = torch.arange(k, device=qweight.device) // (k // n_groups)
    g_idx = g_idx.to(torch.int64)
    if tuple(g_idx.shape) != (k,) or (k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= n_groups)):
        raise ValueError(f"g_idx must hold K={k} group indices below {n_groups}")
    q = _unpack_words(qweight, dim=0).t().to(torch.uint8).contiguous()
    zeros = ((_unpack_words(qzeros, dim=1) + zero_offset) & 0xF).t().to(torch.uint8).contiguous()
    return q, zeros, scales.t().contiguous(), g_idx


def dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    *,
    zero_offset: int = 1,
) -> torch.Tensor:
    """W [N, K] float32, exact, in the checkpoint's channel order."""
    q, zeros, s, g = unpack(qweight, qzeros, scales, g_idx, zero_offset=zero_offset)
    return (q.to(torch.float32) - zeros.to(torch.float32)[:, g]) * s.to(torch.float32)[:, g]


def pack(
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    *,
    zero_offset: int = 1,
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors {qweight, qzeros, scales, g_idx} for q uint8 [N, K], zeros/scales [N, G]."""
    n, k = q.shape
    if zeros.shape != scales.shape or scales.shape[0] != n or tuple(g_idx.shape) != (k,):
        raise ValueError(
            f"shapes do not fit: q {tuple(q.shape)}, zeros {tuple(zeros.shape)}, "
            f"scales {tuple(scales.shape)}, g_idx {tuple(g_idx.shape)}"
        )
    stored = (zeros.to(torch.int64) - zero_offset) & 0xF
    return {
        "qweight": _pack_words(q.t(), dim=0),
        "qzeros": _pack_words(stored.t(), dim=1),
        "scales": scales.t().to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def quantize(
    w: torch.Tensor,
    group_size: int = rtn.DEFAULT_GROUP_SIZE,
    *,
    sym: bool = True,
    act_order: torch.Tensor | None = None,
    zero_offset: int = 1,
) -> dict[str, torch.Tensor]:
    """A float weight [N, K] as GPTQ checkpoint tensors, by round to nearest.

    `act_order` is the order in which channels are quantized (GPTQ's desc_act permutation, e.g.
    `argsort(H.diag(), descending=True)`): groups are consecutive runs of that order, so g_idx is
    non-monotonic, as in desc_act checkpoints.
    """
    n, k = w.shape
    order = torch.arange(k, device=w.device) if act_order is None else act_order.to(torch.int64)
    q_ordered, zeros, scales = rtn.quantize_groups(w[:, order], group_size, BITS, sym=sym)
    q = torch.empty_like(q_ordered)
    q[:, order] = q_ordered
    g_idx = torch.empty(k, dtype=torch.int64, device=w.device)
    g_idx[order] = torch.arange(k, device=w.device) // group_size
    return pack(q, zeros, scales, g_idx, zero_offset=zero_offset)


def to_internal(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    *,
    zero_offset: int = 1,
) -> QuantizedWeight:
    """Repack into the kernels' layout, dequantizing to exactly `dequantize`'s values.

    Act-order: K is permuted once here (a stable sort by group) so that every group is a contiguous run of
    the stored row, and `perm` records the order, so the matmul gathers x[:, perm] (one small gather of
    the activations per call) instead of the kernel looking up a group per channel, as vLLM's exllama
    and Marlin paths do. Plain g_idx (k // g) gives no perm.
    """
    q, zeros, s, g = unpack(qweight, qzeros, scales, g_idx, zero_offset=zero_offset)
    n, k = q.shape
    n_groups = s.shape[1]
    order = torch.argsort(g, stable=True)
    group_size = k // n_groups
    if k % n_groups or not torch.equal(g[order], torch.arange(k, device=g.device) // group_size):
        counts = torch.bincount(g, minlength=n_groups).tolist()
        raise ValueError(
            f"g_idx does not split the {k} input channels into {n_groups} equal groups (sizes "
            f"{counts[:8]}{'...' if n_groups > 8 else ''}); this layout needs K / G channels per group"
        )
    trivial = torch.equal(order, torch.arange(k, device=order.device))
    zeros_t, zero_point = compact_zeros(zeros)
    return QuantizedWeight(
        qweight=pack_along_k(q if trivial else q[:, order], BITS),
        scales=s.to(torch.float16),
        bits=BITS,
        group_size=group_size,
        zeros=zeros_t,
        zero_point=zero_point,
        perm=None if trivial else order,
    )
