"""Where a 2048-token prompt's time to first token goes at a real shape: wall time per prefill (a length
seen before, and new lengths), a kernel table of one prefill and its trace ($OUT/ttft_trace.json);
CPROFILE=1 adds a cProfile of the host over 10 prefills.

    python benchmarks/ttft_profile.py [shape] [prompt_len]
"""

import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
from qwick import LLM, SamplingParams  # noqa: E402
from qwick.bench.engine_bench import first_token_seconds  # noqa: E402
from qwick.bench.shapes import model_dir_for_shape  # noqa: E402

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-7b"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
llm = LLM(
    model_dir_for_shape(shape),
    load_format="dummy",
    max_model_len=max(4096, 2 * n),
    enable_prefix_caching=False,
)
eng = llm.llm_engine
g = torch.Generator().manual_seed(0)


def first_token_s(length: int = n) -> float:
    """One prompt, one output token: the time of the engine steps until it is out."""
    return first_token_seconds(eng, torch.randint(100, 150000, (length,), generator=g).tolist())


for _ in range(3):
    first_token_s()
ts = [first_token_s() for _ in range(10)]
print(f"TTFT median {statistics.median(ts) * 1e3:.2f} ms, min {min(ts) * 1e3:.2f}", flush=True)
# A server rarely sees a prompt length twice: a kernel that compiles or plans per shape shows up here.
ts = [first_token_s(n - 1 - i) for i in range(min(n - 1, 10))]
print(f"TTFT at 10 new lengths, median {statistics.median(ts) * 1e3:.2f} ms", flush=True)
# The host's share without a profiler: how long a step takes to reach the model's forward, and to return
# from it (every layer launched); the GPU runs the forward in ~42 ms at 7b shapes.
model = eng.core.runner.model
forward = model.forward
stamps: dict[str, float] = {}


def stamped_forward(*args, **kwargs):
    stamps["enter"] = time.perf_counter()
    out = forward(*args, **kwargs)
    stamps["return"] = time.perf_counter()
    return out


model.forward = stamped_forward
pre, launched = [], []
for _ in range(10):
    eng.add_request(
        torch.randint(100, 150000, (n,), generator=g).tolist(),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
    )
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.step()
    pre.append(stamps["enter"] - t)
    launched.append(stamps["return"] - t)
    while eng.has_unfinished_requests():
        eng.step()
model.forward = forward
print(
    f"host: step start to forward {statistics.median(pre) * 1e3:.2f} ms, "
    f"to every layer launched {statistics.median(launched) * 1e3:.2f} ms (medians of 10)",
    flush=True,
)
# The same on the GPU's clock, from CUDA events: the stream is idle when a step starts, so its first event
# runs when the host records it; the next ones run when the GPU reaches them (after the host has queued
# them and the GPU has done what came before).
layers = model.model.layers
marks: list[tuple[str, torch.cuda.Event]] = []


def mark(name: str) -> None:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    marks.append((name, ev))


hooks = [layers[0].register_forward_pre_hook(lambda *_: mark("layer 0 starts"))]
hooks.append(layers[1].register_forward_pre_hook(lambda *_: mark("layer 1 starts")))
hooks.append(layers[-1].register_forward_hook(lambda *_: mark("last layer ends")))
logits = model.compute_logits
model.compute_logits = lambda *a: (mark("logits start"), logits(*a))[1]
timelines = []
for _ in range(10):
    eng.add_request(
        torch.randint(100, 150000, (n,), generator=g).tolist(),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
    )
    torch.cuda.synchronize()
    marks.clear()
    mark("step called")
    while eng.has_unfinished_requests():
        eng.step()
    mark("first token out (host)")
    torch.cuda.synchronize()
    timelines.append({name: marks[0][1].elapsed_time(ev) for name, ev in marks})
for h in hooks:
    h.remove()
model.compute_logits = logits
print("GPU timeline of a prefill, ms from the first step call (medians of 10):")
for name in timelines[0]:
    print(f"  {name:24s} {statistics.median(t[name] for t in timelines):8.3f}")
if os.environ.get("CPROFILE"):  # the host's share: cProfile of 10 prefills, by cumulative time
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(10):
        first_token_s()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(70)
    print(buf.getvalue(), flush=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    first_token_s()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
if os.environ.get("OUT"):
    prof.export_chrome_trace(os.path.join(os.environ["OUT"], "ttft_trace.json"))
