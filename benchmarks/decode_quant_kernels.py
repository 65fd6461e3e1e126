"""The per-token quantization that W8A8 decode adds to the RMSNorm and SiLU-and-mul kernels, at one row.

At batch 1 these kernels run as one program per row, so their time is latency, not bandwidth: a kernel
profile of an int8 decode step (benchmarks/decode_step_profile.py) showed RMSNorm at 5.0 us with codes
against 2.0 without, and SiLU-and-mul at 8.3 against 1.8. Each variant is launched 200 times in one CUDA
graph and timed by its replays, so launch gaps are those of a decode step's graph.

    python benchmarks/decode_quant_kernels.py
"""

import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from qwick.bench import gpu_timing  # noqa: E402
from qwick.kernels.elementwise import rms_norm, silu_and_mul, silu_and_mul_quant  # noqa: E402
from qwick.layers.linear import RowQuant  # noqa: E402
from qwick.quantization.w8a8 import _MIN_AMAX, qmax  # noqa: E402

HIDDEN, INTER, REPS = 3584, 18944, 200


def graph_us(fn) -> float:
    """Mean time per call of `fn`, captured REPS times in one CUDA graph and replayed."""
    return gpu_timing.graph_us(fn, calls=REPS, replays=10)


def main() -> None:
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(1, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    print(f"{'kernel (1 row)':44s} {'us':>6}")
    print(f"{'rms_norm + residual':44s} {graph_us(lambda: rms_norm(x, w, 1e-6, res)):6.2f}")
    print(f"{'silu_and_mul':44s} {graph_us(lambda: silu_and_mul(h)):6.2f}")
    for qdtype in (torch.float8_e4m3fn, torch.int8):
        quant = RowQuant(qdtype, qmax(qdtype), _MIN_AMAX)
        name = str(qdtype).split(".")[-1]
        for warps in (4, 8, 16, 32):
            us = graph_us(lambda q=quant, nw=warps: rms_norm(x, w, 1e-6, res, q, num_warps=nw))
            print(f"{'rms_norm + residual + ' + name + f' codes, {warps} warps':44s} {us:6.2f}")
        for group in (256, 512, 1024):  # a scale per group of columns, one program per group
            grouped = RowQuant(qdtype, qmax(qdtype), _MIN_AMAX, group)
            us = graph_us(lambda q=grouped: silu_and_mul(h, q))
            print(f"{'silu_and_mul + ' + name + f' codes per {group} columns':44s} {us:6.2f}")
        for block, warps in ((4096, 16), (2048, 8), (8192, 16), (8192, 32), (16384, 32), (32768, 32)):
            us = graph_us(lambda q=quant, b=block, nw=warps: silu_and_mul_quant(h, q, b, nw))
            print(f"{'silu_and_mul + ' + name + f' codes, {block} x {warps} warps':44s} {us:6.2f}")


if __name__ == "__main__":
    main()
