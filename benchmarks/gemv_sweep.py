"""GEMV vs cuBLAS at decode shapes: sweeps launch configs of both kernels per (shape, M); writes the best."""

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


def bench(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")


dot_grid = [
    GemvConfig(bn, bk, sk, 4, ns)
    for bn, bk, sk, ns in itertools.product((16, 32, 64), (128, 256), (1, 2, 4, 8), (3, 4))
]
fma_grid = [
    GemvConfig(bn, bk, sk, nw, 1, True)
    for bn, bk, sk, nw in itertools.product((2, 4, 8, 16), (256, 512, 1024), (1, 2, 4, 8), (4, 8))
]
best = {}
for name, (n, k) in SHAPES.items():
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    gb = n * k * 2 / 1e9
    for m in MS:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x.float(), w.float())
        t_cublas = bench(lambda x=x, w=w: F.linear(x, w))
        cands = [default_config(m, n, k, ws.num_sms)] + dot_grid
        if m <= 4:
            cands += [
                c
                for c in fma_grid
                if triton.next_power_of_2(m) * c.block_n * c.block_k / (32 * c.num_warps) <= 64
            ]
        timings = []
        for cfg in cands:
            if cfg.split_k > 1 and (k // cfg.split_k) < cfg.block_k:
                continue
            try:
                out = gemv(x, w, None, ws, cfg)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    print("BAD", name, m, cfg, err, flush=True)
                    continue
                timings.append((bench(lambda x=x, w=w, cfg=cfg: gemv(x, w, None, ws, cfg)), cfg))
            except Exception as e:
                print("skip", cfg, type(e).__name__, str(e)[:80], flush=True)
        t_def = timings[0][0] if timings and timings[0][1] == cands[0] else float("nan")
        timings.sort(key=lambda t: t[0])
        bt, bc = timings[0]
        bf = min((t for t in timings if t[1].fma), default=(float("nan"), None), key=lambda t: t[0])
        bd = min((t for t in timings if not t[1].fma), key=lambda t: t[0])
        best[f"{n}x{k}/{m}"] = dict(
            cublas_us=t_cublas * 1e3,
            best_us=bt * 1e3,
            cfg=bc.__dict__,
            top=[(round(t * 1e3, 2), c.__dict__) for t, c in timings[:6]],
        )
        print(
            f"{name:12s} M={m:2d} cuBLAS {t_cublas * 1e3:6.1f} us ({gb / t_cublas:4.2f} TB/s) "
            f"default {t_def * 1e3:6.1f} "
            f"dot {bd[0] * 1e3:6.1f} fma {bf[0] * 1e3:6.1f} -> best {bt * 1e3:6.1f} ({gb / bt:4.2f}) {bc}",
            flush=True,
        )
with open(os.path.join(os.environ.get("OUT", "."), "gemv_best.json"), "w") as f:
    json.dump(best, f, indent=1)
