"""Host-to-device copies of a step's small inputs that never wait for the device.

CUDA queues a copy from pinned (page-locked) host memory on the stream like a kernel, but a copy from
ordinary pageable memory first synchronizes with the stream ("a stream sync is performed before the copy is
initiated": CUDA's API synchronization behavior), so `torch.tensor(ids).to("cuda", non_blocking=True)` made
the host wait for the previous step's kernels. With async scheduling that wait is exactly the overlap the
engine is after, so every per-step upload (input ids and positions, attention plans, sampling parameters,
the in-flight token patch) goes through here. Pinned blocks come from PyTorch's caching host allocator,
which hands a block out again only after the copies that read it have run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# A list goes through numpy: `np.array` of 2,048 Python ints takes ~27 us, `torch.as_tensor` ~97 us (a
# prefill's token ids and positions are such lists).
_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def to_device(data: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`data` (a list, numpy array or CPU tensor) as a `dtype` tensor on `device`, copied without a wait."""
    device = torch.device(device)
    if isinstance(data, list) and dtype in _NUMPY_DTYPES:
        data = np.array(data, dtype=_NUMPY_DTYPES[dtype])
    if isinstance(data, np.ndarray):
        cpu = torch.from_numpy(data).to(dtype)
    else:
        cpu = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return cpu.to(device)
    pinned = torch.empty(cpu.shape, dtype=dtype, pin_memory=True)
    pinned.copy_(cpu)
    return pinned.to(device, non_blocking=True)
