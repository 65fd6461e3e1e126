"""Startup to ready (dummy weights, graphs captured) at a shape, and what the engine reports.

    python benchmarks/startup_time.py SHAPE [MAX_MODEL_LEN] [--compare-transformers]

With `--compare-transformers`, transformers' time to the same model on the GPU first (a fresh process:
imports, config, random weights in bf16 built on the device; it has no KV cache or graphs to prepare),
before qwick's in this process, so the two never share the GPU's memory.
"""

import os
import subprocess
import sys
import time

_TRANSFORMERS = """
import time
t = time.perf_counter()
import torch
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained({model_dir!r})
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
torch.cuda.synchronize()
print("SECONDS", time.perf_counter() - t)
"""


def transformers_seconds(model_dir: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _TRANSFORMERS.format(model_dir=model_dir)], capture_output=True, text=True
    )
    for line in out.stdout.splitlines():
        if line.startswith("SECONDS"):
            return float(line.split()[1])
    raise RuntimeError(f"transformers' startup failed:\n{out.stderr[-2000:]}")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if not args:
        raise SystemExit(__doc__.split("\n\n")[1].strip())
    shape = args[0]
    max_len = int(args[1]) if len(args) > 1 else 32768
    sys.path.insert(0, os.getcwd())
    if "--compare-transformers" in sys.argv:
        # The shape's directory comes from a subprocess too, so that this process imports nothing yet.
        model_dir = subprocess.run(
            [
                sys.executable,
                "-c",
                f"from qwick.bench.shapes import model_dir_for_shape; print(model_dir_for_shape({shape!r}))",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        print(f"{shape}: transformers to ready {transformers_seconds(model_dir):.1f} s (incl. imports)")

    t0 = time.perf_counter()
    from qwick import LLM  # imports are part of what is timed
    from qwick.bench.shapes import model_dir_for_shape

    llm = LLM(model_dir_for_shape(shape), load_format="dummy", max_model_len=max_len)
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


if __name__ == "__main__":
    main()
