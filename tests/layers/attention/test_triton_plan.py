"""The Triton attention backend's host-side plan (no kernel runs, so no GPU): the order of prefill tiles."""

from __future__ import annotations

import torch

from qwick.layers.attention.backend import AttentionRow
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
