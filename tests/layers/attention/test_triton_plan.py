"""The Triton attention backend's host-side choices (no kernel runs, so no GPU): the order of prefill tiles,
where a lone decode row is read early."""

from __future__ import annotations

import torch

from qwick.layers.attention.backend import FP8_KV_DTYPE, AttentionRow
from qwick.layers.attention.triton_backend import TritonAttentionBackend


def test_extend_tiles_launch_the_most_keys_first():
    """Every query tile of every multi-token row appears once, ordered by the keys it reads (cached context
    plus its offset), longest first; decode rows have none."""
    backend = TritonAttentionBackend(16, torch.device("cpu"))
    rows = [
        AttentionRow(0, 300, list(range(1, 20))),  # a fresh prompt: tiles at 0, 64, ..., 256
        AttentionRow(40, 1, [20, 21, 22]),  # decode
        AttentionRow(1000, 100, list(range(23, 93))),  # a chunk after 1000 cached tokens
    ]
    md = backend.build_metadata(rows)
    tiles = backend._tiles(backend._plan(md), md, 64).tolist()
    assert sorted(map(tuple, tiles)) == sorted([(0, m0) for m0 in range(0, 300, 64)] + [(2, 0), (2, 64)])
    keys = [(1000 if row == 2 else 0) + m0 for row, m0 in tiles]
    assert keys == sorted(keys, reverse=True)
    assert tiles[:2] == [[2, 64], [2, 0]]


def test_reads_lone_row_early_where_the_whole_tile_applies():
    """`reads_lone_row_early`, which lets a lone row's one-split graph serve longer contexts, is true where
    `_decode` reads that row early in 256-key tiles: 16-bit pages, heads of at most 128, the tuned
    launch shapes, the early reads on (on a CPU device, which has no programmatic dependent launch, they
    run unconditionally) and the kernel writing the new key."""

    def cache(dtype):
        return torch.zeros(2, 1, 16, 1, 8, dtype=dtype)

    tri = TritonAttentionBackend(16, torch.device("cpu"))
    assert tri.reads_lone_row_early(128, cache(torch.bfloat16))
    assert tri.reads_lone_row_early(64, cache(torch.float16))
    assert not tri.reads_lone_row_early(256, cache(torch.bfloat16))  # the tile would not fit
    assert not tri.reads_lone_row_early(128, cache(FP8_KV_DTYPE))
    assert not tri.reads_lone_row_early(128, cache(torch.float32))
    tri.decode_config = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    assert not tri.reads_lone_row_early(128, cache(torch.bfloat16))
    for flag in ("decode_preload", "fuse_decode_write"):  # no early reads; no new key to write in them
        tri = TritonAttentionBackend(16, torch.device("cpu"))
        setattr(tri, flag, False)
        assert not tri.reads_lone_row_early(128, cache(torch.bfloat16))
