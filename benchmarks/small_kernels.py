"""The two per-step kernels that showed up in the fp8 workload-3 profile beyond the GEMMs and attention:
the fused sampling race over a 152k vocabulary, and SiLU-and-mul with per-token fp8 codes at qwen2.5-7b's
intermediate size (18944), each swept over its launch shape (the race by programs per SM). Medians of
`do_bench_cudagraph` for the race (its host side would dominate `do_bench` below ~256 rows), `do_bench`
for SiLU-and-mul; GB/s counts the bytes each kernel must move (logits read; gate/up read, output and
codes written).

    python benchmarks/small_kernels.py [race|silu]
"""

import functools
import inspect
import os
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.getcwd())
from qwick.kernels.elementwise import silu_and_mul, silu_and_mul_quant  # noqa: E402
from qwick.kernels.sampling import race_sample  # noqa: E402
from qwick.layers.linear import RowQuant  # noqa: E402

VOCAB, N = 152064, 18944
DEFAULT_PER_SM = inspect.signature(race_sample).parameters["programs_per_sm"].default
bench = functools.partial(do_bench, warmup=10, rep=50)

WHAT = sys.argv[1:] or ["race", "silu"]


def race() -> None:
    print(f"{'race rows':>10} {'per SM':>6} {'us':>8} {'GB/s':>7}   (programs per SM; * the default)")
    for b in (1, 8, 64, 128, 256):
        logits = torch.randn(b, VOCAB, device="cuda").to(torch.bfloat16)
        temp = torch.full((b,), 0.6, device="cuda")  # workload 3's temperature
        for per_sm in (2, 4, 8, 16, 32):
            run = functools.partial(race_sample, logits, temp, 1 << 40, programs_per_sm=per_sm)
            us = do_bench_cudagraph(run, rep=50, return_mode="median") * 1e3
            star = "*" if per_sm == DEFAULT_PER_SM else " "
            print(f"{b:10d} {per_sm:5d}{star} {us:8.1f} {logits.numel() * 2 / us / 1e3:7.0f}", flush=True)


if "race" in WHAT:
    race()
if "silu" not in WHAT:
    sys.exit(0)
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
