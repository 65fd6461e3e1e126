"""Decode attention for one row at short contexts, the case of the one-split decode graphs
(`SHORT_CONTEXT_GRAPHS`): launch shapes and split counts, us per layer (KV write + attention, CUDA-graph
replays over L2-overflowing copies, qwen2.5-7b heads). Writes the fastest one-split launch shape to
the JSON path given (default short_decode_best.json), for `benchmarks/b1_with_decode_cfg.py`.

    python benchmarks/short_decode_sweep.py [OUT.json]
"""

import json
import os
import sys

sys.path.insert(0, os.getcwd())  # run from the repository root
import torch

from qwick.bench.attention_bench import bench_case

CONTEXTS = (160, 256)
SHAPES = [(bn, w, st) for bn in (32, 64, 128) for w in (2, 4, 8) for st in (1, 2, 3)]


def _time(attrs: dict) -> list[float]:
    cells = []
    for context in CONTEXTS:
        try:
            r = bench_case(1, context, torch.bfloat16, False, lambda t, a=attrs: t.__dict__.update(a))
            cells.append(r.get("triton_graph_us", float("inf")))
        except Exception:  # a launch shape the kernel cannot take (registers, shared memory)
            cells.append(float("inf"))
    return cells


print(f"{'one row':>24} " + " ".join(f"{f'{c} keys':>10}" for c in CONTEXTS), flush=True)
results = []
for bn, w, st in SHAPES:
    cfg = dict(BLOCK_N=bn, num_warps=w, num_stages=st)
    cells = _time({"decode_config": cfg, "fixed_num_splits": 1})
    results.append((sum(cells), cfg))
    print(f"{f'bn{bn} w{w} s{st}, 1 split':>24} " + " ".join(f"{x:10.2f}" for x in cells), flush=True)
for splits in (2, 4):
    cells = _time({"fixed_num_splits": splits})
    print(f"{f'default, {splits} splits':>24} " + " ".join(f"{x:10.2f}" for x in cells), flush=True)
total, best = min(results, key=lambda r: r[0])
default = next(t for t, c in results if (c["BLOCK_N"], c["num_warps"], c["num_stages"]) == (128, 8, 3))
n = len(CONTEXTS)
print(f"best one-split shape {best}: {total / n:.2f} us on average, the default {default / n:.2f}")
with open(sys.argv[1] if len(sys.argv) > 1 else "short_decode_best.json", "w") as f:
    json.dump(best, f)
