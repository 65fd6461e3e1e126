"""The one layout every integer weight format is converted to, and its exact dequantization.

`QuantizedWeight` holds a linear weight W [N, K] (out x in, as `nn.Linear` stores it) as unsigned integers
packed along K, with per-group scales (and zero points or mins) that are also laid out [N, K / group]:

    qweight  int32 [N, K * bits / 32]   element k of row n sits in word k // (32 / bits), at bit
                                        (k % (32 / bits)) * bits: sequential, lowest bits first
    scales   fp16 | fp32 [N, G]         G = K / group_size
    zeros    uint8 [N, G] | None        W = (q - zeros) * scales              (AWQ, GPTQ, RTN)
    mins     fp32 [N, G] | None         W = q * scales - mins                 (GGUF Q4_K)
    zero_point int                      W = (q - zero_point) * scales when both are None
                                        (symmetric GPTQ: 8; GGUF Q8_0 128, Q5_0 16, Q6_K 32)
    perm     int64 [K] | None           stored column j is input channel perm[j] (GPTQ act-order)

Why rows of W packed along K: a decode GEMV (M <= 16 rows of activations) is bound by reading the weight
once. Each program of a split-K kernel streams a [BLOCK_N, BLOCK_K] tile, i.e. BLOCK_N rows that are each a
contiguous run of BLOCK_K / 8 words, and the scales of those rows are contiguous too: the same coalesced
access as `qwick.kernels.gemv` on a bf16 W, at a quarter of the bytes. K splits fall on word and group
boundaries, and a row of W never has to be gathered from columns of several words, as it would in AWQ's
[K, N / 8] layout (packed along N) or GPTQ's [K / 8, N] (rows of K). The sequential nibble order unpacks with
one shift-and-mask per element; a kernel wanting another order can permute once at load from this one.

8-bit containers (`bits == 8`) hold the GGUF types whose values need 5-8 bits (Q5_0, Q6_K, Q8_0), so the same
kernel family serves them with BITS=8. Every conversion into this layout is exact: dequantizing in float32
gives bit for bit what the source format's own dequantization gives (see the per-format modules).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight [N, K] as packed integers plus per-group scales; see the module docstring."""

    qweight: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_size: int
    zeros: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    zero_point: int = 0
    perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        n, words = self.qweight.shape
        k = words * (32 // self.bits)
        if self.qweight.dtype != torch.int32:
            raise ValueError(f"qweight must be int32, got {self.qweight.dtype}")
        if k % self.group_size or tuple(self.scales.shape) != (n, k // self.group_size):
            raise ValueError(
                f"scales {tuple(self.scales.shape)} do not fit a [{n}, {k}] weight in groups of "
                f"{self.group_size}"
            )
        for name in ("zeros", "mins"):
            t = getattr(self, name)
            if t is not None and t.shape != self.scales.shape:
                raise ValueError(
                    f"{name} {tuple(t.shape)} must have the scales' shape {tuple(self.scales.shape)}"
                )
        if self.zeros is not None and self.mins is not None:
            raise ValueError("a weight has zero points or mins, not both")
        if self.perm is not None and tuple(self.perm.shape) != (k,):
            raise ValueError(f"perm must have K={k} entries, got {tuple(self.perm.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): output and input features."""
        return self.qweight.shape[0], self.qweight.shape[1] * (32 // self.bits)

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads per full pass over the weight (perm excluded: it touches x, not W)."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.qweight, self.scales, self.zeros, self.mins)
            if t is not None
        )

    def to(self, device: torch.device | str) -> QuantizedWeight:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(
            self,
            qweight=move(self.qweight),
            scales=move(self.scales),
            zeros=move(self.zeros),
            mins=move(self.mins),
            perm=move(self.perm),
        )


def pack_along_k(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned values q [N, K] (each < 2**bits) into int32 [N, K * bits / 32], lowest bits first.

    Built from bytes (two nibbles or one value each) viewed as little-endian int32: byte j of a word holds
    bits 8j..8j+7, so this is the layout above without any 32-bit arithmetic (fast enough for load time).
    """
    per_word = 32 // bits
    n, k = q.shape
    if k % per_word:
        raise ValueError(f"K={k} is not a multiple of {per_word}")
    if q.numel() and (int(q.max()) >= 1 << bits or (q.dtype != torch.uint8 and int(q.min()) < 0)):
        raise ValueError(f"values out of range for {bits} bits")
    q8 = q.to(torch.uint8)
    if bits == 4:
        q8 = q8.view(n, k // 2, 2)
        q8 = q8[..., 0] | (q8[..., 1] << 4)
    return _le_bytes_to_int32(q8.contiguous()).view(n, k // per_word)


def unpack_along_k(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_along_k`: uint8 [N, K]."""
    n, words = qweight.shape
    b = _int32_to_le_bytes(qweight.contiguous()).view(n, words * 4)
    if bits == 8:
        return b
    return torch.stack([b & 0x0F, b >> 4], dim=-1).view(n, words * 8)


def _le_bytes_to_int32(b: torch.Tensor) -> torch.Tensor:
    if sys.byteorder == "little":
        return b.view(torch.int32)
    return b.view(*b.shape[:-1], -1, 4).flip(-1).contiguous().view(torch.int32)


def _int32_to_le_bytes(w: torch.Tensor) -> torch.Tensor:
    if sys.byteorder == "little":
        return w.view(torch.uint8)
    return w.view(torch.uint8).view(*w.shape, 4).flip(-1).contiguous().view(*w.shape[:-1], -1)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit patterns -> int32 with the same bits (two's complement)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def compact_zeros(zeros: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """(None, z) when every zero point is z (symmetric formats), else (zeros as uint8, 0).

    A constant zero point is a kernel constant instead of a tensor the kernel reads.
    """
    z = zeros.to(torch.int32)
    if z.numel() and bool((z == z.flatten()[0]).all()):
        return None, int(z.flatten()[0])
    return zeros.to(torch.uint8), 0


# Rows dequantized at a time on CPUs: ~4 MiB of fp32, so each piece is made and used while in cache
# (4-6x faster than whole-weight temporaries on this project's 2-core Xeon, measured on a 9728 x 896
# weight; 256-1024-row pieces were equally fast, and fewer pieces mean fewer parallel regions, which cost
# a scheduler slice each when the cores are shared). GPUs take the weight at once.
CPU_CHUNK_ELEMS = 1 << 20


def row_chunks(w: QuantizedWeight) -> list[tuple[int, int]]:
    """[start, stop) row ranges to dequantize a weight in: cache-sized on CPUs, all rows elsewhere."""
    n, k = w.shape
    step = n if w.qweight.device.type != "cpu" else max(16, CPU_CHUNK_ELEMS // max(k, 1))
    return [(r, min(n, r + step)) for r in range(0, n, step)] or [(0, 0)]


def dequantize_rows(w: QuantizedWeight, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of W in float32, exact for every supported source (stored column order):
    (q - zero) * scale, or q * scale - min, each operation rounded as fp32 rounds it."""
    rows, k = stop - start, w.shape[1]
    g = w.group_size
    q = unpack_along_k(w.qweight[start:stop], w.bits).to(torch.float32).view(rows, k // g, g)
    scales = w.scales[start:stop].to(torch.float32).unsqueeze(-1)
    if w.mins is not None:
        q.mul_(scales).sub_(w.mins[start:stop].to(torch.float32).unsqueeze(-1))
    else:
        if w.zeros is not None:
            q.sub_(w.zeros[start:stop].to(torch.float32).unsqueeze(-1))
        else:
            q.sub_(float(w.zero_point))
        q.mul_(scales)
    return q.view(rows, k)


def dequantize(
    w: QuantizedWeight, dtype: torch.dtype = torch.float32, *, original_order: bool = True
) -> torch.Tensor:
    """W [N, K] in `dtype`, computed in float32 (exact for every supported source) and rounded once.

    With `original_order=False` and a permuted (act-order) weight, columns come in stored order: what
    `x[:, perm] @ W_stored.T` needs.
    """
    n, k = w.shape
    chunks = row_chunks(w)
    if len(chunks) == 1:
        out = dequantize_rows(w, 0, n).to(dtype)
    else:
        out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
        for start, stop in chunks:
            out[start:stop] = dequantize_rows(w, start, stop)
    if w.perm is not None and original_order:
        restored = torch.empty_like(out)
        restored[:, w.perm] = out
        return restored
    return out


def concat_n(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack shards along N (q/k/v into one qkv, gate/up into one gate_up): rows are independent here.

    Shards must agree on bits, group size and zero form (mins or not) and, with act-order, on the
    permutation: they read the same input, so GPTQ gives them the same one (their Hessian is the input's).
    Zero points stay a constant if every shard has the same constant, else become a uint8 tensor.
    """
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.mins is None) != (first.bits, first.group_size, first.mins is None):
            raise ValueError("shards differ in bits, group size or zero form; they cannot share one kernel")
        if p.scales.dtype != first.scales.dtype:
            raise ValueError(f"shards differ in scale dtype: {p.scales.dtype} vs {first.scales.dtype}")
        if (p.perm is None) != (first.perm is None) or (
            p.perm is not None and not torch.equal(p.perm, first.perm)
        ):
            raise ValueError("shards have different act-order permutations (g_idx); they cannot be fused")
    zeros: torch.Tensor | None = None
    zero_point = first.zero_point
    if first.mins is None and any(p.zeros is not None or p.zero_point != zero_point for p in parts):
        zeros = torch.cat(
            [
                p.zeros if p.zeros is not None else torch.full_like(p.scales, p.zero_point, dtype=torch.uint8)
                for p in parts
            ]
        )
        zero_point = 0
    return QuantizedWeight(
        qweight=torch.cat([p.qweight for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        bits=first.bits,
        group_size=first.group_size,
        zeros=zeros,
        mins=torch.cat([p.mins for p in parts]) if first.mins is not None else None,
        zero_point=zero_point,
        perm=first.perm,
    )


def take_rows(w: QuantizedWeight, index: torch.Tensor) -> QuantizedWeight:
    """The weight whose row i is row `index[i]` of `w` (rows are independent: codes, scales, zeros, mins)."""
    index = index.to(device=w.qweight.device, dtype=torch.int64)

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, index)

    return replace(w, qweight=take(w.qweight), scales=take(w.scales), zeros=take(w.zeros), mins=take(w.mins))


def as_8bit_mins(w: QuantizedWeight, group_size: int) -> QuantizedWeight:
    """The same values as 8-bit codes with fp32 scales and mins (W = q * s - m) in groups of `group_size`
    (which must divide `w.group_size`): the one form any mix of shards can share. Equal values, not always
    equal bits: (q - zero) * s is -0.0 where q == zero and s < 0, q * s - m is +0.0 (no sum can tell).

    Exact whenever q * s and zero * s are exact in fp32: always for the GGUF types (codes of at most 8
    bits times fp16 scales, 6-bit codes times Q6_K's 18-bit scales, power-of-two zero points) and for
    4-bit codes with fp16 scales (AWQ, GPTQ, RTN). The exact result (q - zero) * s is then a difference
    of two exact fp32 values, which fp32 subtraction returns exactly. Not for act-order weights.
    """
    if w.perm is not None:
        raise ValueError("act-order weights cannot change form")
    if w.group_size % group_size or group_size % 4:
        raise ValueError(f"group size {group_size} must divide {w.group_size} and be a multiple of 4")
    repeat = w.group_size // group_size
    scales = w.scales.to(torch.float32)
    if w.mins is not None:
        mins = w.mins.to(torch.float32)
    elif w.zeros is not None:
        mins = w.zeros.to(torch.float32) * scales
    else:
        mins = scales * float(w.zero_point)
    qweight = w.qweight if w.bits == 8 else pack_along_k(unpack_along_k(w.qweight, w.bits), 8)
    return QuantizedWeight(
        qweight=qweight,
        scales=scales.repeat_interleave(repeat, dim=1),
        bits=8,
        group_size=group_size,
        mins=mins.repeat_interleave(repeat, dim=1),
    )


def fuse_n(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """`concat_n` when the shards share bits, group size, zero form and scale dtype; otherwise all of them
    in `as_8bit_mins` form with the largest group size dividing all of theirs (GGUF files mix types
    within q/k/v, e.g. Q4_K q and k with a Q6_K v)."""
    first = parts[0]
    key = (first.bits, first.group_size, first.mins is None, first.scales.dtype)
    if all((p.bits, p.group_size, p.mins is None, p.scales.dtype) == key for p in parts):
        return concat_n(parts)
    group = math.gcd(*(p.group_size for p in parts))
    return concat_n([as_8bit_mins(p, group) for p in parts])
