"""Time to first token with the last layer run only for the sampling token (`ModelRunner.sampled_rows_only`)
and without, alternating ABBA in one process on fresh prompts (the demo model on the CPU by default).

    python benchmarks/output_rows_ttft.py [model] [prompt_len] [runs]
"""

import os
import statistics
import sys

import torch

sys.path.insert(0, os.getcwd())
from qwick import LLM  # noqa: E402
from qwick.bench.engine_bench import first_token_seconds  # noqa: E402
from qwick.loader.demo import demo_model_path  # noqa: E402

model = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "demo" else demo_model_path()
n = int(sys.argv[2]) if len(sys.argv) > 2 else 512
runs = int(sys.argv[3]) if len(sys.argv) > 3 else 16
llm = LLM(model, enable_prefix_caching=False)
engine = llm.llm_engine
g = torch.Generator().manual_seed(0)
ms: dict[bool, list[float]] = {True: [], False: []}
for i in range(runs):
    setting = i % 4 in (0, 3)  # ABBA
    engine.core.runner.sampled_rows_only = setting
    prompt = torch.randint(100, 150000, (n,), generator=g).tolist()
    ms[setting].append(1e3 * first_token_seconds(engine, prompt))
for setting, values in ms.items():
    name = "sampling token only" if setting else "every token"
    rounded = [round(v) for v in values]
    print(f"{name}: TTFT median {statistics.median(values[1:]):.1f} ms (first run left out) of {rounded}")
