"""Where a long prompt's time to first token goes: the wall time of each prefill step (chunk) and a kernel
table of one whole prefill.

    python benchmarks/long_prefill_profile.py [shape] [prompt_len] [max_model_len]

A 32k prompt runs as chunks of `max_num_batched_tokens` (8192): if the chunks' times grow with the cached
prefix, attention over the prefix is what grows; the kernel table says which kernel.
"""

import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
from qwick import LLM, SamplingParams  # noqa: E402
from qwick.bench.shapes import model_dir_for_shape  # noqa: E402

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-7b"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 32000
max_len = int(sys.argv[3]) if len(sys.argv) > 3 else 32768
llm = LLM(model_dir_for_shape(shape), load_format="dummy", max_model_len=max_len, enable_prefix_caching=False)
eng = llm.llm_engine
g = torch.Generator().manual_seed(0)


def prefill_steps() -> list[float]:
    """One prompt, one output token; the wall time of each engine step (synchronized), in ms."""
    eng.add_request(
        torch.randint(100, 150000, (n,), generator=g).tolist(),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
    )
    times = []
    while eng.has_unfinished_requests():
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return times


prefill_steps()  # warm-up
runs = [prefill_steps() for _ in range(3)]
per_step = [statistics.median(r[i] for r in runs) for i in range(len(runs[0]))]
print(f"{n}-token prompt: {len(per_step)} steps, ms each (medians of 3): {[round(t, 1) for t in per_step]}")
print(f"sum {sum(per_step):.1f} ms")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    prefill_steps()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
