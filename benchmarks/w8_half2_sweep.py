"""Batch-1 W8A8 GEMV: the packed-fp16 CUDA-core kernel (`qwick.kernels.w8_half2`) over launch shapes, beside
the tensor-core skinny GEMM the decode path uses now (`qwick.kernels.gemv` with activation codes), at the
qwen2.5-7b layer shapes, fp8 and int8, activations quantized as in decode (per token; the down
projection per group of 512 columns). Each candidate is checked against float64, then timed as decode
runs it: CUDA-graph replays over weight copies that together overflow the L2. Prints the two defaults and
the best three per shape, and per-layer sums; argv[1]: JSON out. With TRITON_INTERPRET=1 on the CPU: tiny
shapes, a smoke test without timings.
"""

import itertools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.getcwd())
from qwick.kernels.gemv import GemvWorkspace, gemv  # noqa: E402
from qwick.kernels.row_gemv import RowGemvConfig  # noqa: E402
from qwick.kernels.w8_half2 import default_w8_half2_config, w8_half2_gemv  # noqa: E402
from qwick.quantization.w8a8 import (  # noqa: E402
    FP8_DTYPE,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_per_channel,
)

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
L2_OVERFLOW = 200 << 20
CUDA = torch.cuda.is_available()
if not CUDA:
    SHAPES = {"tiny": (64, 1024)}
DTYPES = {"fp8": FP8_DTYPE, "int8": torch.int8}


def graph_us(calls, n: int) -> float:
    calls()  # compile outside the capture
    if not CUDA:
        return float("nan")
    return triton.testing.do_bench_cudagraph(calls, rep=40, return_mode="median") * 1e3 / n


def workspace(dev: torch.device) -> GemvWorkspace:
    if CUDA:
        return GemvWorkspace(dev, max_elems=1 << 24)
    ws = GemvWorkspace.__new__(GemvWorkspace)  # the interpreter's smoke test: no CUDA device query
    ws.partials, ws.num_sms = torch.empty(1 << 20), 4
    ws.counters = torch.zeros(1 << 12, dtype=torch.int32)
    ws.configs = {}
    return ws


def sweep_shape(mode: str, qdtype: torch.dtype, name: str, n: int, k: int, ws: GemvWorkspace) -> list[dict]:
    """Every candidate at one layer shape: checked against float64, then timed."""
    dev = ws.partials.device
    group = 512 if name == "down" else None
    wq, wscale = quantize_weight_per_channel(torch.randn(n, k, device=dev) / k**0.5, qdtype)
    wscale = wscale.view(-1).contiguous()
    x = torch.randn(1, k, device=dev) * 3
    xq, xs = quantize_per_token_group(x, qdtype, group) if group else quantize_per_token(x, qdtype)
    cols = torch.arange(k, device=dev) // (group or k)
    ref = (xq.double() * xs[:, cols].double()) @ (wq.double() * wscale[:, None].double()).T
    copies = [wq.clone() for _ in range(max(1, -(-L2_OVERFLOW // wq.numel())))] if CUDA else [wq]
    kw, gw = k // 4, (group or 0) // 4

    def tensor_core(w, cfg=None):
        return gemv(xq, w, None, ws, weight_scale=wscale, x_scale=xs, out_dtype=torch.bfloat16, x_group=group)

    def half2(w, cfg):
        return w8_half2_gemv(xq, xs, w, wscale, None, ws, torch.bfloat16, group, cfg)

    cands = [("tensor-core gemv, default", tensor_core, None)]
    cands.append(("f16x2, default", half2, default_w8_half2_config(n, kw, ws.num_sms, gw)))
    for bn, bw, split in itertools.product((32, 64, 128), (32, 64), (1, 2, 4, 8, 16)):
        fits = kw % bw == 0 and kw // bw >= split and (not gw or gw % bw == 0)
        if fits and (split == 1 or (n // bn) * split <= 8 * ws.num_sms):
            cands.append((f"f16x2 {bn}x{bw} split {split}", half2, RowGemvConfig(bn, bw, split)))
    rows = []
    for label, fn, cfg in cands:
        out = fn(wq, cfg).double()
        err = ((out - ref).norm() / ref.norm()).item()
        if err > 8e-3:
            print(f"{mode} {name} {label}: relative error {err:.3g}, skipped", flush=True)
            continue

        def calls(fn=fn, cfg=cfg) -> None:
            for c in copies:
                fn(c, cfg)

        t = graph_us(calls, len(copies))
        rows.append({"candidate": label, "us": t, "tb_s": wq.numel() / t / 1e6, "err": err})
    return rows


def main() -> None:
    ws = workspace(torch.device("cuda" if CUDA else "cpu"))
    report = {}
    for (mode, qdtype), (name, (n, k)) in itertools.product(DTYPES.items(), SHAPES.items()):
        rows = report[f"{mode}.{name}"] = sweep_shape(mode, qdtype, name, n, k, ws)
        best = sorted((r for r in rows if "default" not in r["candidate"]), key=lambda r: r["us"])[:3]
        for r in [r for r in rows if "default" in r["candidate"]] + best:
            line = f"{mode:4s} {name:8s} {r['candidate']:28s} {r['us']:7.1f} us {r['tb_s']:5.2f} TB/s"
            print(line, flush=True)
    for mode, label in itertools.product(DTYPES, ("tensor-core gemv, default", "f16x2, default")):
        total = sum(next(r["us"] for r in report[f"{mode}.{s}"] if r["candidate"] == label) for s in SHAPES)
        print(f"per layer, {mode}, {label}: {total:.1f} us")
    with open(sys.argv[1] if len(sys.argv) > 1 else "w8_half2_sweep.json", "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
