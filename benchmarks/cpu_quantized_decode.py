"""The demo model's batch-1 decode on the CPU per weight mode: bf16, int4 (torch's CPU int4 GEMM at decode
sizes), int4 on the reference path (dequantize every call: what int4 ran before), gguf kept quantized.
Median engine step over two greedy 32-token generations, then the first 24 tokens of a greedy answer.
The LM head as the mode makes it by default (int8 for int8 and int4); a "+head" suffix puts it in the
body's format (`quantize_lm_head=True`: int4+head), "+nohead" keeps it in the model dtype.

    python benchmarks/cpu_quantized_decode.py bf16|int4|int4+head|int4+nohead|int4-reference|gguf|int8|...
"""

import statistics
import sys
import time

import qwick.quantization.formats.cpu_int4 as C
from qwick import LLM, SamplingParams
from qwick.loader.demo import demo_model_path

mode = sys.argv[1]
base, _, head = mode.partition("+")
if base == "int4-reference":
    C.supports = lambda *a: False
q = {"bf16": None, "gguf": "gguf", "int8": "int8", "fp8": "fp8"}.get(base, "int4")
llm = LLM(
    demo_model_path(),
    max_model_len=1024,
    quantization=q,
    quantize_lm_head={"head": True, "nohead": False}.get(head),
)
eng = llm.llm_engine
prompt = llm.get_tokenizer().encode(
    "Write a Python function that parses a CSV file and returns a list of dicts."
)
ts = []
for _ in range(2):
    eng.add_request(prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    steps = []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    ts += steps[2:]
    ttft = steps[0]
out = (
    llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0].outputs[0].text
)
step_ms, first_ms = statistics.median(ts) * 1e3, ttft * 1e3
print(f"{mode}: median decode step {step_ms:.1f} ms, first step {first_ms:.0f} ms | {out!r}", flush=True)
