"""Skinny GEMM vs cuBLAS at decode shapes: sweeps launch configs per (shape, M); writes the best.

WEIGHT=bf16 (default) | fp8 | int8: the weight format (8-bit codes with per-channel scales: W8A16, compared
with cuBLAS on bf16 weights, the unquantized layer). MS=1,2,4,8,16 picks the batch sizes."""

import itertools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.getcwd())
import torch.nn.functional as F

from qwick.kernels.gemv import GemvConfig, GemvWorkspace, default_config, gemv

dev = torch.device("cuda")
ws = GemvWorkspace(dev)
SHAPES = {
    "7b.qkv": (4608, 3584),
    "7b.o": (3584, 3584),
    "7b.gate_up": (37888, 3584),
    "7b.down": (3584, 18944),
    "7b.lm_head": (152064, 3584),
    "14b.qkv": (7168, 5120),
    "14b.o": (5120, 5120),
    "14b.gate_up": (27648, 5120),
    "14b.down": (5120, 13824),
    "14b.lm_head": (152064, 5120),
}
MS = [int(v) for v in os.environ.get("MS", "1,2,4,8,16").split(",")]
WEIGHT = os.environ.get("WEIGHT", "bf16")
SHAPES = {name: shape for name, shape in SHAPES.items() if name.startswith(os.environ.get("ONLY", ""))}
QDTYPE = {"bf16": None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[WEIGHT]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")


BKS = (128, 256) if QDTYPE is None else (256, 512)
grid = [
    GemvConfig(bn, bk, sk, 4, ns)
    for bn, bk, sk, ns in itertools.product((16, 32, 64), BKS, (1, 2, 4, 8), (3, 4))
]
best = {}
for name, (n, k) in SHAPES.items():
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    scale = None
    if QDTYPE is not None:
        from qwick.quantization.w8a8 import quantize_weight_per_channel

        codes, scale = quantize_weight_per_channel(w, QDTYPE)
        w = (codes.float() * scale).to(torch.bfloat16)  # the dense equivalent, for cuBLAS and the reference
    wk = w if QDTYPE is None else codes
    gb = n * k * wk.element_size() / 1e9
    for m in MS:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x.float(), w.float())
        t_cublas = bench(lambda x=x, w=w: F.linear(x, w))
        cands = [default_config(m, n, k, ws.num_sms, wk.element_size())] + grid
        timings = []
        for cfg in cands:
            if cfg.split_k > 1 and (k // cfg.split_k) < cfg.block_k:
                continue
            try:
                out = gemv(x, wk, None, ws, cfg, weight_scale=scale)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    print("BAD", name, m, cfg, err, flush=True)
                    continue
                timings.append(
                    (bench(lambda x=x, c=cfg, w=wk, s=scale: gemv(x, w, None, ws, c, weight_scale=s)), cfg)
                )
            except Exception as e:
                print("skip", cfg, type(e).__name__, str(e)[:80], flush=True)
        t_def = timings[0][0] if timings and timings[0][1] == cands[0] else float("nan")
        timings.sort(key=lambda t: t[0])
        bt, bc = timings[0]
        best[f"{n}x{k}/{m}"] = dict(
            cublas_us=t_cublas * 1e3,
            best_us=bt * 1e3,
            cfg=bc.__dict__,
            top=[(round(t * 1e3, 2), c.__dict__) for t, c in timings[:6]],
        )
        print(
            f"{name:12s} M={m:2d} cuBLAS {t_cublas * 1e3:6.1f} us ({gb / t_cublas:4.2f} TB/s) "
            f"default {t_def * 1e3:6.1f} ({gb / t_def:4.2f}) -> best {bt * 1e3:6.1f} ({gb / bt:4.2f}) {bc}",
            flush=True,
        )
with open(os.path.join(os.environ.get("OUT", "."), f"gemv_best_{WEIGHT}.json"), "w") as f:
    json.dump(best, f, indent=1)
