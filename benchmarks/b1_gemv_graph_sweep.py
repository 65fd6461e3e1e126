"""Batch-1 GEMV launch shapes on 8-bit weights (fp8; int8 with WEIGHT=int8), timed as decode runs them:
captured in a CUDA graph, cycling over copies of the weight that together overflow the L2 (50 MB on the
H200), so every call streams from HBM. `do_bench` timings of these layers carry a few microseconds of
launch cost per call, which hides differences between launch shapes of the small layers (in the
twenty-fourth session's batch-1 profile the fp8 QKV and o GEMVs took 8.4 and 9.2 us in the graph, 2.0 and
1.4 TB/s).

Each layer runs the path the fp8 model takes at one row: QKV and gate/up on per-token activation codes
(W8A8, written by the RMSNorm), down on codes with a scale per 512 columns (SiLU-and-mul's), o and the LM
head on bf16 activations (W8A16). Prints us per call and TB/s of weight bytes per launch shape, the default
first; writes JSON to argv[1].

    python benchmarks/b1_gemv_graph_sweep.py out.json [layer ...]   # qkv o down head (default: all four)

CONFIGS="bn,bk,split,warps,stages;..." times those launch shapes after the default instead of a sample.
ROWS="16 32" and WARPS="4" narrow the sampled space's rows per tile and warps; SAMPLE=0 times all of it.
ROW_PAD=P stores the rows P codes further apart than K (each weight a slice of a wider one), to see
whether the row stride changes how DRAM serves the tiles: it does not (48th session, BENCHMARKS.md).
DOWN_ROW_SCALE=1 gives down's activation codes one scale per row instead of one per 512 columns: the
same time (48th session).
"""

import functools
import itertools
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.getcwd())
from qwick.bench.gpu_timing import graph_us  # noqa: E402
from qwick.kernels.gemv import GemvConfig, gemv, shared_workspace  # noqa: E402
from qwick.kernels.w8a8 import quantize_rows  # noqa: E402

FP8 = torch.float8_e4m3fn
# name: (N, K, activation form)
LAYERS = {
    "qkv": (4608, 3584, "codes"),
    "o": (3584, 3584, "bf16"),
    "down": (3584, 18944, "codes" if os.environ.get("DOWN_ROW_SCALE") == "1" else "group512"),
    "head": (151936, 3584, "bf16"),
    "gate_up": (37888, 3584, "codes"),
}
SAMPLE = int(os.environ.get("SAMPLE", "30"))
INT8 = os.environ.get("WEIGHT") == "int8"
WEIGHT = torch.int8 if INT8 else FP8
PAD = int(os.environ.get("ROW_PAD", "0"))  # codes between one row's end and the next row's start
L2_BYTES = 120 << 20  # the copies of a weight cycled through: over twice the L2


def candidates(n: int, k: int) -> list[GemvConfig]:
    if os.environ.get("CONFIGS"):
        return [GemvConfig(*map(int, c.split(","))) for c in os.environ["CONFIGS"].split(";")]
    splits = (1,) if n >= 16384 else ((2, 4, 8) if k < 12288 else (4, 8, 16))
    rows = tuple(int(v) for v in os.environ.get("ROWS", "16 32 64 128").split())
    warps = tuple(int(v) for v in os.environ.get("WARPS", "4 8").split())
    space = itertools.product(rows, (128, 256, 512), splits, (2, 3, 4, 5), warps)
    out = [GemvConfig(bn, bk, sk, w, st) for bn, bk, sk, st, w in space if k // sk >= 2 * bk]
    random.Random(n * k).shuffle(out)
    return out[:SAMPLE] if SAMPLE else out


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else "b1_gemv_graph_sweep.json"
    names = sys.argv[2:] or ["qkv", "o", "down", "head"]
    dev = torch.device("cuda")
    ws = shared_workspace(dev)
    results = []
    for name in names:
        n, k, form = LAYERS[name]
        copies = max(1, -(-L2_BYTES // (n * k)))
        if INT8:
            shape = (n, k + PAD)
            weights = [torch.randint(-127, 128, shape, device=dev, dtype=torch.int8) for _ in range(copies)]
        else:
            weights = [(torch.randn(n, k + PAD, device=dev) * 0.02).to(FP8) for _ in range(copies)]
        weights = [w[:, :k] for w in weights]  # rows PAD codes apart beyond K (env ROW_PAD)
        wscale = torch.rand(n, device=dev) * 1e-3 + 1e-3
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        if form == "bf16":
            kw = dict(weight_scale=wscale)
            xin = x
        else:
            qmax = 127.0 if INT8 else 448.0
            xq, xs = quantize_rows(x, WEIGHT, qmax, 1e-10, 512 if form == "group512" else None)
            kw = dict(weight_scale=wscale, x_scale=xs, out_dtype=torch.bfloat16)
            if form == "group512":
                kw["x_group"] = 512
            xin = xq
        default = ws.config_for(1, n, k, 1, form != "bf16")
        per_graph = max(copies, 8)
        rows = []
        for cfg in [default, *[c for c in candidates(n, k) if c != default]]:
            if not ws.fits(cfg.split_k, 16, n, -(-n // cfg.block_n)):
                continue
            if form == "group512" and 512 % cfg.block_k:
                continue
            cycle = itertools.cycle(weights)  # each captured call streams the next copy
            call = functools.partial(gemv, xin, config=cfg, bias=None, ws=ws, **kw)
            try:
                us = graph_us(lambda c=call, w=cycle: c(weight=next(w)), calls=per_graph, replays=20)
            except Exception as e:  # a launch shape this Triton cannot build (shared memory, registers)
                print(f"{name} {cfg}: {type(e).__name__}", flush=True)
                continue
            rows.append((us, cfg))
            results.append({"layer": name, "cfg": cfg.__dict__, "us": us, "default": cfg == default})
        base = rows[0][0]
        print(f"{name} {n}x{k} ({form}): default {rows[0][1]} {base:.2f} us, {n * k / base / 1e6:.2f} TB/s")
        for us, cfg in sorted(rows)[:6]:
            print(f"   {us:7.2f} us  {n * k / us / 1e6:5.2f} TB/s  {cfg}", flush=True)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
