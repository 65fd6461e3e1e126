"""Which Triton kernels compile after startup, and on which request: a compile in the serving path costs a
user 0.3-1 s of time to first token. Runs a series of requests of varied lengths and batch sizes against a
real shape (dummy weights) and prints, per request, the kernels Triton compiled while serving it.

    python benchmarks/compile_events.py [shape] [--quantization fp8]
"""

import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.getcwd())
from qwick import LLM, SamplingParams  # noqa: E402
from qwick.bench.shapes import model_dir_for_shape  # noqa: E402

events: list[tuple[float, str]] = []


def on_compile(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
    events.append((time.perf_counter(), repr))


triton.knobs.runtime.jit_post_compile_hook = on_compile

ap = argparse.ArgumentParser()
ap.add_argument("shape", nargs="?", default="qwen2.5-7b")
ap.add_argument("--quantization", default=None)
ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "compile_events.json"))
args = ap.parse_args()
t0 = time.perf_counter()
llm = LLM(
    model_dir_for_shape(args.shape), load_format="dummy", max_model_len=8192, quantization=args.quantization
)
startup = time.perf_counter() - t0
print(f"startup {startup:.1f} s, {len(events)} kernels compiled", flush=True)
g = torch.Generator().manual_seed(0)
report = {
    "shape": args.shape,
    "quantization": args.quantization,
    "startup_s": startup,
    "startup_compiles": len(events),
    "requests": [],
}
for batch, prompt_len, out_len in [
    (1, 128, 16),
    (1, 128, 16),
    (1, 131, 16),
    (1, 2048, 8),
    (1, 37, 40),
    (4, 200, 24),
    (13, 77, 33),
    (64, 128, 16),
    (1, 5000, 4),
    (1, 128, 16),
]:
    before = len(events)
    prompts = [
        {"prompt_token_ids": torch.randint(100, 150000, (prompt_len,), generator=g).tolist()}
        for _ in range(batch)
    ]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True), use_tqdm=False)
    dt = time.perf_counter() - t
    new = [r.split("(")[0] for _, r in events[before:]]
    report["requests"].append(
        {
            "batch": batch,
            "prompt_len": prompt_len,
            "out_len": out_len,
            "s": dt,
            "compiled": [r for _, r in events[before:]],
        }
    )
    print(
        f"batch {batch:3d} x {prompt_len:5d} prompt, {out_len:3d} out: {dt * 1e3:8.1f} ms, "
        f"{len(new)} compiled {new}",
        flush=True,
    )
# Workload 3's mix (256 prompts of 100-1024 tokens, chunked prefill beside decode rows), shorter outputs.
from qwick.bench.workloads import ranged_requests  # noqa: E402

before = len(events)
reqs = ranged_requests(256, (100, 1024), (16, 64), llm.llm_engine.vocab_size, seed=5)
t = time.perf_counter()
llm.generate(
    [{"prompt_token_ids": r.prompt_token_ids} for r in reqs],
    [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in reqs],
    use_tqdm=False,
)
dt = time.perf_counter() - t
report["requests"].append({"batch": 256, "workload": 3, "s": dt, "compiled": [r for _, r in events[before:]]})
print(f"workload 3 (outputs 16-64): {dt * 1e3:8.1f} ms, {len(events) - before} compiled", flush=True)
for _, r in events[before:]:
    print("   ", r[:400], flush=True)
with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
