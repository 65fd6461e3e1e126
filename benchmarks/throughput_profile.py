"""Where offline-throughput time goes (workload 3: 256 requests, 100-1024 prompt and output tokens): each
engine step's wall time, split by kind (pure decode through a CUDA graph, or eager with prefill chunks), the
host share of it (time the CPU spends outside waiting on the GPU), and a kernel table of a window of steps.

    python benchmarks/throughput_profile.py [shape] [quantization]   # writes $OUT/throughput_profile.json
"""

import json
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
from qwick import LLM, SamplingParams  # noqa: E402
from qwick.bench.shapes import model_dir_for_shape  # noqa: E402
from qwick.bench.workloads import throughput_summary, workload3_requests  # noqa: E402

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-7b"
quantization = sys.argv[2] if len(sys.argv) > 2 else None
# Synchronous steps, timed one by one (async scheduling would overlap a step with the next one's host work).
llm = LLM(
    model_dir_for_shape(shape),
    load_format="dummy",
    max_model_len=4096,
    async_scheduling=False,
    quantization=quantization,
)
eng = llm.llm_engine
core = eng.core
vocab = core.runner.vocab_size
requests = workload3_requests(vocab)
for r in requests:
    eng.add_request(
        r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0.6, ignore_eos=True)
    )

steps = []  # (kind, wall seconds)
profiled = None
t_start = time.perf_counter()
while eng.has_unfinished_requests():
    n = len(steps)
    ctx = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if n in (10, 200) else None
    if ctx is not None:
        ctx.__enter__()
    replays = core.runner.num_graph_replays
    t = time.perf_counter()
    eng.step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    steps.append(("graph" if core.runner.num_graph_replays > replays else "eager", dt))
    if ctx is not None:
        ctx.__exit__(None, None, None)
        table = ctx.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=50)
        print(f"--- step {n} ({steps[-1][0]}) kernels ---\n{table}", flush=True)
        profiled = profiled or table
total = time.perf_counter() - t_start
report = {
    "shape": shape,
    "quantization": quantization,
    **throughput_summary(requests, total),
    "steps": len(steps),
}
for kind in ("graph", "eager"):
    ts = [dt for k, dt in steps if k == kind]
    if ts:
        report[kind] = {"steps": len(ts), "seconds": sum(ts), "median_ms": statistics.median(ts) * 1e3}
print(json.dumps(report, indent=1), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "throughput_profile.json"), "w") as f:
    json.dump({**report, "kernels": profiled}, f, indent=1)
