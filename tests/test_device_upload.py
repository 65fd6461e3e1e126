"""`to_device`: every per-step upload's values and dtypes, from lists, numpy arrays and tensors; on a GPU
the copy goes through pinned memory, is correct once the stream runs it, and its pinned block is safely
reused by the next upload."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwick.device_upload import to_device


@pytest.mark.parametrize(
    "data", [[3, 1, 2], np.array([3, 1, 2], dtype=np.int64), torch.tensor([3, 1, 2]), [[1, 2], [3, 4]]]
)
def test_values_and_dtype_on_the_cpu(data):
    out = to_device(data, torch.int32, "cpu")
    assert out.dtype == torch.int32 and out.device.type == "cpu"
    assert out.tolist() == (data.tolist() if hasattr(data, "tolist") else data)


def test_empty_and_float():
    assert to_device([], torch.long, "cpu").shape == (0,)
    assert to_device([0.5, 2.0], torch.float32, "cpu").tolist() == [0.5, 2.0]


def test_lists_keep_their_values_through_numpy():
    """Lists of the common dtypes are converted through numpy; 64-bit values survive, and a dtype numpy
    is not asked for (bool) takes torch's conversion."""
    big = [2**40 + 3, -(2**35), 0]
    assert to_device(big, torch.int64, "cpu").tolist() == big
    out = to_device([True, False, True], torch.bool, "cpu")
    assert out.dtype == torch.bool and out.tolist() == [True, False, True]
    assert to_device(list(range(2048)), torch.long, "cpu").tolist() == list(range(2048))


@pytest.mark.gpu
def test_upload_returns_while_the_gpu_is_busy():
    """The point of `to_device`: the host does not wait for kernels queued before the copy. A copy from
    pageable memory would wait for the spin kernel below to end; this one returns while it still runs."""
    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    to_device([0], torch.long, "cuda")  # warm the pinned allocator
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)  # a kernel that spins for a couple of seconds
    busy = torch.cuda.Event()
    busy.record()
    out = to_device(list(range(4096)), torch.long, "cuda")
    assert not busy.query(), "to_device waited for the kernels queued before it"
    torch.cuda.synchronize()
    assert out.sum().item() == sum(range(4096))


@pytest.mark.gpu
def test_pinned_uploads_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    outs = [to_device(list(range(i, i + 1000)), torch.long, "cuda") for i in range(50)]
    torch.cuda.synchronize()
    for i, out in enumerate(outs):  # later uploads reuse pinned blocks only after earlier copies ran
        assert out.device.type == "cuda" and out[0].item() == i and out[-1].item() == i + 999
