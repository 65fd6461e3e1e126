"""Time to first token of a lone prompt with the prefill CUDA graphs (`qwick.runner.prefill_graphs`) and
without, alternating prompt by prompt in one process (separate processes' TTFT medians differed by up to 2x
in the seventeenth session), per weight format and prompt length. Each prompt is new (random tokens, no
prefix-cache hit) and generates one token.

    QUANT="none int4 fp8" LENS="32 128 512" python benchmarks/prefill_graph_ttft.py [shape] [pairs]
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from qwick import LLM, SamplingParams  # noqa: E402
from qwick.bench.shapes import model_dir_for_shape  # noqa: E402

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-7b"
pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 10
lengths = [int(n) for n in os.environ.get("LENS", "32 128 512").split()]
g = torch.Generator().manual_seed(0)

for quant in os.environ.get("QUANT", "none int4 fp8").split():
    llm = LLM(
        model_dir_for_shape(shape),
        load_format="dummy",
        quantization=None if quant == "none" else quant,
        max_model_len=4096,
    )
    eng = llm.llm_engine
    runner = eng.core.runner
    graphs = runner.prefill_graphs
    if graphs is None:
        print(f"{quant}: no prefill graphs (enforce_eager, or capture failed)", flush=True)
    for n in lengths:
        ttft: dict[str, list[float]] = {"graphs": [], "eager": []}
        replays = runner.num_prefill_graph_replays
        for i in range(pairs + 2):  # the first two pairs warm up
            for name in ttft:
                runner.prefill_graphs = graphs if name == "graphs" else None
                eng.add_request(
                    torch.randint(100, 150000, (n,), generator=g).tolist(),
                    SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                )
                torch.cuda.synchronize()
                start = time.perf_counter()
                while eng.has_unfinished_requests():
                    eng.step()
                torch.cuda.synchronize()
                if i >= 2:
                    ttft[name].append(time.perf_counter() - start)
        runner.prefill_graphs = graphs
        replayed = (graphs.num_replays if graphs else 0) - replays
        line = ", ".join(
            f"{name} median {statistics.median(t) * 1e3:6.2f} ms (min {min(t) * 1e3:6.2f})"
            for name, t in ttft.items()
        )
        print(f"TTFT {quant:5s} {n:5d} tokens: {line}; {replayed} graph replays", flush=True)
    del llm, eng, runner, graphs
    torch.cuda.empty_cache()
