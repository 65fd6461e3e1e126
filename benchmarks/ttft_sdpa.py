"""Whole prompts through torch's SDPA (`sdpa_prefill`, padded to `SDPA_BUCKET` multiples) against the paged
extend kernel: 2048-token time to first token, TTFT at lengths the engine has not seen, startup time, and
the attention kernels a prefill runs.

    python benchmarks/ttft_sdpa.py sdpa|paged [shape]
"""

import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
import qwick.layers.attention.triton_backend as tb  # noqa: E402
from qwick import LLM, SamplingParams  # noqa: E402
from qwick.bench.shapes import model_dir_for_shape  # noqa: E402

mode = sys.argv[1]
shape = sys.argv[2] if len(sys.argv) > 2 else "qwen2.5-7b"
if mode == "paged":
    tb.SDPA_MIN_TOKENS = None
t0 = time.perf_counter()
llm = LLM(model_dir_for_shape(shape), load_format="dummy", max_model_len=4096, enable_prefix_caching=False)
startup = time.perf_counter() - t0
eng = llm.llm_engine
g = torch.Generator().manual_seed(0)


def ttft_ms(length: int) -> float:
    eng.add_request(
        torch.randint(100, 150000, (length,), generator=g).tolist(),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
    )
    torch.cuda.synchronize()
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


for _ in range(3):
    ttft_ms(2048)
same = [ttft_ms(2048) for _ in range(10)]
new = [ttft_ms(n) for n in (2047, 2041, 2030, 1999, 1500, 1100, 3000, 2500, 777, 3999)]
print(f"{mode}: startup {startup:.1f} s; TTFT 2048 median {statistics.median(same):.2f} min {min(same):.2f}")
print(f"{mode}: new lengths " + " ".join(f"{x:.1f}" for x in new))
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    ttft_ms(2048)
for e in prof.key_averages():
    if any(s in e.key.lower() for s in ("attn", "attention", "fmha", "sdpa", "flash", "cudnn", "extend")):
        print(f"  {e.key[:90]:90s} {e.count:4d} calls {e.device_time_total / 1e3:7.2f} ms")
