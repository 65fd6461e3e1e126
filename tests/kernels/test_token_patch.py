"""The in-flight token patch of async scheduling (`qwick.kernels.token_patch`): the kernel writes what torch's
gather + scatter writes, for both id types, one row and several blocks of rows; the CPU path too."""

from __future__ import annotations

import pytest
import torch

from qwick.kernels.token_patch import PATCH_BLOCK, patch_token_ids


def _check(device: torch.device, dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 1000, (n + 40,), generator=g, dtype=dtype)
    prev = torch.randint(0, 150000, (n + 7,), generator=g)  # sampled ids: int64
    dst = torch.randperm(n + 40, generator=g)[:n]
    src = torch.randperm(n + 7, generator=g)[:n]
    want = ids.clone()
    want[dst] = prev[src].to(dtype)
    got = ids.to(device)
    patch_token_ids(got, prev.to(device), torch.cat([dst, src]).to(device), n)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [1, 3, PATCH_BLOCK + 5])
def test_patch_kernel_writes_the_previous_tokens(dtype, n):
    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    _check(torch.device("cuda"), dtype, n)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_patch_on_the_cpu(dtype):
    _check(torch.device("cpu"), dtype, 5)
