"""The backend interface's KV-cache layouts (`kv_cache_tensor`, `kv_layout_of`, `to_kv_layout`)."""

from __future__ import annotations

import pytest
import torch

from qwick.layers.attention.backend import AttentionRow, kv_cache_tensor, kv_layout_of, to_kv_layout
from qwick.layers.attention.torch_ref import TorchAttentionBackend


def _numbered(shape) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)


def test_both_layouts_have_the_same_logical_shape():
    nhd = kv_cache_tensor(_numbered, 3, 16, 4, 8, "NHD")
    hnd = kv_cache_tensor(_numbered, 3, 16, 4, 8, "HND")
    assert nhd.shape == hnd.shape == (2, 3, 16, 4, 8)
    assert nhd.is_contiguous() and kv_layout_of(nhd) == "NHD" and kv_layout_of(hnd) == "HND"
    # HND: a kv head's 16 slots of a block are one contiguous run of 16 x 8 values
    assert hnd.stride() == (3 * 4 * 16 * 8, 4 * 16 * 8, 8, 16 * 8, 1)


def test_to_kv_layout_keeps_every_value():
    nhd = kv_cache_tensor(_numbered, 3, 16, 4, 8, "NHD")
    hnd = to_kv_layout(nhd, "HND")
    assert kv_layout_of(hnd) == "HND" and torch.equal(hnd, nhd)
    assert torch.equal(to_kv_layout(hnd, "NHD"), nhd) and to_kv_layout(hnd, "NHD").is_contiguous()


def test_other_layouts_are_refused():
    nhd = kv_cache_tensor(_numbered, 3, 16, 4, 8, "NHD")
    with pytest.raises(ValueError, match="neither NHD nor HND"):
        kv_layout_of(nhd.transpose(3, 4))
    with pytest.raises(ValueError, match="unknown KV-cache layout"):
        kv_cache_tensor(_numbered, 3, 16, 4, 8, "NDH")


def test_the_torch_backend_reads_nhd_only():
    backend = TorchAttentionBackend(16, torch.device("cpu"))
    cache = kv_cache_tensor(lambda s: torch.zeros(s), 3, 16, 2, 8, "HND")
    md = backend.build_metadata([AttentionRow(0, 3, [1])])
    q, kv = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="reads an NHD KV cache, got HND"):
        backend.forward(q, kv, kv, cache, md, scale=1.0, sliding_window=None)
