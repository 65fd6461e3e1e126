"""Time to first token of long prompts with the extend kernel's deeper pipeline for long chunks
(`TritonAttentionBackend.long_prefill_queries`) and without, switched on the live backend in one process
(ABBA pairs), so that both settings share the startup, the GPU's state and cuBLAS's choices.

    python benchmarks/long_prefill_ab.py [shape] [--lengths 8192 32000] [--pairs 2] [--prompts 3]
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.getcwd())
from qwick import LLM  # noqa: E402
from qwick.bench.engine_bench import first_token_seconds  # noqa: E402
from qwick.bench.shapes import model_dir_for_shape  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("shape", nargs="?", default="qwen2.5-7b")
ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32000])
ap.add_argument("--pairs", type=int, default=2)
ap.add_argument("--prompts", type=int, default=3, help="prompts per run; the run's figure is their median")
args = ap.parse_args()

llm = LLM(
    model_dir_for_shape(args.shape),
    load_format="dummy",
    max_model_len=max(32768, max(args.lengths) + 16),
    enable_prefix_caching=False,
)
eng = llm.llm_engine
backend = eng.core.runner.backend
deep = backend.long_prefill_queries
g = torch.Generator().manual_seed(0)


def run_ms(length: int) -> float:
    return 1e3 * statistics.median(
        first_token_seconds(eng, torch.randint(100, 150000, (length,), generator=g).tolist())
        for _ in range(args.prompts)
    )


for length in args.lengths:
    run_ms(length)  # warm-up at this length
    results: dict[str, list[float]] = {"deeper": [], "two stages": []}
    for pair in range(args.pairs):
        order = ("deeper", "two stages") if pair % 2 == 0 else ("two stages", "deeper")
        for name in order + order[::-1]:
            backend.long_prefill_queries = deep if name == "deeper" else 1 << 30
            results[name].append(run_ms(length))
    backend.long_prefill_queries = deep
    line = ", ".join(
        f"{k} {statistics.median(v):.1f} ms {[round(x, 1) for x in v]}" for k, v in results.items()
    )
    print(f"{length}-token TTFT, medians of {len(results['deeper'])} runs: {line}", flush=True)
