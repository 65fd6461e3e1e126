"""fp8 decode steps at mid-size batches (32, 64, 128 rows) with the down projections on qwick's split-K
Triton GEMM (`rowwise_fp8_mm`, the default) or on cuBLAS (`off`): the end-to-end check of the choice
`benchmarks/fp8_mid_m_sweep.py` makes per layer. Median synchronous engine step over 64 output tokens.

    python benchmarks/fp8_mid_batch.py [on|off] [shape]
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from qwick import LLM, SamplingParams  # noqa: E402
from qwick.bench.shapes import model_dir_for_shape  # noqa: E402
from qwick.quantization.w8a8 import W8A8LinearMethod  # noqa: E402

mode = sys.argv[1] if len(sys.argv) > 1 else "on"
shape = sys.argv[2] if len(sys.argv) > 2 else "qwen2.5-7b"
if mode == "off":
    W8A8LinearMethod.rowwise_max_m = 0  # before loading: the CUDA graphs capture the path chosen then
llm = LLM(
    model_dir_for_shape(shape),
    load_format="dummy",
    max_model_len=4096,
    quantization="fp8",
    async_scheduling=False,
)
eng = llm.llm_engine
g = torch.Generator().manual_seed(0)
for bs in (32, 64, 128):
    for _ in range(bs):
        eng.add_request(
            torch.randint(100, 150000, (128,), generator=g).tolist(),
            SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
        )
    ts = []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t)
    med = statistics.median(ts[3:])
    print(f"rowwise {mode} bs {bs}: step {med * 1e3:.2f} ms -> {bs / med:.0f} tok/s", flush=True)
