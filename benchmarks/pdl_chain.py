"""Does programmatic dependent launch (PDL) shorten a batch-1 decode step? A CUDA graph of 28 layers of
qwen2.5-7b-shaped work: per layer a row norm, the QKV GEMV, a norm, the O GEMV, a norm, the gate/up GEMV,
a norm over half of its output (standing in for SiLU-and-mul), the down GEMV. Timed as graph replays,
with and without PDL: with it, every kernel is launched before the one it follows has finished; the
norms let the next kernel launch at once, and the GEMVs warm L2 with their first weight tiles, then wait
for the previous kernel's outputs (`gdc_wait`) before they read activations or write anything.

Prints the replay time per step and the weight bytes over it (TB/s) for bf16 and fp8 (W8A16) weights.
"""

import os
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, os.getcwd())
from qwick.kernels.gemv import GemvWorkspace, gemv  # noqa: E402

LAYERS = 28
HIDDEN, QKV, INTER = 3584, 4608, 18944


@triton.jit
def _norm_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, N, BLOCK):
        v = tl.load(x_ptr + k + cols, mask=k + cols < N, other=0.0).to(tl.float32)
        acc += v * v
    rstd = 1.0 / tl.sqrt(tl.sum(acc) / N + 1e-6)
    for k in range(0, N, BLOCK):
        v = tl.load(x_ptr + k + cols, mask=k + cols < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + k + cols, (v * rstd).to(y_ptr.dtype.element_ty), mask=k + cols < N)


def norm(x: torch.Tensor, n: int, pdl: bool) -> torch.Tensor:
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _norm_kernel[(1,)](x, y, n, BLOCK=2048, PDL=pdl, num_warps=16, launch_pdl=pdl)
    return y


def step(h, layers, ws, pdl):
    for wqkv, wo, wgu, wd in layers:
        a = norm(h, HIDDEN, pdl)
        qkv = gemv(a, wqkv[0], None, ws, weight_scale=wqkv[1], pdl=pdl)
        b = norm(qkv, HIDDEN, pdl)
        o = gemv(b, wo[0], None, ws, weight_scale=wo[1], pdl=pdl)
        c = norm(o, HIDDEN, pdl)
        gu = gemv(c, wgu[0], None, ws, weight_scale=wgu[1], pdl=pdl)
        d = norm(gu, INTER, pdl)
        h = gemv(d, wd[0], None, ws, weight_scale=wd[1], pdl=pdl)
    return h


def weights(dtype):
    def one(n, k):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        if dtype == torch.bfloat16:
            return w, None
        return w.to(dtype), torch.ones(n, device="cuda", dtype=torch.float32)

    return [
        (one(QKV, HIDDEN), one(HIDDEN, HIDDEN), one(2 * INTER, HIDDEN), one(HIDDEN, INTER))
        for _ in range(LAYERS)
    ]


def replay_ms(graph, iters=50) -> float:
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ws = GemvWorkspace(torch.device("cuda"))
    h = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        layers = weights(dtype)
        nbytes = sum(w.numel() * w.element_size() for layer in layers for w, _ in layer)
        results = {}
        for pdl in (False, True):
            ref = step(h, layers, ws, pdl)  # compiles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step(h, layers, ws, pdl)
            graph.replay()
            torch.cuda.synchronize()
            same = torch.equal(out, ref)
            results[pdl] = replay_ms(graph)
            print(
                f"{str(dtype).split('.')[-1]:14s} pdl={pdl!s:5s} {results[pdl] * 1e3:8.1f} us per step "
                f"({nbytes / results[pdl] / 1e9:.2f} TB/s of weights) graph output == eager: {same}",
                flush=True,
            )
            del graph
        print(f"   PDL saves {(results[False] - results[True]) * 1e3:.1f} us per step", flush=True)


if __name__ == "__main__":
    main()
