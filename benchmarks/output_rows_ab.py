"""Workload 3 with the last layer run only for the sampling tokens (`ModelRunner.sampled_rows_only`) and
without, alternating in one process, so that the two settings share the startup, the GPU's state and the
order effects: fresh prompts per run, the setting switched between runs, ABBA order.

Besides the throughput, it times the host inside each eager step's `launch` (the steps that prefill: the
only ones the setting changes) and counts them, to see whether the setting costs the host what it saves
the GPU.

    python benchmarks/output_rows_ab.py [shape] [--quantization fp8] [--pairs 3] [--num-prompts N --max-len L]
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from qwick import LLM  # noqa: E402
from qwick.bench.engine_bench import throughput  # noqa: E402
from qwick.bench.shapes import model_dir_for_shape  # noqa: E402
from qwick.bench.workloads import ranged_requests  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("shape", nargs="?", default="qwen2.5-7b")
ap.add_argument("--quantization", default=None)
ap.add_argument("--pairs", type=int, default=3)
ap.add_argument("--num-prompts", type=int, default=256)
ap.add_argument("--max-len", type=int, default=1024, help="prompt and output lengths uniform in [100, this]")
ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "output_rows_ab.json"))
args = ap.parse_args()

llm = LLM(
    model_dir_for_shape(args.shape), load_format="dummy", max_model_len=4096, quantization=args.quantization
)
runner = llm.llm_engine.core.runner
launch = runner.launch
eager_launch_s: list[float] = []


def timed_launch(scheduler_output):
    """The host's time in `launch` for steps that prefill (graph replays are the same in both settings)."""
    prefill = any(item.num_tokens > 1 for item in scheduler_output.scheduled)
    t = time.perf_counter()
    out = launch(scheduler_output)
    if prefill:
        eager_launch_s.append(time.perf_counter() - t)
    return out


runner.launch = timed_launch


def cuda_segments() -> int:
    """How many device segments the caching allocator has ever obtained from cudaMalloc."""
    return torch.cuda.memory_stats().get("segment.all.allocated", 0) if torch.cuda.is_available() else 0


vocab = llm.llm_engine.vocab_size
order = [True, False, False, True] * ((args.pairs + 1) // 2)
runs = []
for i, rows_only in enumerate(order[: 2 * args.pairs]):
    runner.sampled_rows_only = rows_only
    eager_launch_s.clear()
    segments = cuda_segments()
    lengths = (min(100, args.max_len), args.max_len)
    r = throughput(llm, ranged_requests(args.num_prompts, lengths, lengths, vocab, seed=100 + i))
    r.update(
        new_cuda_segments=cuda_segments() - segments,  # cudaMallocs during the run (each syncs the device)
        sampled_rows_only=rows_only,
        eager_steps=len(eager_launch_s),
        eager_launch_ms_median=1e3 * statistics.median(eager_launch_s),
        eager_launch_ms_total=1e3 * sum(eager_launch_s),
    )
    runs.append(r)
    print(
        f"run {i}: {'sampling rows only' if rows_only else 'every token     '} "
        f"{r['output_tokens_per_s']:9.1f} out tok/s, {r['eager_steps']} eager steps, host in their launch "
        f"{r['eager_launch_ms_median']:.2f} ms median, {r['eager_launch_ms_total']:.1f} ms total, "
        f"{r['new_cuda_segments']} new device segments",
        flush=True,
    )
for setting in (True, False):
    tps = [r["output_tokens_per_s"] for r in runs if r["sampled_rows_only"] is setting]
    name = "sampling rows only" if setting else "every token"
    print(f"{name}: median {statistics.median(tps):.1f} of {tps}")
with open(args.out, "w") as f:
    json.dump({"shape": args.shape, "quantization": args.quantization, "runs": runs}, f, indent=1)
