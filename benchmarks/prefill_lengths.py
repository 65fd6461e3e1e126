"""Whether a prompt length the engine has not seen before costs more: the 2048-token prefill against
nearby lengths, per GEMM shape and for the whole time to first token.

1. Each qwen2.5-7b prefill GEMM through `F.linear` (cuBLAS), bf16, at M = 2048 and nearby M (CUDA events
   around 20 back-to-back calls, median of 5), and TFLOP/s.
2. The engine's time to first token at 2048 and at lengths near it, each length twice in a row: a cost
   paid once per new length shows as the first run slower than the second.

    python benchmarks/prefill_lengths.py
"""

import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
MS = [2048, 2047, 2046, 2044, 2040, 2032, 2049, 2056, 2064, 1999, 2001]


def gemm_us(m: int, n: int, k: int, reps: int = 20) -> float:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    F.linear(x, w)
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            F.linear(x, w)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


print("M     " + "".join(f"{name:>16s}" for name in SHAPES) + "   sum (us, x28 layers ms)")
for m in MS:
    us = [gemm_us(m, n, k) for n, k in SHAPES.values()]
    cells = "".join(f"{u:9.1f} {2 * m * n * k / u / 1e6:5.0f}T" for u, (n, k) in zip(us, SHAPES.values()))
    print(f"{m:5d} {cells}   {sum(us):7.1f} {sum(us) * 28 / 1e3:6.2f}", flush=True)

from qwick import LLM  # noqa: E402
from qwick.bench.engine_bench import first_token_seconds  # noqa: E402
from qwick.bench.shapes import model_dir_for_shape  # noqa: E402

llm = LLM(
    model_dir_for_shape("qwen2.5-7b"), load_format="dummy", max_model_len=4096, enable_prefix_caching=False
)
eng = llm.llm_engine
g = torch.Generator().manual_seed(0)


def ttft_ms(length: int) -> float:
    return 1e3 * first_token_seconds(eng, torch.randint(100, 150000, (length,), generator=g).tolist())


for _ in range(3):
    ttft_ms(2048)
print("TTFT 2048 x5: " + " ".join(f"{ttft_ms(2048):.2f}" for _ in range(5)))
for m in MS[1:]:
    first, second, third = ttft_ms(m), ttft_ms(m), ttft_ms(m)
    print(f"TTFT {m}: first {first:.2f}  second {second:.2f}  third {third:.2f}", flush=True)
