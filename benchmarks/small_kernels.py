"""The per-step kernels that showed up in the fp8 workload-3 profile beyond the GEMMs and attention: the
fused sampling race over a 152k vocabulary (`do_bench` medians), then SiLU-and-mul and RMSNorm with
per-token fp8 codes at qwen2.5-7b's (and 14b's) sizes, timed in CUDA graphs as a step runs them
(`qwick.bench.gpu_timing`). SiLU-and-mul: two passes of 4096-wide steps (the launch before the one-pass
kernel) against the whole row in registers, each with its output written and codes-only
(`RowQuant.codes_only`, what the W8A8 layers ask for). GB/s counts the bytes each variant must move.

    python benchmarks/small_kernels.py [race] [silu] [norm]
"""

import functools
import os
import sys
from dataclasses import replace

import torch
from triton.testing import do_bench

sys.path.insert(0, os.getcwd())
from qwick.bench.gpu_timing import graph_us  # noqa: E402
from qwick.kernels.elementwise import rms_norm, silu_and_mul, silu_and_mul_quant  # noqa: E402
from qwick.kernels.sampling import race_sample  # noqa: E402
from qwick.layers.linear import RowQuant  # noqa: E402

VOCAB = 152064
QUANT = RowQuant(torch.float8_e4m3fn, 448.0, 1e-12)
CODES_ONLY = replace(QUANT, codes_only=True)


def race() -> None:
    bench = functools.partial(do_bench, warmup=10, rep=50)
    print(f"{'race rows':>10} {'us':>8} {'GB/s':>7}")
    for b in (1, 8, 64, 256):
        logits = torch.randn(b, VOCAB, device="cuda").to(torch.bfloat16)
        temp = torch.full((b,), 0.7, device="cuda")
        us = bench(functools.partial(race_sample, logits, temp, 1 << 40)) * 1e3
        print(f"{b:10d} {us:8.1f} {logits.numel() * 2 / us / 1e3:7.0f}", flush=True)


def silu_variants(x: torch.Tensor) -> dict:
    """name -> call: the two-pass launch, then the one-pass kernel on 8 / 16 / 32 warps, each written and
    codes-only."""
    variants, run = {}, functools.partial(silu_and_mul_quant, x)
    for quant, tag in ((QUANT, ""), (CODES_ONLY, ", codes only")):
        variants["2 passes" + tag] = functools.partial(run, quant, 4096, 16, one_pass=False)
        for warps in (8, 16, 32):
            variants[f"1 pass {warps}w{tag}"] = functools.partial(run, quant, num_warps=warps)
    return variants


def silu() -> None:
    for n in (18944, 13824):
        print(f"\nSiLU-and-mul with fp8 codes, {n} columns: us per call in a CUDA graph [GB/s]")
        for rows in (16, 64, 128, 256, 2048, 8192):
            x = torch.randn(rows, 2 * n, device="cuda").to(torch.bfloat16)
            line = [f"{rows:5d} rows: bf16 plain {graph_us(functools.partial(silu_and_mul, x)):.1f}"]
            for name, fn in silu_variants(x).items():
                us = graph_us(fn)
                moved = rows * n * (4 + 1 + (0 if "codes only" in name else 2))
                line.append(f"{name} {us:.1f} [{moved / us / 1e3:.0f}]")
            print("; ".join(line), flush=True)


def norm() -> None:
    for n in (3584, 5120):
        print(f"\nRMSNorm + residual with fp8 codes, {n} columns: us per call in a CUDA graph")
        w = torch.randn(n, device="cuda").to(torch.bfloat16)
        for rows in (64, 256, 2048, 8192):
            x = torch.randn(rows, n, device="cuda").to(torch.bfloat16)
            res = torch.randn_like(x)
            quants = (None, QUANT, CODES_ONLY)
            times = [graph_us(functools.partial(rms_norm, x, w, 1e-6, res, q)) for q in quants]
            print(f"{rows:5d} rows: plain {times[0]:.1f}, codes {times[1]:.1f}, codes only {times[2]:.1f}")


if __name__ == "__main__":
    for part in sys.argv[1:] or ["race", "silu", "norm"]:
        {"race": race, "silu": silu, "norm": norm}[part]()
