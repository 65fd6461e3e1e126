"""Startup to ready (dummy weights, graphs captured) at a shape, and what the engine reports."""

import os
import sys
import time

t0 = time.perf_counter()
sys.path.insert(0, os.getcwd())
from qwick import LLM  # noqa: E402  (imports are part of what is timed)
from qwick.bench.shapes import model_dir_for_shape  # noqa: E402

shape = sys.argv[1]
llm = LLM(
    model_dir_for_shape(shape),
    load_format="dummy",
    max_model_len=int(sys.argv[2]) if len(sys.argv) > 2 else 32768,
)
core = llm.llm_engine.core
r = core.runner
graphs = r.graph_runner
print(
    f"{shape}: startup to ready {time.perf_counter() - t0:.1f} s (incl. imports); "
    f"KV tokens {core.num_kv_tokens}; graphs {len(graphs.graphs) if graphs else 0}, "
    f"graph pool {(graphs.graph_bytes if graphs else 0) / 2**20:.0f} MiB, "
    f"reserve {r.graph_reserve_bytes / 2**20:.0f} MiB",
    flush=True,
)
