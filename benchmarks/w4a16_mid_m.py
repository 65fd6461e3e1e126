"""int4 weights at 32 <= M <= 1024 rows (decode batches of 17+, short prefills): the W4A16 Triton kernel
(`quant_matmul`, dequantizing in registers) against what M > 16 takes today, one Triton kernel writing the
layer in bf16 then cuBLAS. qwen2.5-7b shapes, RTN int4 group 128 with zero points, us per call (CUDA
events over 20 calls after a warm-up), and the two outputs' relative difference.

    python benchmarks/w4a16_mid_m.py
"""

import os
import sys

sys.path.insert(0, os.getcwd())  # run from the repository root
import torch
import torch.nn.functional as F

from qwick.kernels.gemv import GemvWorkspace
from qwick.kernels.w4a16 import QuantGemvConfig, dequantize_int4, quant_matmul
from qwick.quantization.formats import rtn

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
MS = [32, 64, 128, 256, 512, 1024]
CONFIGS = {  # name -> launch shape for M > 16 (default_config's is the first)
    "bm64": QuantGemvConfig(128, 128, 1, num_warps=8, num_stages=3, block_m=64),
    "bm32": QuantGemvConfig(128, 128, 1, num_warps=4, num_stages=3, block_m=32),
    "bm128": QuantGemvConfig(128, 64, 1, num_warps=8, num_stages=3, block_m=128),
}


def _us(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / iters


ws = GemvWorkspace(torch.device("cuda"))
torch.manual_seed(0)
print(f"{'layer':>8} {'M':>5} {'dequant+cuBLAS':>15} " + " ".join(f"{n:>9}" for n in CONFIGS) + "  rel.diff")
for name, (n, k) in SHAPES.items():
    weight = rtn.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, 128, 4)
    for m in MS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, dequantize_int4(weight, x.dtype))
        dq = _us(lambda x=x, w=weight: F.linear(x, dequantize_int4(w, x.dtype)))
        cells, diff = [], 0.0
        for cfg in CONFIGS.values():
            try:
                y = quant_matmul(x, weight, None, ws, cfg)
                diff = max(diff, ((y.float() - ref.float()).norm() / ref.float().norm()).item())
                us = _us(lambda c=cfg, x=x, w=weight: quant_matmul(x, w, None, ws, c))
                cells.append(f"{us:9.1f}")
            except Exception as e:  # a launch shape the GPU cannot take
                cells.append(f"{type(e).__name__[:9]:>9}")
        print(f"{name:>8} {m:>5} {dq:15.1f} " + " ".join(cells) + f"  {diff:.1e}", flush=True)
