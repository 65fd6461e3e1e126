"""The attention-backend interface.

A backend does three things: turn the scheduler's rows into metadata once per step (`build_metadata`),
write a layer's new keys/values into the paged cache, and attend each query to its request's cached
context through the block table. Metadata is built once and shared by every layer, so per-layer work is
kernels only. The KV cache of a layer is one tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`,
stored in the backend's `kv_layout` (`kv_cache_tensor`): "NHD", the contiguous tensor (a slot's heads side
by side), or "HND" (a kv head's `block_size` slots of a block side by side, so a decode program reads one
contiguous run per block; the tensor's strides say which).

FP8 KV cache (`kv_cache_dtype="fp8"`): the cache tensor is torch.float8_e4m3fn and each layer has two scalar
scales, `k_scale` and `v_scale` (1.0 unless the checkpoint provides them, as in vLLM). A value is stored as
`(x * (1 / scale)).clamp(-448, 448).to(fp8)` (`quantize_kv`; multiplying by the fp32 reciprocal, which
GPU kernels do too, so every backend writes the same bytes) and read back as `fp8.to(dtype) * scale`.
Backends ignore the scales when the cache is not fp8, so 16/32-bit caches behave exactly as before.

CUDA graphs (GPU backends): a decode step is captured once per batch-size bucket; `build_metadata` then
writes into persistent buffers instead of allocating, and `pad_to` rows point at the null block 0.

Output rows (`OutputRows`): the model's last layer needs keys and values of every token (the cache keeps
them) but its output only where a token samples. Given output rows, `forward` writes every token's keys and
values, then attends only those tokens' queries, each as a one-query row of its own context length (the
decode kernels' shape); the model then runs the rest of its last layer on those rows alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from qwick.device_upload import to_device

if TYPE_CHECKING:
    from qwick.layers.rotary import RopeStep

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # the largest finite e4m3fn value; larger magnitudes are clamped to it
KV_LAYOUTS = ("NHD", "HND")


def kv_cache_tensor(
    alloc, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, layout: str = "NHD"
) -> torch.Tensor:
    """A layer's KV pool as `[2, num_blocks, block_size, num_kv_heads, head_dim]`, stored in `layout`;
    `alloc(shape)` makes the storage."""
    if layout == "HND":
        return alloc((2, num_blocks, num_kv_heads, block_size, head_dim)).transpose(2, 3)
    if layout != "NHD":
        raise ValueError(f"unknown KV-cache layout {layout!r}; choose one of {KV_LAYOUTS}")
    return alloc((2, num_blocks, block_size, num_kv_heads, head_dim))


def kv_layout_of(kv_cache: torch.Tensor) -> str:
    """Which of `KV_LAYOUTS` a cache tensor is stored in (ValueError for any other strides)."""
    if kv_cache.is_contiguous():
        return "NHD"
    if kv_cache.transpose(2, 3).is_contiguous():
        return "HND"
    raise ValueError(f"KV cache strides {kv_cache.stride()} are neither NHD nor HND")


def to_kv_layout(kv_cache: torch.Tensor, layout: str) -> torch.Tensor:
    """A copy of a cache in `layout` (the same values)."""

    def alloc(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)

    return kv_cache_tensor(alloc, *kv_cache.shape[1:], layout=layout).copy_(kv_cache)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the KV cache for an EngineConfig `kv_cache_dtype` value."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}")


def is_fp8_kv(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`x / scale` clamped to e4m3's range and rounded (to nearest even) to float8_e4m3fn, in fp32."""
    y = x.float()
    if scale != 1.0:
        y = y * (1.0 / scale)
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


@dataclass
class AttentionRow:
    """One row of the step: a run of `num_tokens` new tokens of a request starting at `start_pos`."""

    start_pos: int
    num_tokens: int
    block_table: list[int]

    @property
    def seq_len(self) -> int:
        return self.start_pos + self.num_tokens

    def last_query(self) -> AttentionRow:
        """This row's last token alone, as a one-query row over the row's whole context."""
        return AttentionRow(self.seq_len - 1, 1, self.block_table)


@dataclass
class AttentionMetadata:
    num_rows: int
    num_tokens: int
    block_size: int
    slot_mapping: (
        torch.Tensor
    )  # [num_tokens] int64: cache slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [num_rows + 1] int32
    seq_lens: torch.Tensor  # [num_rows] int32: context length after this step
    block_tables: torch.Tensor  # [num_rows, max_blocks] int32, padded with the null block 0
    max_query_len: int
    max_seq_len: int
    # Host-side copies, for backends that plan work on the CPU.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Backend-private values derived once per step and reused by every layer.
    plan: dict = field(default_factory=dict)


class OutputRows:
    """The tokens of a step whose hidden states leave the model (the ones that sample), in output order.

    `index`: their positions in the step's flat token batch (device). `metadata`: attention metadata that
    makes each of them a one-query row over its own context (`AttentionRow.last_query`).
    Both are built on first use, by the last layer: by then the host has queued the earlier layers, so the
    building overlaps the device's work instead of delaying the step's first kernel."""

    def __init__(self, backend: AttentionBackend, token_index: list[int], rows: list[AttentionRow]) -> None:
        if len(token_index) != len(rows) or not rows:
            raise ValueError("output rows need one (token index, one-token row) pair each, at least one")
        if any(r.num_tokens != 1 for r in rows):
            raise ValueError("an output row is one query token")
        self.backend = backend
        self.token_index = token_index
        self.rows = rows
        self._index: torch.Tensor | None = None
        self._metadata: AttentionMetadata | None = None

    @classmethod
    def prebuilt(cls, index: torch.Tensor, metadata: AttentionMetadata) -> OutputRows:
        """Output rows whose index (int64, on the device) and metadata exist already: a CUDA graph's
        static inputs, which must not be built during capture."""
        rows = cls.__new__(cls)
        rows.backend, rows.token_index, rows.rows = None, [], []
        rows._index, rows._metadata = index, metadata
        return rows

    @property
    def index(self) -> torch.Tensor:
        if self._index is None:
            self._index = to_device(self.token_index, torch.long, self.backend.device)
        return self._index

    @property
    def metadata(self) -> AttentionMetadata:
        if self._metadata is None:
            self._metadata = self.backend.build_metadata(self.rows)
        return self._metadata


class AttentionBackend(ABC):
    name: str = "abstract"
    kv_layout: str = "NHD"  # how the model runner stores the KV pool for this backend (`kv_cache_tensor`)

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device

    def build_metadata(self, rows: list[AttentionRow]) -> AttentionMetadata:
        """Flatten the rows into tensors once per step (the default suits any backend).

        Built with numpy, not from nested lists: `torch.tensor` of a 256-row list of block tables alone
        costs ~0.85 ms of host time a step, numpy ~0.2 ms."""
        bs = self.block_size
        n = len(rows)
        query_lens = [r.num_tokens for r in rows]
        seq_lens = [r.start_pos + r.num_tokens for r in rows]
        max_blocks = max(((s + bs - 1) // bs for s in seq_lens), default=1)
        tables = np.zeros((n, max_blocks), dtype=np.int32)
        for i, r in enumerate(rows):
            table = r.block_table
            if len(table) > max_blocks:
                table = table[:max_blocks]
            tables[i, : len(table)] = table
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(query_lens, out=starts[1:])
        num_tokens = int(starts[-1])
        # Each new token's cache slot: its row's block at position // block_size, offset position % bs.
        row_of = np.repeat(np.arange(n), query_lens)
        start_pos = np.fromiter((r.start_pos for r in rows), dtype=np.int64, count=n)
        pos = np.arange(num_tokens, dtype=np.int64) + (start_pos - starts[:-1])[row_of]
        slots = tables[row_of, pos // bs].astype(np.int64) * bs + pos % bs

        return AttentionMetadata(
            num_rows=n,
            num_tokens=num_tokens,
            block_size=bs,
            slot_mapping=to_device(slots, torch.int64, self.device),
            query_start_loc=to_device(starts, torch.int32, self.device),
            seq_lens=to_device(seq_lens, torch.int32, self.device),
            block_tables=to_device(tables, torch.int32, self.device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        rope: RopeStep | None = None,
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """Write k/v into the cache, then return attention output `[num_tokens, num_heads, head_dim]`
        (`[len(output_rows), ...]` for just the output rows' queries, when given).

        `k_scale` / `v_scale`: the layer's fp8 KV-cache scales; used only when `kv_cache` is fp8.
        `rope`: the step's rotary embedding, applied to q and k first (`rope.apply`), which a backend may
        fuse with its KV write; q may then be rotated in place."""
        q = self.write(q, k, v, kv_cache, metadata, k_scale=k_scale, v_scale=v_scale, rope=rope)
        if output_rows is not None:
            q, metadata = q[output_rows.index], output_rows.metadata
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        return self.attend(q, kv_cache, metadata, scale=scale, sliding_window=sliding_window, **scales)

    @abstractmethod
    def write(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        rope: RopeStep | None = None,
    ) -> torch.Tensor:
        """Rotate q and k (if `rope`), write k/v into the cache at `metadata.slot_mapping`; return q as
        rotated."""

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Each row's queries (`metadata.query_start_loc`) attended to its cached context, causally."""
