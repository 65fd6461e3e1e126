"""CUDA graphs for prefill steps (a prompt chunk, alone or beside a few decode rows), captured at bucketed
token counts.

A short prompt's prefill is bound by the host, not the GPU: eagerly, the forward of a 7b model launches
about 340 kernels at ~0.5 ms of Python per layer (the host has launched a 2048-token prefill's 28 layers
only after 15-18 ms, BENCHMARKS.md), while the GPU needs a few ms for a 128-token prompt. So when a step
is one prompt chunk and nothing else (one user's request arriving at an idle server: the time to first
token that a latency-first server is judged by), or that chunk beside up to three decode rows (`max_rows`),
it replays a graph of the whole forward instead.

Design (the decode graphs' in `qwick.runner.cuda_graphs`, for one row of many tokens):
- Buckets of 32, 64, 128, 256, 384, 512, 768 and 1024 tokens, up to `max_tokens`; a chunk of n tokens
  (n > 1, after any cached prefix) replays the smallest bucket >= n. Past ~1024 tokens the GPU's work
  outlasts the host's launches, which eager steps then overlap (the gain is 4 ms of 26 at 1024 tokens).
- One int32 device buffer holds a step's inputs; for bucket P the layout is `[ids(P) | positions(P) |
  slots(P) | seq_len, 0, n, n - 1 | block table(W)]`: the context length after the chunk, the row's query
  range `query_start_loc = [0, n]`, the index of the chunk's last token, then the block table (W columns
  for `max_model_len`). A step fills a host buffer in that layout and makes one host-to-device copy.
- Padding tokens n..P-1: token 0 at position 0, slot -1 (the KV write skips it). The prefill kernel reads
  the row's query count n from the buffer and masks the queries past it, so padding writes no key and no
  real token attends to one. Padding rows go through the linear layers and norms, which treat rows
  independently, and never leave the model: the last layer runs for the chunk's last token alone
  (`OutputRows`, a one-query row over the context: the decode kernel, its split count the backend's at
  `max_model_len`), as in eager steps.
- The prefill kernel's tiles and the decode kernel's split scratch are planned on the first (warm-up)
  forward and kept in each graph's metadata, so the captured forward allocates only from the graph pool.
- The graphs share the decode graphs' memory pool: replays run one after another on one stream.

Several rows (`max_rows` > 1, `PREFILL_GRAPH_ROWS`, 4 by default): a step of up to `max_rows` rows of any
lengths, e.g. a new prompt's chunk beside a few decode rows, one-query rows of the prefill kernel here,
fits a bucket by its total tokens. The layout then holds each row's context length, query
start and last token, `max_rows` block tables, and the prefill kernel's query tiles (row, first query),
planned per step on the host in the backend's order. The tiles past a step's real ones start past their
row's queries, so the kernel's programs for them return at once (`SPARE_TILES`, compiled for these graphs
only). Unused rows have no queries, a context of
one token over the null block and their last token at 0: their outputs are computed and not read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from qwick.forward_context import set_forward_context
from qwick.layers.attention.backend import AttentionMetadata, OutputRows
from qwick.runner.cuda_graphs import gc_paused, peak_allocated_bytes

logger = logging.getLogger(__name__)

# Rows a prefill graph takes: 1, one prompt chunk alone; more, steps of that many rows of any lengths (decode
# rows beside a new prompt's chunk). H200, 7b shapes, bf16, TTFT of a 128-token prompt beside 1 / 3 decoders
# (`gpu_session.sh graphrows`): 11.6 / 11.7 ms with 4 rows, 38.7 / 38.2 with 1 (an eager step); a lone
# prompt's 5.4-5.7 against 5.4.
PREFILL_GRAPH_ROWS = 4
# The largest prompt chunk a prefill graph takes (0: no prefill graphs). H200, qwen2.5-7b shapes, TTFT of
# a lone prompt with the graphs against without (medians, alternating in one process): bf16 5.4 against
# 16.9 ms at 128 tokens, 11.4 / 22.9 at 512, 21.9 / 25.8 at 1024; int4 8.7 / 42.4 at 128, 26.1 / 28.2 at 1024.
PREFILL_GRAPH_TOKENS = 1024
_BUCKETS = (32, 64, 128, 256, 384, 512, 768, 1024)


def prefill_buckets(max_tokens: int) -> list[int]:
    """The token counts of the prefill graphs: `_BUCKETS` up to `max_tokens`, and `max_tokens` itself
    when it is smaller than the first (a model whose steps hold fewer tokens)."""
    if max_tokens < 2:
        return []
    buckets = [b for b in _BUCKETS if b <= max_tokens]
    return buckets or [max_tokens]


@dataclass
class _PrefillGraph:
    tokens: int
    graph: torch.cuda.CUDAGraph | None
    hidden: torch.Tensor  # [max_rows, hidden]: each row's last token after the final norm
    metadata: tuple[AttentionMetadata, AttentionMetadata]  # kept alive: their plans hold the scratch


class PrefillGraphRunner:
    """Captures and replays the model forward for steps of up to `max_rows` rows and 2..max_tokens tokens
    (one prompt chunk alone, with `max_rows` 1)."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend,
        *,
        max_tokens: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype = torch.bfloat16,
        max_rows: int = 1,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_rows = max_rows
        self.buckets = prefill_buckets(min(max_tokens, max_model_len))
        self.width = (max_model_len + block_size - 1) // block_size
        # The prefill kernel's query-tile height per bucket (its launch shape for p-query rows), which a
        # several-row step's uploaded tiles follow; looked up on every replay, so worked out once here.
        self._tile_rows: dict[int, int] = {}
        if max_rows > 1:
            head_dim, itemsize = model.attention_layers()[0].head_dim, dtype.itemsize
            self._tile_rows = {p: backend.prefill_tile_rows(head_dim, itemsize, p) for p in self.buckets}
        size = max((self._size(p) for p in self.buckets), default=0)
        self.packed = torch.zeros(size, dtype=torch.int32, device=device)
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.host_np = self.host.numpy()
        self.one_query = torch.arange(max_rows + 1, dtype=torch.int32, device=device)  # last tokens' queries
        self.decode_rows = torch.arange(max_rows, dtype=torch.int32, device=device)
        self.graphs: dict[int, _PrefillGraph] = {}
        self.num_replays = 0
        self.graph_bytes = 0
        self._uploaded: torch.cuda.Event | None = None  # the last host->device copy of `host`

    # ---- buffers -------------------------------------------------------------------------------------
    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def tile_rows(self, p: int) -> int:
        """The prefill kernel's query-tile height at bucket `p` (several-row graphs only)."""
        return self._tile_rows[p]

    def _num_tiles(self, p: int) -> int:
        """Query tiles a step of up to `max_rows` rows and p tokens can need (none stored with one row:
        its tiles are the bucket's, planned once)."""
        if self.max_rows == 1:
            return 0
        return -(-p // self.tile_rows(p)) + self.max_rows - 1

    def _size(self, p: int) -> int:
        r = self.max_rows
        return 3 * p + 3 * r + 1 + r * self.width + 2 * self._num_tiles(p)

    def _views(self, p: int) -> dict[str, torch.Tensor]:
        b, r, w = self.packed, self.max_rows, self.width
        rows = 3 * p  # where the per-row values start
        tables = rows + 3 * r + 1
        tiles = tables + r * w
        return {
            "ids": b[0:p],
            "pos": b[p : 2 * p],
            "slots": b[2 * p : 3 * p],
            "seq_len": b[rows : rows + r],
            "query_start_loc": b[rows + r : rows + 2 * r + 1],
            "last": b[rows + 2 * r + 1 : tables],
            "block_table": b[tables:tiles].view(r, w),
            "tiles": b[tiles : self._size(p)].view(-1, 2),
        }

    def _fill_host(self, p: int, rows: list[tuple[list[int], int, list[int]]]) -> None:
        """Write a step's rows (token ids, first position, block table; p tokens at most in all) into the
        host buffer in bucket `p`'s layout."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the pinned buffer may still be in flight to the device
        h, r, w, bs = self.host_np, self.max_rows, self.width, self.block_size
        at = 3 * p
        seq_lens = h[at : at + r]
        starts = h[at + r : at + 2 * r + 1]
        last = h[at + 2 * r + 1 : at + 3 * r + 1]
        tables = h[at + 3 * r + 1 : at + 3 * r + 1 + r * w].reshape(r, w)
        tables[:] = 0
        t = 0
        for i, (token_ids, start, block_table) in enumerate(rows):
            n = len(token_ids)
            pos = np.arange(start, start + n, dtype=np.int64)
            h[t : t + n] = token_ids
            h[p + t : p + t + n] = pos
            tables[i, : len(block_table)] = block_table
            h[2 * p + t : 2 * p + t + n] = tables[i, pos // bs].astype(np.int64) * bs + pos % bs
            seq_lens[i], starts[i], last[i] = start + n, t, t + n - 1
            t += n
        h[t:p] = 0  # padding tokens: token 0 at position 0, no KV write
        h[p + t : 2 * p] = 0
        h[2 * p + t : 3 * p] = -1
        k = len(rows)
        seq_lens[k:], starts[k:], last[k:] = 1, t, 0  # unused rows: no queries, one key (the null block)
        if r > 1:
            self._fill_tiles(p, rows, h[at + 3 * r + 1 + r * w : self._size(p)].reshape(-1, 2))

    def _fill_tiles(self, p: int, rows, tiles: np.ndarray) -> None:
        """The step's query tiles (row, first query), the most keys first as the backend plans them; the
        rest start past row 0's queries (their programs return at once)."""
        m = self.tile_rows(p)
        order = sorted(
            (
                (start + m0, i, m0)
                for i, (token_ids, start, _) in enumerate(rows)
                for m0 in range(0, len(token_ids), m)
            ),
            reverse=True,
        )
        tiles[:] = (0, p)
        tiles[: len(order)] = [(i, m0) for _, i, m0 in order]

    def _upload(self, p: int) -> None:
        size = self._size(p)
        self.packed[:size].copy_(self.host[:size], non_blocking=True)
        if self.device.type == "cuda":
            if self._uploaded is None:
                self._uploaded = torch.cuda.Event()
            self._uploaded.record()

    def _metadata(self, p: int) -> tuple[AttentionMetadata, AttentionMetadata]:
        """Bucket `p`'s attention metadata over the buffer's views: the step's rows as rows of up to p
        queries (the prefill kernel), and their last tokens as one-query rows (the decode kernel)."""
        from qwick.layers.attention.triton_backend import _TritonPlan

        v, r = self._views(p), self.max_rows
        common = dict(
            num_rows=r,
            block_size=self.block_size,
            seq_lens=v["seq_len"],
            block_tables=v["block_table"],
            max_seq_len=self.max_model_len,
            seq_lens_cpu=[self.max_model_len] * r,
        )
        chunk = AttentionMetadata(
            num_tokens=p,
            slot_mapping=v["slots"],  # replaced by the int64 copy inside the captured forward
            query_start_loc=v["query_start_loc"],
            max_query_len=p,
            query_lens_cpu=[p] * r,
            **common,
        )
        plan = _TritonPlan(
            num_decode=0, decode_rows=None, decode_max_seq_len=0, extend_rows=[(i, p) for i in range(r)]
        )
        if r > 1:  # the step's tiles, from the buffer (one row: the bucket's, planned at the warm-up)
            plan.tiles[self.tile_rows(p)] = v["tiles"]
            plan.spare_tiles = True
        chunk.plan["triton"] = plan
        last = AttentionMetadata(
            num_tokens=r,
            slot_mapping=v["slots"][:r],  # unused: the chunk's forward writes the keys and values
            query_start_loc=self.one_query,
            max_query_len=1,
            query_lens_cpu=[1] * r,
            **common,
        )
        last.plan["triton"] = _TritonPlan(
            num_decode=r, decode_rows=self.decode_rows, decode_max_seq_len=self.max_model_len, extend_rows=[]
        )
        return chunk, last

    def _forward(self, p: int, metadata: tuple[AttentionMetadata, AttentionMetadata]) -> torch.Tensor:
        """The captured body: int32 inputs -> int64, then the model forward to each row's last token. The
        ids, positions and slots lead the buffer and the rows' last tokens follow them closely: one
        conversion kernel for the span up to the last tokens' end."""
        chunk, last = metadata
        at = self._views(p)["last"].storage_offset() - self.packed.storage_offset()
        wide = self.packed[: at + self.max_rows].long()
        ids, pos, slots = wide[: 3 * p].split(p)
        chunk.slot_mapping = slots
        out = OutputRows.prebuilt(wide[at:], last)
        with set_forward_context(chunk):
            return self.model(ids, pos, out)

    # ---- capture -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_eager(self, p: int, rows: list[tuple[list[int], int, list[int]]] | None = None):
        """Bucket `p`'s forward, eagerly: for memory profiling, warm-ups and tests. Without rows, one token
        0 whose key and value land in the null block 0. Returns (hidden [max_rows, hidden], metadata)."""
        self._fill_host(p, rows or [([0], 0, [])])
        self._upload(p)
        metadata = self._metadata(p)
        hidden = self._forward(p, metadata)
        tiles = metadata[0].plan["triton"].tiles
        if self.max_rows > 1 and list(tiles) != [self.tile_rows(p)]:  # tiles planned from host lists
            raise RuntimeError(f"prefill graph tiles of {sorted(tiles)} rows, {self.tile_rows(p)} uploaded")
        return hidden, metadata

    def profile_pool_bytes(self) -> int:
        """About the bytes the graphs add to the shared pool: every bucket's forward run eagerly in
        capture order, each keeping its output and scratch alive as its graph will."""
        return peak_allocated_bytes(lambda: [self.run_eager(p) for p in reversed(self.buckets)], self.device)

    @torch.inference_mode()
    def capture(self, pool) -> None:
        """Capture every bucket, largest first, into `pool` (the decode graphs')."""
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        with gc_paused():
            for p in reversed(self.buckets):
                # Warm-up: Triton compiles, cuBLAS picks its kernels, the metadata's plans get their
                # tiles and scratch buffers (allocated here, outside the capture).
                _, metadata = self.run_eager(p)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self._forward(p, metadata)
                self.graphs[p] = _PrefillGraph(p, graph, hidden, metadata)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.graph_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info(
            "captured %d prefill CUDA graphs (%d..%d tokens) in %.1f s, %.1f MiB",
            len(self.graphs),
            self.buckets[0],
            self.buckets[-1],
            time.perf_counter() - t0,
            self.graph_bytes / 2**20,
        )

    # ---- replay --------------------------------------------------------------------------------------
    def can_run(self, num_tokens: int, num_rows: int, table_len: int) -> bool:
        return (
            bool(self.graphs)
            and 1 < num_tokens <= self.buckets[-1]
            and num_rows <= self.max_rows
            and table_len <= self.width
        )

    def replay(
        self,
        rows: list[tuple[list[int], int, list[int]]],
        patch: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Run one step of rows (token ids, first position, block table); returns the final hidden states
        of the rows' last tokens, [max_rows, hidden], rows past the step's unused (a view of the graph's
        output: read it before the next replay). `patch(ids)` may overwrite token ids (the step's, in row
        order) on the device after the upload, as in decode replays."""
        p = self.bucket_for(sum(len(ids) for ids, _, _ in rows))
        g = self.graphs[p]
        self._fill_host(p, rows)
        self._upload(p)
        if patch is not None:
            patch(self._views(p)["ids"])
        g.graph.replay()
        self.num_replays += 1
        return g.hidden
