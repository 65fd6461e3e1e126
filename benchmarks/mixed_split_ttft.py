"""Time to first token of prompts that arrive while other requests decode, with mixed steps split into two
graph replays (`ModelRunner.split_mixed_max_tokens`) and without, alternating prompt by prompt in one
process. `BUSY` requests decode throughout (long outputs); each new prompt of `LEN` random tokens
generates one token. Also the decoders' step time in the steps that carried a new prompt.

    BUSY=8 LEN=128 SPLIT=1024 python benchmarks/mixed_split_ttft.py [shape] [pairs]   # SPLIT=0: no A/B
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
busy, n = int(os.environ.get("BUSY", "8")), int(os.environ.get("LEN", "128"))
split = int(os.environ.get("SPLIT", "1024"))
quant = os.environ.get("QUANT") or None
llm = LLM(model_dir_for_shape(shape), load_format="dummy", quantization=quant, max_model_len=4096)
eng = llm.llm_engine
runner = eng.core.runner
g = torch.Generator().manual_seed(0)


def prompt(length: int) -> list[int]:
    return torch.randint(100, 150000, (length,), generator=g).tolist()


for i in range(busy):  # decoders that outlast the measurement
    eng.add_request(prompt(64), SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True), f"busy{i}")
for _ in range(5):
    eng.step()
# SPLIT=0: no alternation, the runner as configured (e.g. prefill graphs of several rows, set by the caller)
limits = {"split": split, "eager": 0} if split else {"as configured": 0}
ttft: dict[str, list[float]] = {name: [] for name in limits}
for i in range(pairs + 2):  # the first two pairs warm up
    for name, limit in limits.items():
        runner.split_mixed_max_tokens = limit
        rid = eng.add_request(prompt(n), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        torch.cuda.synchronize()
        start = time.perf_counter()
        done = False
        while not done:
            done = any(o.request_id == rid and o.finished for o in eng.step())
        torch.cuda.synchronize()
        if i >= 2:
            ttft[name].append(time.perf_counter() - start)
        for _ in range(3):  # plain decode steps between arrivals
            eng.step()
line = ", ".join(
    f"{name} median {statistics.median(t) * 1e3:6.2f} ms (min {min(t) * 1e3:6.2f})"
    for name, t in ttft.items()
)
rows = runner.prefill_graphs.max_rows if runner.prefill_graphs is not None else 0
print(f"TTFT beside {busy} decoders, {n}-token prompts ({quant or 'bf16'}, {rows}-row prefill graphs):", line)
