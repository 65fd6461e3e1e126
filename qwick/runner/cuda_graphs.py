"""CUDA graphs for pure-decode steps (one token per row), captured at bucketed batch sizes.

A batch-1 decode step of a small model is bound by kernel launches, not by the GPU: replaying one
captured graph of the whole forward (embedding -> layers -> final norm) replaces hundreds of launches
with one. The logits and the sampler stay outside the graph (eager), since they only touch the rows
that sample.

Design:
- Buckets 1, 2, 4, 8, then multiples of 8 (16, 24, 32, ...) up to `max_batch` (<= 256); a step of `n`
  decode rows replays the smallest bucket >= n, the extra rows being padding.
- One persistent int32 device buffer holds every input of a step: for bucket `bs`, the layout is
  `[ids(bs) | positions(bs) | slots(bs) | seq_lens(bs) | block_tables(bs x W)]` with W the block-table
  width for `max_model_len`. Each graph captured its own views of it, so a step fills a pinned host
  buffer in that layout and issues a single host-to-device copy before the replay. The graph converts
  ids/positions/slots to int64 itself (one tiny kernel inside the graph).
- Padding rows: token 0 at position 0, slot -1 (the KV write kernel skips it), seq_len 1 over the null
  block 0: their attention reads one finite key and their outputs are ignored.
- The Triton decode kernel's grid depends on (rows, kv heads, splits); the split count is pinned per
  bucket during capture (`fixed_num_splits`, chosen by the backend's heuristic at `max_model_len`), and
  the kernel derives each split's key range from the row's seq_len on the device, so replay stays right
  for any context length. Scratch buffers (split partials) live in the captured metadata's plan.
- All graphs share one memory pool, captured from the largest bucket down, so smaller graphs reuse the
  largest one's activation memory. Replays are sequential on one stream, which makes the sharing safe.
- Python's cyclic garbage collector is paused for the whole capture (after one collection): a cycle it
  frees can run finalizers that make CUDA calls a capturing stream forbids (an earlier engine in the same
  process, most likely, in the GPU tests where this was seen), which invalidates the capture and leaves
  decode eager. torch 2.11's `torch.cuda.graph` no longer collects on entry by default.
- With `short_context` > 0, a second set of graphs pins one split per row for steps whose contexts all
  fit in `short_context` tokens: a split count chosen at `max_model_len` leaves most splits of a short
  row empty and adds the reduction launch (H200, one layer at batch 1 and 128 tokens: 8.4 us with 32
  splits, 5.5 with one; batch 64 at 256 tokens: 22.8 against 16.1). A lone row's steps replay its
  one-split graph up to `SHORT_CONTEXT_ONE_ROW` tokens.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from qwick.forward_context import set_forward_context
from qwick.layers.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 256
# Contexts up to this many tokens replay the one-split graphs (0: no such graphs). On the H200 (thirteenth
# session in BENCHMARKS.md, `bash benchmarks/gpu_session.sh shortgraphs`), batch 1 at 128 + 128 tokens:
# bf16 234.9 and 234.8 decode tok/s against 232.1 without, int4 440.5 against 432.9; the second set costs
# 0.6 s of capture and 74 MiB.
SHORT_CONTEXT_GRAPHS = 256
# A lone row's one-split graph serves contexts up to this many tokens (when the graphs above are on): it
# reads its first 256 keys while QKV streams (`triton_backend.DECODE_PRELOAD_TILE`) and the rest after,
# where the split graph adds 32 splits' partials and their reduction. On one H100 (43rd session), batch 1
# at 384 + 128 tokens: fp8 313.9 decode tok/s against 307.8 (+2.0%), int4 449.6 against 443.3 (+1.4%).
# Not for more rows: 8 rows lost 0.9% there (2230.8 against 2250.2), 32 gained 2.9%, the rest untimed.
SHORT_CONTEXT_ONE_ROW = 512


def short_context_limit(bs: int, short_context: int, one_row: int) -> int:
    """Bucket `bs`'s steps replay the one-split graph when every context is under this many tokens (0:
    no one-split graphs)."""
    if short_context <= 0:
        return 0
    return max(short_context, one_row) if bs == 1 else short_context


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, ... up to min(max_batch, 256), always ending at that maximum."""
    top = max(1, min(max_batch, MAX_GRAPH_BATCH))
    buckets = [b for b in (1, 2, 4, 8) if b <= top]
    buckets += list(range(16, top + 1, 8))
    if buckets[-1] != top:
        buckets.append(top)
    return buckets


@contextmanager
def gc_paused() -> Iterator[None]:
    """Collect once, then keep the cyclic garbage collector off until the block ends (see the module
    docstring: nothing it frees may run while a stream captures)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def peak_allocated_bytes(run: Callable[[], object], device: torch.device) -> int:
    """The most bytes allocated at once by `run()` and what it returns (held until it has returned).

    Allocated, not reserved: the graphs' pool is new memory, but an eager run can carve its tensors out of
    cached blocks the allocator keeps (segments that live tensors pin, which `empty_cache` cannot
    release). Measuring reserved bytes, int4 at qwen2.5-7b shapes kept 0.11 GiB for graphs that then took
    0.65 GiB (400 MiB decode, 268 MiB prefill; H200, eighteenth session)."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    kept = run()
    torch.cuda.synchronize(device)
    used = torch.cuda.max_memory_allocated(device) - base
    del kept
    return used


@dataclass
class _Graph:
    bs: int
    graph: torch.cuda.CUDAGraph | None
    hidden: torch.Tensor  # [bs, hidden] graph output
    metadata: AttentionMetadata  # kept alive: its plan holds the decode scratch buffers


class DecodeGraphRunner:
    """Captures and replays the model forward for pure-decode batches of a fixed set of sizes."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend,
        *,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = decode_buckets(max_batch)
        self.max_bs = self.buckets[-1]
        self.width = (max_model_len + block_size - 1) // block_size  # block-table columns
        # With a backend that launches decode rows longest context first (`longest_first`), each step uploads
        # that row order too; otherwise the rows keep their order (a fixed arange).
        self.longest_first = bool(getattr(backend, "longest_first", False))
        size = self._size(self.max_bs)
        self.packed = torch.zeros(size, dtype=torch.int32, device=device)
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=True)
        self.host_np = self.host.numpy()
        self.query_start_loc = torch.arange(self.max_bs + 1, dtype=torch.int32, device=device)
        self.decode_rows = torch.arange(self.max_bs, dtype=torch.int32, device=device)
        self.graphs: dict[int, _Graph] = {}
        self.short_context = SHORT_CONTEXT_GRAPHS
        self.short_context_one_row = 0  # set at capture, once the KV cache says what the backend reads
        self.short_graphs: dict[int, _Graph] = {}  # one split per row, for contexts <= short_context
        self.pool = None
        self.num_replays = 0
        self.num_short_replays = 0  # of those, replays of the one-split graphs
        self.graph_bytes = 0
        self.num_kv_heads = model.attention_layers()[0].num_kv_heads
        self._uploaded: torch.cuda.Event | None = None  # the last host->device copy of `host`

    # ---- buffers -------------------------------------------------------------------------------------
    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def _size(self, bs: int) -> int:
        """int32 values of bucket `bs`'s inputs: ids, positions, slots, context lengths, block tables, and
        with `longest_first` the rows' launch order."""
        return bs * (4 + self.width + int(self.longest_first))

    def _views(self, bs: int) -> dict[str, torch.Tensor]:
        p = self.packed
        return {
            "ids": p[0:bs],
            "pos": p[bs : 2 * bs],
            "slots": p[2 * bs : 3 * bs],
            "seq_lens": p[3 * bs : 4 * bs],
            "block_tables": p[4 * bs : 4 * bs + bs * self.width].view(bs, self.width),
            "rows": p[4 * bs + bs * self.width : self._size(bs)],  # empty without `longest_first`
        }

    def _fill_host(self, bs: int, token_ids, positions, block_tables) -> None:
        """Write a step's inputs (n <= bs rows) into the pinned buffer in bucket `bs`'s layout."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the pinned buffer may still be in flight to the device
        n = len(token_ids)
        h = self.host_np
        bsz = self.block_size
        h[0:n] = token_ids
        h[n:bs] = 0
        h[bs : bs + n] = positions
        h[bs + n : 2 * bs] = 0
        pos = np.asarray(positions, dtype=np.int64)
        tables = h[4 * bs : 4 * bs + bs * self.width].reshape(bs, self.width)
        tables[:] = 0
        slots = h[2 * bs : 3 * bs]
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
        if n:
            blocks = tables[np.arange(n), pos // bsz].astype(np.int64)
            slots[:n] = blocks * bsz + pos % bsz
        slots[n:bs] = -1
        h[3 * bs : 3 * bs + n] = pos + 1
        h[3 * bs + n : 4 * bs] = 1
        if self.longest_first:
            rows = h[4 * bs + bs * self.width : self._size(bs)]
            rows[:n] = np.argsort(-pos, kind="stable")
            rows[n:] = np.arange(n, bs)  # padding rows (context 1) last

    def _upload(self, bs: int) -> None:
        size = self._size(bs)
        self.packed[:size].copy_(self.host[:size], non_blocking=True)
        if self._uploaded is None:
            self._uploaded = torch.cuda.Event()
        self._uploaded.record()

    def _metadata(self, bs: int) -> AttentionMetadata:
        from qwick.layers.attention.triton_backend import _TritonPlan

        v = self._views(bs)
        md = AttentionMetadata(
            num_rows=bs,
            num_tokens=bs,
            block_size=self.block_size,
            slot_mapping=v["slots"],  # replaced by the int64 copy inside the captured forward
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=v["seq_lens"],
            block_tables=v["block_tables"],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[self.max_model_len] * bs,
        )
        md.plan["triton"] = _TritonPlan(
            num_decode=bs,
            decode_rows=v["rows"] if self.longest_first else self.decode_rows[:bs],
            decode_max_seq_len=self.max_model_len,
            extend_rows=[],
        )
        return md

    def _forward(self, bs: int, md: AttentionMetadata) -> torch.Tensor:
        """The captured body: int32 inputs -> int64 (ids, positions and slots lie side by side: one
        conversion kernel for the three), then the model forward."""
        ids, pos, slots = self.packed[: 3 * bs].long().split(bs)
        md.slot_mapping = slots
        with set_forward_context(md):
            return self.model(ids, pos)

    # ---- capture -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_eager(
        self, bs: int, md: AttentionMetadata | None = None, splits: int | None = None
    ) -> torch.Tensor:
        """One padded all-padding forward at bucket `bs` (memory profiling, warm-up); touches no KV.
        `md` (from `_metadata(bs)`) keeps the attention scratch the forward allocates, as a graph does.
        `splits`: the decode split count to pin (None: the heuristic's at max_model_len)."""
        self._fill_host(bs, [], [], [])
        self._upload(bs)
        md = md if md is not None else self._metadata(bs)
        return self._with_splits(bs, lambda: self._forward(bs, md), splits)

    def profile_pool_bytes(self) -> int:
        """About the bytes the graphs' shared pool will hold, measured before capture: every bucket's
        forward run eagerly in capture order, each keeping its output and attention scratch alive as its
        graph will (the pool holds the largest bucket's activations plus what every graph keeps)."""

        def run_all() -> list:
            kept = []
            for splits in self._split_sets():
                for bs in reversed(self.buckets):
                    md = self._metadata(bs)
                    kept.append((md, self.run_eager(bs, md, splits)))
            return kept

        return peak_allocated_bytes(run_all, self.device)

    def _split_sets(self) -> list[int | None]:
        """The graph sets to capture, by pinned split count: the heuristic's (None), then one split when
        short-context graphs are on."""
        short = self.short_context > 0 and hasattr(self.backend, "fixed_num_splits")
        return [None, 1] if short else [None]

    def _with_splits(self, bs: int, fn, splits: int | None = None):
        if not hasattr(self.backend, "fixed_num_splits"):
            return fn()
        old = self.backend.fixed_num_splits
        if splits is None:
            self.backend.fixed_num_splits = None
            splits = self.backend.num_splits(bs, self.num_kv_heads, self.max_model_len)
        self.backend.fixed_num_splits = splits
        try:
            return fn()
        finally:
            self.backend.fixed_num_splits = old

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # capture empties the cache itself: measure from an empty one
        before = torch.cuda.memory_reserved(self.device)
        with gc_paused():
            self._capture_all()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # drops the warm-ups' cached blocks; the graphs' pool stays
        self.graph_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info(
            "captured %d decode CUDA graphs (batch %d..%d) in %.1f s, %.1f MiB",
            len(self.graphs) + len(self.short_graphs),
            self.buckets[0],
            self.max_bs,
            time.perf_counter() - t0,
            self.graph_bytes / 2**20,
        )

    def _capture_all(self) -> None:
        attn = self.model.attention_layers()[0]
        reads_early = getattr(self.backend, "reads_lone_row_early", None)  # measured only with those reads
        one_row = reads_early is not None and reads_early(attn.head_dim, attn.kv_cache)
        self.short_context_one_row = SHORT_CONTEXT_ONE_ROW if one_row else 0
        for splits in self._split_sets():
            graphs = self.graphs if splits is None else self.short_graphs
            for bs in reversed(self.buckets):
                self._fill_host(bs, [], [], [])
                self._upload(bs)
                md = self._metadata(bs)

                def body(bs=bs, md=md):
                    self._forward(bs, md)  # warm-up: Triton compiles, cuBLAS picks its kernels
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        hidden = self._forward(bs, md)
                    return graph, hidden

                graph, hidden = self._with_splits(bs, body, splits)
                if self.pool is None:
                    self.pool = graph.pool()
                graphs[bs] = _Graph(bs, graph, hidden, md)

    # ---- replay --------------------------------------------------------------------------------------
    def can_run(self, num_rows: int, max_table_len: int) -> bool:
        return 0 < num_rows <= self.max_bs and max_table_len <= self.width and bool(self.graphs)

    def replay(
        self,
        token_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        patch: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Run one decode step (row i: token_ids[i] at positions[i]); returns hidden states [bs, hidden]
        whose first len(token_ids) rows are the step's (a view of the graph's output: read it before the
        next replay). `patch(ids)` may overwrite token ids on the device after the upload (async
        scheduling fills in tokens the host has not seen yet)."""
        bs = self.bucket_for(len(token_ids))
        limit = short_context_limit(bs, self.short_context, self.short_context_one_row)
        short = self.short_graphs and max(positions) < limit  # every context within the limit
        g = (self.short_graphs if short else self.graphs)[bs]
        self._fill_host(bs, token_ids, positions, block_tables)
        self._upload(bs)
        if patch is not None:
            patch(self._views(bs)["ids"])
        g.graph.replay()
        self.num_replays += 1
        self.num_short_replays += bool(short)
        return g.hidden
