"""Triton attention over the paged KV cache: the GPU backend (TorchAttentionBackend is its oracle).

Each step's metadata is built once on the host from the scheduler's lists and shared by every layer: which
rows take the decode kernel and which the extend kernel, the decode split count, the extend tiles (in
`_TritonPlan`). `forward` then launches the kernels of `triton_kernels` (their docstring says how they
work) without a host sync. The module-level settings below are the measured defaults (H200 figures beside
each), so that a benchmark can flip one for an A/B run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import triton

from qwick.device_upload import to_device
from qwick.kernels.pdl import pdl_supported
from qwick.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionRow,
    is_fp8_kv,
    kv_layout_of,
)
from qwick.layers.attention.triton_kernels import (
    decode_kernel,
    decode_reduce_kernel,
    extend_kernel,
    kv_write_kernel,
    rope_kv_write_kernel,
)

LOG2E = 1.4426950408889634
# Decode split-KV defaults: splits per row are chosen so that (rows x kv heads x splits) is about
# SPLIT_FILL x the number of SMs, each split reading at least MIN_TOKENS_PER_SPLIT keys.
SPLIT_FILL = 2
MIN_TOKENS_PER_SPLIT = 128
MAX_NUM_SPLITS = 64
# Decode rows launched longest context first, a row's kv heads side by side in the grid (`HEADS_FIRST`), so
# that in a batch of mixed lengths the long programs start in the first wave and the short ones fill the
# tail, and one wave's programs on an SM mix long and short. Measured on the H200 (eighth session of 12-01
# in BENCHMARKS.md): workload 3 bf16 13,623 out tok/s against 13,336 in the old order, fp8 16,845 against
# 15,927.
LONGEST_FIRST = True
# RoPE applied by the KV-write kernel (`rope_kv_write_kernel`) when a step's rotary tables are on the
# device: one launch per layer fewer. Measured on the H200 (ninth session of 12-01 in BENCHMARKS.md):
# batch-1 decode bf16 235.2 against 233.4 tok/s, int4 410.9 against 405.9; a 2048-token TTFT unchanged.
FUSE_ROPE = True
# Prefill rows of at least this many queries (the chunks of a long prompt) take a third pipeline stage in
# the extend kernel (head_dim 128). Measured on the H200 (twelfth session of 12-01 in BENCHMARKS.md,
# benchmarks/extend_prefix_probe.py): 8,192 new tokens after 24,576 cached ones 8.95 against 9.86 ms per
# layer, without a prefix 1.30 against 1.37; at 2,048 queries the third stage lost (184 against 134 us).
# A 32k-token prompt's TTFT: 1,131.6 against 1,171.9 ms (benchmarks/long_prefill_ab.py).
LONG_PREFILL_QUERIES = 4096
# Pure decode steps rotate q and write the new key and value inside the decode kernel (`FUSED_WRITE`), not
# in `rope_kv_write_kernel` before it: one launch per layer fewer again. H200, qwen2.5-7b shapes, batch-1
# decode with it / without (`gpu_session.sh decodewrite`): bf16 238.0 / 235.1, int4 470.5 / 459.5, fp8
# weights 360.4 / 354.6 tok/s (all with a bf16 cache); fp8 weights with an fp8 cache 358.5 / 354.3 in one
# machine's processes, 354.0 and 353.3 with it on another (twentieth session). Its fp8 cache codes are the
# separate write's since `round_to` keeps both kernels' rotary products rounded as PyTorch rounds them.
FUSE_DECODE_WRITE = True
# A lone decode row's decode kernel with the write fused and one split reads the row's metadata and first
# key tile before it waits for the QKV projection (launched early after it, `pdl_early_decode`), so those
# dependent loads (row, block table, keys) overlap the projection's tail: see `decode_kernel`'s PRELOAD.
# On a GPU it does so only in that early launch, after the int4 and W8A8 QKV GEMVs; bf16 keeps its kernel.
# With it, the QKV GEMV lets the attention in at its start (`pdl_qkv_start`) and the attention lets the o
# projection in after its wait (`DECODE_TRIGGER_LATE`), so o's programs do not launch while QKV still
# streams. H100, 7b shapes, batch 1, decode tok/s, round-robin in one machine's calls (40th session,
# `gpu_session.sh attnpreload`): int4 476.3 and 475.7 with none of the three, 479.4 and 478.9 with the
# preload and the early start, 487.0 and 487.3 with all three (+2.3%); fp8 325.7 and 325.6 with none,
# 325.7 with the preload alone, 330.5 and 330.4 with the start, 330.8 and 330.9 with all three (+1.6%);
# int8 322.6 with none, 328.4 with all three (+1.8%).
DECODE_PRELOAD = True
DECODE_TRIGGER_LATE = True
# A lone row that reads early (`PRELOAD`, 16-bit pages) takes its keys 256 at a time, on 8 warps and one
# stage: a short-context graph's whole context (`SHORT_CONTEXT_GRAPHS`, up to 256 tokens) is then read
# before the wait, and nothing after it but q and the new key. H100, 7b shapes, batch 1, decode tok/s in one
# machine's calls (42nd session, against the 128-key tiles on 8 warps and 3 stages): fp8 337.7, 337.6 and
# 337.1 against 330.8, 330.5 and 331.3 (+1.9%); int8 333.3 against 328.3 (+1.5%); int4 495.2 against 486.6
# and 486.5 (+1.8%); on 16 warps fp8 +1.2-1.4% and int4 +0.5%. 255 registers a thread and no spills
# (Triton 3.6, `benchmarks/ptx_counts.py decode`). fp8 pages (not measured) and heads wider than 128 keep
# their tiles.
DECODE_PRELOAD_TILE = {"BLOCK_N": 256, "num_warps": 8, "num_stages": 1}
# A lone row that reads early leaves its preloaded tile as read, masks out the tile's stale slot of the new
# key and scores that key apart (`decode_kernel`'s NEW_KEY_APART); the rotary tables and the slot are read
# before the wait too. Merged into the tile after the wait, the new key held the whole tile's staging for
# the dot products (64 KB of keys and 64 KB of values through shared memory) behind the wait; sm_90 PTX
# (Triton 3.6, `benchmarks/ptx_counts.py decode`): 80 shared-memory stores and 112 `ldmatrix` after the
# wait with the merge, 52 and 89 with the key apart, and one trip to memory after the wait instead of two
# (q and the new key's loads issued together). The same products, summed in another order. Timed on an
# H200 in the 45th session (`gpu_session.sh newkey`'s runs, qwen2.5-7b batch 1, 128 + 128 tokens, decode
# tokens/s): fp8 434.0 and 432.9-433.0 against 422.8 and 423.3 (+2.5%), int8 427.6 against 416.3 (+2.7%),
# int4 579.7 and 579.8 against 575.5 and 574.9 (+0.8%).
DECODE_NEW_KEY_APART = True
NO_WINDOW = 1 << 30  # "no sliding window": every key is inside it

if TYPE_CHECKING:
    from qwick.layers.rotary import RopeStep


# ---------------------------------------------------------------------------------------------------------
# backend
# ---------------------------------------------------------------------------------------------------------
@dataclass
class _TritonPlan:
    """Per-step values shared by all layers: which rows take which kernel, and scratch buffers."""

    num_decode: int
    decode_rows: torch.Tensor | None  # [num_decode] int32 row indices
    decode_max_seq_len: int
    extend_rows: list[tuple[int, int]]  # (row, query tokens) of rows with several queries
    tiles: dict = field(default_factory=dict)  # BLOCK_M -> [num_tiles, 2] int32: (row, first query)
    spare_tiles: bool = False  # tiles may start past their row's queries (a graph's fixed tile count)
    buffers: dict = field(default_factory=dict)  # (heads, head_dim, splits) -> (mid_o, mid_lse)


def _pow2(x: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(x))


def _slot_geometry(kv_cache: torch.Tensor) -> dict:
    """The KV-write kernels' view of a cache: where a slot's heads lie (page, slot-in-page and head strides,
    page size) and whether it stores fp8."""
    return dict(
        stride_cb=kv_cache.stride(1),
        stride_cs=kv_cache.stride(2),
        stride_ch=kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[2],
        KV_FP8=is_fp8_kv(kv_cache.dtype),
    )


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton; a drop-in for TorchAttentionBackend on CUDA devices.

    Tunables (instance attributes, so a benchmark can sweep them): `decode_config` / `extend_config`
    override the kernels' meta-parameters (None: the measured defaults in `_decode_cfg`/`_extend_cfg`);
    `split_fill`, `max_num_splits`, `min_tokens_per_split` shape the split-KV heuristic;
    `fixed_num_splits` pins the split count (a CUDA-graph runner sets it so the decode grid is the same
    on every replay); `longest_first` orders decode rows by context length, longest first (the graph
    runner orders its rows the same way when the backend asks for it); `fuse_rope` lets the KV write
    apply RoPE (`write_kv_rope`); prefills of `long_prefill_queries` queries or more pipeline deeper (the
    runner's warm-up compiles that variant too).

    The kernels address the cache through its strides (page, slot in page, head), so they read either
    `kv_layout`; HND gives a decode program one contiguous run of `block_size` keys per page instead of
    `block_size` runs of one key. NHD stays the default: on the H200 (seventh session of 12-01 in
    BENCHMARKS.md) decode attention ran at the same speed in both (256 rows at 8k context: 957 against 965
    us), and workload 3 gave 12,998 out tok/s with HND against 13,255 with NHD.
    """

    name = "triton"
    kv_layout = "NHD"

    def __init__(
        self,
        block_size: int,
        device: torch.device | str,
        fixed_num_splits: int | None = None,
        early_decode: bool = False,
    ) -> None:
        super().__init__(block_size, torch.device(device))
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.num_sms = torch.cuda.get_device_properties(index).multi_processor_count
        else:  # the Triton interpreter (tests on CPU)
            self.num_sms = 132
        self.fixed_num_splits = fixed_num_splits
        self.min_tokens_per_split = MIN_TOKENS_PER_SPLIT
        self.split_fill = SPLIT_FILL
        self.max_num_splits = MAX_NUM_SPLITS
        self.decode_config: dict | None = None
        self.extend_config: dict | None = None
        self.longest_first = LONGEST_FIRST
        self.fuse_rope = FUSE_ROPE
        self.fuse_decode_write = FUSE_DECODE_WRITE
        self.decode_preload = DECODE_PRELOAD
        self.decode_trigger_late = DECODE_TRIGGER_LATE
        self.decode_new_key_apart = DECODE_NEW_KEY_APART
        # The decode kernel launched early (`qwick.kernels.pdl`), waiting at its start: where the QKV
        # projection before it lets it in (`LinearMethod.lets_next_in`).
        self.pdl_early_decode = early_decode
        self.long_prefill_queries = LONG_PREFILL_QUERIES

    # ---- tuning --------------------------------------------------------------------------------------
    def reads_lone_row_early(self, head_dim: int, kv_cache: torch.Tensor) -> bool:
        """Whether a lone decode row's one-split launch reads its keys while QKV streams, 256 a tile
        (`DECODE_PRELOAD_TILE`), by the same tests `_decode` and `_decode_cfg` apply to such a step (the
        kernel writing the new key, 16-bit pages, heads of at most 128). Its one-split CUDA graph then pays
        at longer contexts (`cuda_graphs.SHORT_CONTEXT_ONE_ROW`)."""
        tile = self._preload_tile_fits(head_dim, kv_cache.element_size(), is_fp8_kv(kv_cache.dtype))
        early = self._reads_early(pdl_supported(kv_cache.device))
        return self.fuse_decode_write and self.decode_config is None and early and tile

    def _reads_early(self, pdl: bool) -> bool:
        """Whether a lone decode row's kernel reads before its wait (`decode_preload`): in an early launch,
        and without programmatic dependent launch (Triton's interpreter, older GPUs) anyway, so that the
        code is tested there."""
        return self.decode_preload and (self.pdl_early_decode or not pdl)

    @staticmethod
    def _preload_tile_fits(head_dim: int, itemsize: int, kv_fp8: bool) -> bool:
        """`DECODE_PRELOAD_TILE` is for 16-bit pages and heads of at most 128: at 256 its 132 KB of shared
        memory (at 128) would not fit an SM."""
        return itemsize == 2 and not kv_fp8 and head_dim <= 128

    def _decode_cfg(
        self, head_dim: int, itemsize: int, kv_fp8: bool, num_rows: int, preload: bool = False
    ) -> dict:
        if self.decode_config is not None:
            return self.decode_config
        if itemsize == 4:  # IEEE fp32 dots run on FMAs and need many registers: small tiles
            return {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
        if preload and self._preload_tile_fits(head_dim, itemsize, kv_fp8):
            return dict(DECODE_PRELOAD_TILE)
        # Measured on the H200 at qwen2.5-7b shapes (attention_bench --sweep [--kv-cache-dtype fp8]). fp8
        # pages: 4 warps read them 25-36% faster than 8 (batch 1 at 32k: 24.3 against 32.7 us per layer).
        # bf16 pages at 64 rows and more: 64-key tiles on 4 warps (batch 256 at a 640-token context: 87.1
        # against 95.4 us per layer); fewer rows keep 128-key tiles on 8 warps (batch 8 at 8k: 44.5 vs 47.8).
        if kv_fp8:
            return {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}
        if num_rows >= 64:
            return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
        return {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}

    def prefill_tile_rows(self, head_dim: int, itemsize: int, max_query_len: int) -> int:
        """The prefill kernel's query-tile height (BLOCK_M) for rows of up to `max_query_len` queries."""
        return self._extend_cfg(head_dim, itemsize, max_query_len)["BLOCK_M"]

    def _extend_cfg(self, head_dim: int, itemsize: int, max_query_len: int) -> dict:
        if self.extend_config is not None:
            return self.extend_config
        if itemsize == 4:
            return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
        # Measured on the H200 at qwen2.5-7b shapes (attention_bench --sweep): 128x128 tiles are fastest
        # for long prompts (358 TFLOP/s at 8k); 64x64 wastes less on short chunks.
        if 64 < head_dim <= 128 and max_query_len >= self.long_prefill_queries:
            return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
        if head_dim > 64 and max_query_len >= 128:
            return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}

    # ---- metadata ------------------------------------------------------------------------------------
    def build_metadata(self, rows: list[AttentionRow]) -> AttentionMetadata:
        md = super().build_metadata(rows)
        self._plan(md)
        return md

    def _plan(self, md: AttentionMetadata) -> _TritonPlan:
        """Split the rows between the kernels (host lists only: no device sync), once per step."""
        plan = md.plan.get("triton")
        if plan is not None:
            return plan
        decode = [i for i, n in enumerate(md.query_lens_cpu) if n == 1]
        if self.longest_first:
            decode.sort(key=lambda i: -md.seq_lens_cpu[i])
        plan = _TritonPlan(
            num_decode=len(decode),
            decode_rows=self._to_dev(decode, md) if decode else None,
            decode_max_seq_len=max((md.seq_lens_cpu[i] for i in decode), default=0),
            extend_rows=[(i, n) for i, n in enumerate(md.query_lens_cpu) if n > 1],
        )
        md.plan["triton"] = plan
        return plan

    @staticmethod
    def _to_dev(values: list[int], md: AttentionMetadata) -> torch.Tensor:
        return to_device(values, torch.int32, md.seq_lens.device)

    def _tiles(self, plan: _TritonPlan, md: AttentionMetadata, block_m: int) -> torch.Tensor:
        """(row, first query) of every query tile, the most keys first. A causal tile's work grows with
        the keys it reads (its row's cached context plus its own offset); launching the longest first, with
        the heads varying fastest in the grid, leaves the short ones for the last wave instead of the long
        ones of the last heads (longest-processing-time order)."""
        tiles = plan.tiles.get(block_m)
        if tiles is None:
            order = sorted(
                (
                    (md.seq_lens_cpu[i] - n + m0, i, m0)
                    for i, n in plan.extend_rows
                    for m0 in range(0, n, block_m)
                ),
                reverse=True,
            )
            tiles = plan.tiles[block_m] = self._to_dev([x for _, i, m0 in order for x in (i, m0)], md).view(
                -1, 2
            )
        return tiles

    def num_splits(self, num_rows: int, num_kv_heads: int, max_seq_len: int) -> int:
        """Splits per decode row: about `split_fill` programs per SM, each reading at least
        `min_tokens_per_split` keys.

        Known gap (H200, qwen2.5-7b shapes): the cdiv can overshoot one wave of resident programs
        (batch 8 at 32k: 9 splits = 288 programs for ~264 slots, 2.9 TB/s, while 17 splits gave 3.8);
        a wave-aware count (floor, or whole waves) is the next thing to measure."""
        if self.fixed_num_splits is not None:
            return self.fixed_num_splits
        want = triton.cdiv(self.split_fill * self.num_sms, max(1, num_rows * num_kv_heads))
        by_len = triton.cdiv(max(max_seq_len, 1), self.min_tokens_per_split)
        return max(1, min(want, by_len, self.max_num_splits))

    # ---- per layer -----------------------------------------------------------------------------------
    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Scatter k/v `[tokens, kv_heads, head_dim]` into the cache at `slot_mapping` (< 0: skipped);
        into an fp8 cache as `x / scale` (the scales are ignored otherwise)."""
        tokens, num_kv_heads, head_dim = k.shape
        if tokens == 0:
            return
        if k.stride(2) != 1:
            k = k.contiguous()
        if v.stride(2) != 1:
            v = v.contiguous()
        kv_write_kernel[(tokens,)](
            k,
            v,
            kv_cache[0],
            kv_cache[1],
            slot_mapping,
            1.0 / float(k_scale),
            1.0 / float(v_scale),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            **_slot_geometry(kv_cache),
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            H_PAD=_pow2(num_kv_heads),
            D_PAD=_pow2(head_dim),
            num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
        )

    def write_kv_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        rope: RopeStep,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """`rope.apply(q, k)` then `write_kv(k, v, ...)` in one launch: q is rotated in place, k rotated
        into the cache (the k tensor itself is left as it was)."""
        tokens, num_heads, head_dim = q.shape
        if tokens == 0:
            return
        num_kv_heads = k.shape[1]
        rope_kv_write_kernel[(tokens,)](
            q,
            k,
            v,
            kv_cache[0],
            kv_cache[1],
            rope.positions,
            slot_mapping,
            rope.cos_cache,
            rope.sin_cache,
            1.0 / float(k_scale),
            1.0 / float(v_scale),
            q.stride(0),
            k.stride(0),
            v.stride(0),
            v.stride(1),
            **_slot_geometry(kv_cache),
            NUM_Q_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            QH_PAD=_pow2(num_heads),
            KVH_PAD=_pow2(num_kv_heads),
            num_warps=4,
        )

    def fuses_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeStep) -> bool:
        """Whether `write_kv_rope` takes this step: `fuse_rope` on, rotary tables on the device (the CUDA
        path of `RopeStep`), q / k heads as contiguous rows of a power-of-two head_dim, v rows contiguous."""
        head_dim = q.shape[2]
        return (
            self.fuse_rope
            and rope.cos is None
            and head_dim >= 2
            and head_dim & (head_dim - 1) == 0
            and q.stride(2) == 1
            and k.stride(2) == 1
            and v.stride(2) == 1
            and q.stride(1) == head_dim
            and k.stride(1) == head_dim
        )

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
        self._check_cache(kv_cache, metadata)
        if not is_fp8_kv(kv_cache.dtype):
            k_scale = v_scale = 1.0  # scales belong to fp8 caches only
        if rope is not None and self.fuses_rope(q, k, v, rope):
            self.write_kv_rope(q, k, v, kv_cache, metadata.slot_mapping, rope, k_scale, v_scale)
        else:
            if rope is not None:
                q, k = rope.apply(q, k)
            self.write_kv(k, v, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        return q

    def forward(self, q, k, v, kv_cache, metadata, *, rope=None, output_rows=None, **scales) -> torch.Tensor:
        """The base class's (`scales`: its scale, sliding_window, k_scale, v_scale); a pure decode step with
        `fuse_decode_write` on writes its keys and values inside the decode kernel (`FUSED_WRITE`)
        instead of a launch of its own."""
        fuse = rope is not None and self.fuses_decode_write(q, k, v, rope, metadata)
        if output_rows is None and fuse:
            return self.attend(q, kv_cache, metadata, new_kv=(k, v, rope), **scales)
        return super().forward(q, k, v, kv_cache, metadata, rope=rope, output_rows=output_rows, **scales)

    def fuses_decode_write(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeStep, md: AttentionMetadata
    ) -> bool:
        """Whether the decode kernel writes this step's keys and values: `fuse_decode_write` on, every row
        one decode token, and what `write_kv_rope` would take (a head_dim of 16 or more, so that the
        kernel's padded head is the head)."""
        return (
            self.fuse_decode_write
            and md.num_tokens == md.num_rows
            and q.shape[2] >= 16
            and self.fuses_rope(q, k, v, rope)
        )

    @staticmethod
    def _check_cache(kv_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
        kv_layout_of(kv_cache)  # NHD or HND (ValueError otherwise): the kernels read the cache's strides
        if kv_cache.shape[2] != metadata.block_size:
            raise ValueError("KV cache block size does not match the metadata's")

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
        new_kv: tuple[torch.Tensor, torch.Tensor, RopeStep] | None = None,
    ) -> torch.Tensor:
        """`new_kv` (k, v, rope; pure decode steps only): the step's keys and values, which the decode
        kernel rotates and writes itself, and q not yet rotated (`forward`)."""
        self._check_cache(kv_cache, metadata)
        fp8 = is_fp8_kv(kv_cache.dtype)
        if q.stride(2) != 1:
            q = q.contiguous()
        plan = self._plan(metadata)
        out = torch.empty_like(q)
        # k_scale folds into the softmax scale (q.(k_fp8 * s) = s * q.k_fp8); v_scale scales the output.
        qk_scale_log2 = float(scale) * LOG2E * (float(k_scale) if fp8 else 1.0)
        v_scale = float(v_scale) if fp8 else 1.0
        if plan.num_decode:
            write = None
            if new_kv is not None:  # the kernel quantizes into an fp8 cache as `write_kv` does
                inv = (1.0 / float(k_scale), 1.0 / v_scale) if fp8 else (1.0, 1.0)
                write = (*new_kv, *inv)
            self._decode(q, kv_cache, out, metadata, plan, qk_scale_log2, v_scale, sliding_window, write)
        if plan.extend_rows:
            self._extend(q, kv_cache, out, metadata, plan, qk_scale_log2, v_scale, sliding_window)
        return out

    def _decode(self, q, kv_cache, out, md, plan, scale_log2, v_scale, sliding_window, write=None) -> None:
        """`write` (k, v, rope, 1 / k_scale, 1 / v_scale): the kernel's FUSED_WRITE (see `attend`)."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = kv_cache.shape[3]
        splits = self.num_splits(plan.num_decode, num_kv_heads, plan.decode_max_seq_len)
        key = (num_heads, head_dim, splits)
        bufs = plan.buffers.get(key)
        if bufs is None:
            shape = (plan.num_decode, num_heads, splits)
            mid_o = torch.empty((*shape, head_dim), dtype=torch.float32, device=q.device)
            mid_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
            bufs = plan.buffers[key] = (mid_o, mid_lse)
        mid_o, mid_lse = bufs
        d_pad = _pow2(head_dim, 16)
        grid = (num_kv_heads, plan.num_decode) if self.longest_first else (plan.num_decode, num_kv_heads)
        pdl = pdl_supported(q.device)
        early = self.pdl_early_decode and pdl and q.shape[0] == 1  # batch 1: after the one-row QKV GEMV
        lone = q.shape[0] == 1 and plan.num_decode == 1 and splits == 1
        preload = self._reads_early(pdl) and lone and write is not None
        kv_fp8 = is_fp8_kv(kv_cache.dtype)
        cfg = self._decode_cfg(head_dim, q.element_size(), kv_fp8, plan.num_decode, preload)
        decode_kernel[(*grid, splits)](
            q,
            kv_cache[0],
            kv_cache[1],
            out,
            mid_o,
            mid_lse,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            plan.decode_rows,
            scale_log2,
            v_scale,
            splits,
            int(sliding_window) if sliding_window else NO_WINDOW,
            num_heads // num_kv_heads,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            md.block_tables.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            mid_o.stride(0),
            mid_o.stride(1),
            mid_o.stride(2),
            mid_lse.stride(0),
            mid_lse.stride(1),
            *self._write_args(q, md, write),
            G_PAD=_pow2(num_heads // num_kv_heads, 16),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            BLOCK_SIZE=md.block_size,
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
            KV_FP8=kv_fp8,
            F16_DOT=kv_fp8 and q.dtype != torch.float32,
            HEADS_FIRST=self.longest_first,
            FUSED_WRITE=write is not None,
            PDL_TRIGGER=splits == 1 and pdl,
            PDL_WAIT=early,
            PRELOAD=preload,
            TRIGGER_LATE=self.decode_trigger_late,
            NEW_KEY_APART=preload and self.decode_new_key_apart,
            **cfg,
            **({"launch_pdl": True} if early else {}),
        )
        if splits > 1:
            s_pad = _pow2(max(splits, self.max_num_splits), 16)
            decode_reduce_kernel[(plan.num_decode, num_heads)](
                mid_o,
                mid_lse,
                out,
                md.query_start_loc,
                plan.decode_rows,
                splits,
                mid_o.stride(0),
                mid_o.stride(1),
                mid_o.stride(2),
                mid_lse.stride(0),
                mid_lse.stride(1),
                out.stride(0),
                out.stride(1),
                HEAD_DIM=head_dim,
                D_PAD=d_pad,
                # One width for every split count up to the maximum: one variant to compile.
                S_PAD=s_pad,
                S_CHUNK=min(s_pad, 64),
                num_warps=4,
            )

    @staticmethod
    def _write_args(q: torch.Tensor, md: AttentionMetadata, write) -> tuple:
        """The decode kernel's FUSED_WRITE arguments (k, v, slots, cos / sin tables, inverse scales, k and v
        strides); without a write, placeholders it does not read."""
        if write is None:
            return (q, q, md.seq_lens, q, q, 1.0, 1.0, 0, 0, 0)
        k, v, rope, k_inv, v_inv = write
        return (
            k, v, md.slot_mapping, rope.cos_cache, rope.sin_cache, k_inv, v_inv,
            k.stride(0), v.stride(0), v.stride(1),
        )  # fmt: skip

    def _extend(self, q, kv_cache, out, md, plan, scale_log2, v_scale, sliding_window) -> None:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = kv_cache.shape[3]
        max_query_len = max(n for _, n in plan.extend_rows)
        cfg = dict(self._extend_cfg(head_dim, q.element_size(), max_query_len))
        tiles = self._tiles(plan, md, cfg["BLOCK_M"])
        if tiles.shape[0] > 65535:  # CUDA's grid limit along y; 65535 x BLOCK_M >= 2M query tokens
            raise ValueError(
                f"{tiles.shape[0]} prefill query tiles in one step; lower max_num_batched_tokens"
            )
        extend_kernel[(num_heads, tiles.shape[0])](
            q,
            kv_cache[0],
            kv_cache[1],
            out,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            tiles,
            scale_log2,
            v_scale,
            int(sliding_window) if sliding_window else NO_WINDOW,
            num_heads // num_kv_heads,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            md.block_tables.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            HEAD_DIM=head_dim,
            D_PAD=_pow2(head_dim, 16),
            BLOCK_SIZE=md.block_size,
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
            KV_FP8=is_fp8_kv(kv_cache.dtype),
            F16_DOT=is_fp8_kv(kv_cache.dtype) and q.dtype != torch.float32,
            SPARE_TILES=plan.spare_tiles,
            **cfg,
        )
