"""Where a batch-1 decode step's time goes at a real shape: graph replay, logits, sampler, host.

Env: QUANT=fp8|int8|int4 (weights), DECODE_W8A8=0 (8-bit decode as W8A16), GATED_DECODE=0|1 (with
QUANT=fp8|int8: `W8A8LinearMethod.gated_decode` without or with QUANT's codes), BATCHES=8,16,64 (step times
at larger batches; empty skips them), INT8_BITS=0 (int8 codes in the one-row GEMV through Triton's
conversion, not their float bits: `row_gemv_w8._INT8_BITS`), HEAD_IN_GRAPH=1 (the LM head captured in the
decode graphs after the final norm, as `compute_logits` runs it, its quantizing launch first; the 54th
session's version, which lost, fused the codes into the norm: commit `c65af85`), GEMV_TABLE (a JSON of
launch shapes), OUT (a Chrome trace, then per launch shape its mean time and what it adds to the step:
`benchmarks/critical_path.py`)."""

import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
import json

from qwick import LLM, SamplingParams
from qwick.bench.shapes import model_dir_for_shape

tab = os.environ.get("GEMV_TABLE")
if tab and os.path.exists(tab):
    import qwick.kernels.gemv as G

    with open(tab) as f:
        table = json.load(f)
    orig = G.default_config

    def dc(m, n, k, sms, *rest):
        e = table.get(f"{n}x{k}/{m}")
        return G.GemvConfig(**e["cfg"]) if e else orig(m, n, k, sms, *rest)

    G.default_config = dc
    print("using tuned GEMV table", flush=True)
shape = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-7b"
t0 = time.perf_counter()
if os.environ.get("DECODE_W8A8") == "0":  # fp8 / int8 decode as W8A16 everywhere
    from qwick.quantization.w8a8 import W8A8LinearMethod

    W8A8LinearMethod.decode_w8a8 = False
gated = os.environ.get("GATED_DECODE")
if gated:
    from qwick.quantization.w8a8 import FP8_DTYPE, W8A8LinearMethod

    codes = {"fp8": FP8_DTYPE, "int8": torch.int8}[os.environ["QUANT"]]
    W8A8LinearMethod.gated_decode = frozenset({codes}) if gated == "1" else frozenset()
if os.environ.get("INT8_BITS") == "0":
    import triton.language as tl

    import qwick.kernels.row_gemv_w8 as R

    R._INT8_BITS = tl.constexpr(False)
if os.environ.get("HEAD_IN_GRAPH") == "1":
    from qwick.models.decoder import DecoderForCausalLM
    from qwick.runner.cuda_graphs import DecodeGraphRunner

    graph_forward, compute_logits = DecodeGraphRunner._forward, DecoderForCausalLM.compute_logits
    DecodeGraphRunner._forward = lambda self, bs, md: self.model.compute_logits(graph_forward(self, bs, md))
    DecoderForCausalLM.compute_logits = (  # the graph's output is logits already
        lambda self, h: h if h.shape[-1] == self.config.vocab_size else compute_logits(self, h)
    )
llm = LLM(
    model_dir_for_shape(shape),
    load_format="dummy",
    max_model_len=4096,
    quantization=os.environ.get("QUANT") or None,  # QUANT=fp8|int8|int4
)
print(f"{shape}: startup {time.perf_counter() - t0:.1f} s", flush=True)
eng = llm.llm_engine
runner = eng.core.runner
g = torch.Generator().manual_seed(0)


def run(n_out=128, bs=1):
    for _ in range(bs):
        eng.add_request(
            torch.randint(100, 150000, (128,), generator=g).tolist(),
            SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True),
        )
    ts = []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t)
    return ts


run(16)
ts = run(128)
med = statistics.median(ts[2:])
print(f"engine step median {med * 1e3:.3f} ms -> {1 / med:.1f} tok/s", flush=True)
# graph replay alone
gr = runner.graph_runner
graph = gr.graphs[1].graph
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for _ in range(5):
    graph.replay()
torch.cuda.synchronize()
s.record()
for _ in range(100):
    graph.replay()
e.record()
torch.cuda.synchronize()
print(f"graph replay (bs 1) {s.elapsed_time(e) / 100:.3f} ms", flush=True)
hidden = gr.graphs[1].hidden[:1]
torch.cuda.synchronize()
s.record()
for _ in range(100):
    logits = runner.model.compute_logits(hidden)
e.record()
torch.cuda.synchronize()
print(f"compute_logits {s.elapsed_time(e) / 100:.3f} ms", flush=True)
# profile host side of steps
eng.add_request(
    torch.randint(100, 150000, (128,), generator=g).tolist(),
    SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
)
eng.step()
eng.step()
pr = cProfile.Profile()
pr.enable()
for _ in range(100):
    eng.step()
pr.disable()
buf = io.StringIO()
pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
print(buf.getvalue()[:6000])
while eng.has_unfinished_requests():
    eng.step()
# kernel summary of decode steps
eng.add_request(
    torch.randint(100, 150000, (128,), generator=g).tolist(),
    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
)
eng.step()
eng.step()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        eng.step()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
out = os.environ.get("OUT")
if out:
    bits = os.environ.get("INT8_BITS")
    tag = (f"_gated{gated}" if gated else "") + (f"_bits{bits}" if bits else "")
    trace = os.path.join(out, f"trace_{shape}_{os.environ.get('QUANT') or 'bf16'}{tag}.json")
    prof.export_chrome_trace(trace)
    # per launch shape: the same kernel serves qkv, o, gate/up and down, told apart by their grids
    with open(trace) as f:
        kernels = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    groups: dict[tuple, list[float]] = {}
    for e in kernels:
        key = (e["name"][:60], str(e.get("args", {}).get("grid")))
        groups.setdefault(key, []).append(e["dur"])
    print("per launch shape, 20 steps: count, mean us, total us per step")
    for (name, grid), durs in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        print(f" {name:60s} {grid:16s} {len(durs):5d} {statistics.mean(durs):8.2f} {sum(durs) / 20:9.1f}")
    from critical_path import report  # beside this script

    print(report(trace, 20), flush=True)
while eng.has_unfinished_requests():
    eng.step()
for bs in [int(b) for b in os.environ.get("BATCHES", "8,16,64").split(",") if b]:
    ts = run(64, bs)
    med = statistics.median(ts[3:])
    print(f"bs {bs}: step {med * 1e3:.2f} ms -> {bs / med:.0f} tok/s", flush=True)
