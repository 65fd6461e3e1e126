"""int4 layers called eagerly (as prefills call them) against the same calls in a CUDA graph (as decode
steps replay them): the tiled W4A16 kernel (`w4_tiled_matmul`, default launch shape) and dequantize-
then-cuBLAS, qwen2.5-7b shapes, RTN int4 group 128, at 16/64/128 rows, with the split-K workspace of
serving (8M floats) and of the sweep (16M). Per call, us: the GPU's time (graph), the host's time to
issue an eager call, and an eager call's total. Where the host's time exceeds the GPU's, short prefills
wait on the host.

    python benchmarks/int4_eager_host.py
"""

import os
import sys
import time

sys.path.insert(0, os.getcwd())  # run from the repository root
import torch
import torch.nn.functional as F

from qwick.bench.gpu_timing import graph_us
from qwick.kernels.gemv import GemvWorkspace
from qwick.kernels.w4a16 import dequantize_int4, w4_tiled_matmul
from qwick.quantization.formats import rtn

SHAPES = {"qkv": (4608, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}


def eager_us(fn, iters: int = 20) -> tuple[float, float]:
    """(host time to issue one call, total time per call)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) * 1e6 / iters
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t0) * 1e6 / iters


for elems in (1 << 23, 1 << 24):
    ws = GemvWorkspace(torch.device("cuda"), max_elems=elems)
    for name, (n, k) in SHAPES.items():
        weight = rtn.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, 128, 4)
        for m in (16, 64, 128):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def tiled(x=x, w=weight, ws=ws):
                return w4_tiled_matmul(x, w, None, ws)

            def dequant(x=x, w=weight):
                return F.linear(x, dequantize_int4(w, x.dtype))

            host, total = eager_us(tiled)
            print(
                f"workspace {elems >> 20}M {name:8} M {m:4}  tiled: graph {graph_us(tiled):6.1f} eager host "
                f"{host:6.1f} total {total:6.1f} | dequant+cuBLAS: graph {graph_us(dequant):6.1f} "
                f"eager total {eager_us(dequant)[1]:6.1f}",
                flush=True,
            )
