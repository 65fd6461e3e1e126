"""Does the GPU wait for the host in offline throughput? Workload 3 (256 requests, 100-1024 prompt and output
tokens) with async scheduling as `qwick bench throughput` runs it.

- CUDA events around each step's queued work: the time between one step's last op and the next step's first
  is idle time between steps. A step's span also holds any wait for its own host work, since its first
  event is queued before the host builds its inputs.
- A kernel trace of steps 100-400: the union of the GPU ops' intervals against the window's length gives
  the GPU's idle fraction, waits inside steps included.
- The host's time by phase: launching (with the graph replay, logits and sampler calls inside it), waiting in
  `collect`, and the rest (scheduling, output processing, detokenizing).

    python benchmarks/throughput_gaps.py [shape] [quantization]   # writes ./throughput_gaps.json
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
llm = LLM(model_dir_for_shape(shape), load_format="dummy", max_model_len=4096, quantization=quantization)
eng = llm.llm_engine
runner = eng.core.runner
assert eng.core.async_scheduling, "this measures the async scheduling path"

marks: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []  # kind, rows, start, end
host = {"launch": 0.0, "collect": 0.0}
launch, collect = runner.launch, runner.collect


def timed_launch(scheduler_output):
    replays = runner.num_graph_replays
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    start.record()
    step = launch(scheduler_output)
    end.record()
    host["launch"] += time.perf_counter() - t
    if scheduler_output.scheduled:
        kind = "graph" if runner.num_graph_replays > replays else "eager"
        marks.append((kind, len(scheduler_output.scheduled), start, end))
    return step


def timed_collect(step):
    t = time.perf_counter()
    out = collect(step)
    host["collect"] += time.perf_counter() - t
    return out


runner.launch, runner.collect = timed_launch, timed_collect


drained: dict[str, int] = {}  # calls that returned with the stream empty: they waited for the GPU


def host_timed(name, fn):  # the host's time inside one part of `launch`
    def wrapped(*args, **kwargs):
        stream = torch.cuda.current_stream()
        busy_before = not stream.query()
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        host[name] = host.get(name, 0.0) + time.perf_counter() - t
        if busy_before and stream.query():
            drained[name] = drained.get(name, 0) + 1
        return out

    return wrapped


runner.graph_runner.replay = host_timed("launch: graph replay", runner.graph_runner.replay)
runner.model.compute_logits = host_timed("launch: logits", runner.model.compute_logits)
runner.sampler = host_timed("launch: sampler", runner.sampler)
WINDOW = (100, 400)  # steps whose kernels are traced: the GPU's busy time is the union of their intervals

vocab = runner.vocab_size
requests = workload3_requests(vocab)
for r in requests:
    eng.add_request(
        r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0.6, ignore_eos=True)
    )
torch.cuda.synchronize()
mem_before = torch.cuda.memory_stats()
t_start = time.perf_counter()
trace = profile(activities=[ProfilerActivity.CUDA])
n = 0
while eng.has_unfinished_requests():
    if n == WINDOW[0]:
        trace.__enter__()
    eng.step()
    n += 1
    if n == WINDOW[1]:
        torch.cuda.synchronize()
        trace.__exit__(None, None, None)
torch.cuda.synchronize()
total = time.perf_counter() - t_start

spans = sorted(
    (e.start_ns(), e.end_ns())
    for e in trace.profiler.kineto_results.events()
    if e.device_type() == torch.autograd.DeviceType.CUDA
)
busy_ns, reach = 0, None
for lo, hi in spans:  # the union of the kernels' intervals
    if reach is None or lo > reach:
        busy_ns += hi - lo
        reach = hi
    elif hi > reach:
        busy_ns += hi - reach
        reach = hi
window_ns = spans[-1][1] - spans[0][0]

busy = {"graph": 0.0, "eager": 0.0}
idle = {"graph": 0.0, "eager": 0.0}  # the GPU's wait before a step of this kind
idle_by_rows: dict[str, list[float]] = {}
for i, (kind, rows, start, end) in enumerate(marks):
    busy[kind] += start.elapsed_time(end) / 1e3
    if i:
        gap = marks[i - 1][3].elapsed_time(start) / 1e3
        idle[kind] += gap
        size = ">=128" if rows >= 128 else "32-127" if rows >= 32 else "<32"
        bucket = "eager" if kind == "eager" else f"graph rows {size}"
        idle_by_rows.setdefault(bucket, []).append(gap)
report = {
    "shape": shape,
    "quantization": quantization,
    **throughput_summary(requests, total),
    "steps": len(marks),
    "gpu_step_span_s": busy,
    "gpu_idle_between_steps_s": idle,
    "idle_by_rows": {
        k: {"steps": len(v), "total_s": sum(v), "median_us": statistics.median(v) * 1e6}
        for k, v in sorted(idle_by_rows.items())
    },
    "traced_window": {
        "steps": list(WINDOW),
        "gpu_ops": len(spans),
        "first_to_last_op_s": window_ns / 1e9,
        "gpu_busy_s": busy_ns / 1e9,
        "gpu_idle_fraction": 1 - busy_ns / window_ns,
    },
    "calls_that_drained_the_stream": drained,
    "allocator": {
        k: torch.cuda.memory_stats().get(k, 0) - mem_before.get(k, 0)
        for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    },
    "host_s": {**host, "other": total - host["launch"] - host["collect"]},
}
print(json.dumps(report, indent=1), flush=True)
with open("throughput_gaps.json", "w") as f:  # gpu_session.sh files it under $OUT
    json.dump(report, f, indent=1)
