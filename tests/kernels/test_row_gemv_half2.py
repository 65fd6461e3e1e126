"""The packed-fp16 batch-1 int4 GEMV (`qwick.kernels.row_gemv_half2`): its activation pairs and its
argument checks. Its products are tested beside the fp32 row GEMV's in test_row_gemv.py (exact decoding,
and the qwen2.5-7b shapes against float64). Under TRITON_INTERPRET=1 it runs on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from qwick.quantization.formats import rtn
from tests.triton_utils import gemv_workspace, triton_device

pytestmark = [pytest.mark.gpu, pytest.mark.interpret]


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pairs_are_the_fp16_activations_in_nibble_order(x_dtype):
    from qwick.kernels.row_gemv_half2 import X_DIV, half2_pairs

    dev = triton_device()
    x = (torch.randn(1, 8 * 300, generator=torch.Generator().manual_seed(1)) * 50).to(x_dtype)
    got = half2_pairs(x.to(dev)).cpu()
    xf = (x.float().reshape(-1, 8) / X_DIV).half()
    want = torch.stack([xf[:, :4], xf[:, 4:]], dim=-1).contiguous().view(torch.int32).reshape(-1, 4)
    assert torch.equal(got, want)


def test_mismatched_tiles_are_refused():
    from qwick.kernels.row_gemv import RowGemvConfig
    from qwick.kernels.row_gemv_half2 import w4_half2_gemv

    dev = triton_device()
    qw = rtn.quantize(torch.randn(64, 256), group_size=128).to(dev)
    x = torch.randn(1, 256, device=dev).half()
    with pytest.raises(ValueError, match="one group deep"):
        w4_half2_gemv(x, qw, None, gemv_workspace(dev), RowGemvConfig(64, 8, 1))
