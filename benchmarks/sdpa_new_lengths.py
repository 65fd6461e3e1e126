"""The first call of whole-prompt SDPA at a prompt length not seen before, per SDPA backend: cuDNN builds an
execution plan per shape, flash attention does not. Serving sees a new length with almost every prompt.

    python benchmarks/sdpa_new_lengths.py
"""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

heads, kv_heads, dim = 28, 4, 128


def call(n: int) -> float:
    q = torch.randn(1, heads, n, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t = time.perf_counter()
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
    with sdpa_kernel([backend]):
        call(700)
        first = [call(n) for n in range(1500, 1510)]
        again = [call(n) for n in range(1500, 1510)]
        steady = sorted(call(2048) for _ in range(20))[10]
    print(
        f"{name}: new lengths {[round(x, 2) for x in first]} ms; again {[round(x, 2) for x in again]} ms; "
        f"2048 steady {steady:.3f} ms",
        flush=True,
    )
