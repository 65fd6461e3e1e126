"""Decode attention at short contexts: the split count a CUDA graph pins (chosen at max_model_len) against
one split (no reduction launch), per batch and context, one layer at qwen2.5-7b shapes, graph replays.

    python benchmarks/decode_short_splits.py [out.json]
"""

import json
import sys

import torch

from qwick.bench.attention_bench import KV_HEADS, bench_case

BATCHES = [1, 2, 4, 8, 16, 32, 64]
CONTEXTS = [128, 256, 512, 1024, 2048, 4096]
MAX_MODEL_LENS = [4096, 32768]

rows = []
for batch in BATCHES:
    for context in CONTEXTS:
        cells = {}
        for name, pick in [
            *[(f"graph@{m}", lambda t, m=m, b=batch: t.num_splits(b, KV_HEADS, m)) for m in MAX_MODEL_LENS],
            ("one split", lambda t: 1),
        ]:

            def configure(t, pick=pick):
                t.fixed_num_splits = None
                t.fixed_num_splits = pick(t)

            r = bench_case(batch, context, torch.bfloat16, False, configure=configure)
            cells[name] = (r["splits"], r.get("triton_graph_us", float("nan")))
        rows.append({"batch": batch, "context": context, **{k: list(v) for k, v in cells.items()}})
        print(
            f"batch {batch:3d} ctx {context:5d}: "
            + "  ".join(f"{k} ({s} splits) {us:6.1f} us" for k, (s, us) in cells.items()),
            flush=True,
        )
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)
