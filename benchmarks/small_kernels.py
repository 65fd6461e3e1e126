"""The two per-step kernels that showed up in the fp8 workload-3 profile beyond the GEMMs and attention:
the fused sampling race over a 152k vocabulary, and SiLU-and-mul with per-token fp8 codes at qwen2.5-7b's
intermediate size (18944), swept over its launch shape. `do_bench` medians; GB/s counts the bytes each
kernel must move (logits read; gate/up read, output and codes written).

    python benchmarks/small_kernels.py
"""

import functools
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.getcwd())
from qwick.kernels.elementwise import silu_and_mul, silu_and_mul_quant  # noqa: E402
from qwick.kernels.sampling import race_sample  # noqa: E402
from qwick.layers.linear import RowQuant  # noqa: E402

VOCAB, N = 152064, 18944
bench = functools.partial(do_bench, warmup=10, rep=50)

print(f"{'race rows':>10} {'us':>8} {'GB/s':>7}")
for b in (1, 8, 64, 256):
    logits = torch.randn(b, VOCAB, device="cuda").to(torch.bfloat16)
    temp = torch.full((b,), 0.7, device="cuda")
    us = bench(functools.partial(race_sample, logits, temp, 1 << 40)) * 1e3
    print(f"{b:10d} {us:8.1f} {logits.numel() * 2 / us / 1e3:7.0f}", flush=True)

quant = RowQuant(torch.float8_e4m3fn, 448.0, 1e-12)
print(f"\n{'silu rows':>10} {'block':>6} {'warps':>5} {'us':>8} {'GB/s':>7}   (bf16 silu_and_mul alone: us)")
for rows in (1, 16, 64, 256, 2048, 8192):
    x = torch.randn(rows, 2 * N, device="cuda").to(torch.bfloat16)
    plain = bench(functools.partial(silu_and_mul, x)) * 1e3
    moved = rows * N * (4 + 2 + 1)
    for block, warps in ((1024, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)):
        run = functools.partial(silu_and_mul_quant, x, quant, block, warps)
        us = bench(run) * 1e3
        print(
            f"{rows:10d} {block:6d} {warps:5d} {us:8.1f} {moved / us / 1e3:7.0f}   ({plain:.1f})", flush=True
        )
