"""int4 time to first token of short prompts with the 65-128-row tiled W4A16 path and without, alternating
prompt by prompt in one process (TTFT medians of separate processes differed by up to 2x in the
seventeenth session, more than the change being measured). Per setting: the TTFT median and minimum, and
the host's time from the step's start until every layer is launched (`forward` returned): when that is
close to the TTFT, the prefill waits on the host, not the GPU.

    python benchmarks/int4_ttft_ab.py [shape] [prompt_len] [pairs]   # qwen2.5-7b 128 15
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from qwick import LLM, SamplingParams  # noqa: E402
from qwick.bench.shapes import model_dir_for_shape  # noqa: E402
from qwick.quantization.int4 import PackedLinearMethod  # noqa: E402

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-7b"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 128
pairs = int(sys.argv[3]) if len(sys.argv) > 3 else 15
SETTINGS = {"tiled up to 128 rows (default)": PackedLinearMethod.tiled_max_m, "tiled up to 64 rows": 64}

llm = LLM(
    model_dir_for_shape(shape),
    load_format="dummy",
    quantization="int4",
    max_model_len=4096,
    enable_prefix_caching=False,
)
eng = llm.llm_engine
model = eng.core.runner.model
forward = model.forward
stamps: dict[str, float] = {}


def stamped_forward(*args, **kwargs):
    out = forward(*args, **kwargs)
    stamps.setdefault("launched", time.perf_counter())  # the prompt's first forward
    return out


model.forward = stamped_forward
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
g = torch.Generator().manual_seed(0)
ttft: dict[str, list[float]] = {name: [] for name in SETTINGS}
launched: dict[str, list[float]] = {name: [] for name in SETTINGS}
for i in range(pairs + 2):  # the first two pairs warm up
    for name, max_m in SETTINGS.items():
        PackedLinearMethod.tiled_max_m = max_m
        eng.add_request(
            torch.randint(100, 150000, (n,), generator=g).tolist(),
            SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        )
        sync()
        start = time.perf_counter()
        stamps.clear()
        while eng.has_unfinished_requests():
            eng.step()
        sync()
        if i >= 2:
            ttft[name].append(time.perf_counter() - start)
            launched[name].append(stamps["launched"] - start)
for name in SETTINGS:
    print(
        f"{name:32s} TTFT median {statistics.median(ttft[name]) * 1e3:7.2f} ms, min "
        f"{min(ttft[name]) * 1e3:7.2f}; every layer launched after "
        f"{statistics.median(launched[name]) * 1e3:7.2f} ms ({pairs} prompts of {n} tokens, {shape})",
        flush=True,
    )
