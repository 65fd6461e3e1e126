"""Decode-sized matmuls on 8-bit weights: W8A16 (codes converted to bf16 for the dot, today's path) against
W8A8 (activation codes times weight codes on the tensor cores, no conversion) in `qwick.kernels.gemv`.

Nsight Compute on the H200 (benchmarks/gemv_ncu.py) showed the W8A16 kernel at gate/up issuing 5 instructions
per weight per thread, twice the bf16 kernel's, with 25% theoretical occupancy (49 KB of shared memory per
program: three stages of a 16-row bf16 activation tile beside the codes). W8A8 stages 8-bit activations and
needs no conversion. Prints a table per layer shape, weight type and M; writes JSON to argv[1].

WIDE=1 tries a wider launch space. (A persistent variant, PERSIST=1 at `f28a9be`, measured no faster on
the H200: 46.8 against 46.3 us at the fp8 gate/up; BENCHMARKS.md, fifth session of 12-01.)

Times are `triton.testing.do_bench` medians (L2 flushed); TB/s counts the weight codes. Errors are relative
Frobenius norms against float64 products of the same codes (W8A8 also against the unquantized x, to show
the activation rounding). `quantize` is the separate per-token quantization of x for the W8A8 rows.
"""

import itertools
import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.getcwd())
from qwick.kernels.gemv import GemvConfig, GemvWorkspace, gemv  # noqa: E402
from qwick.kernels.w8a8 import quantize_rows  # noqa: E402
from qwick.quantization.w8a8 import qmax, quantize_weight_per_channel  # noqa: E402

SHAPES = {"gate_up": (37888, 3584), "down": (3584, 18944), "qkv": (4608, 3584), "o": (3584, 3584)}
SHAPES = {k: v for k, v in SHAPES.items() if k.startswith(os.environ.get("ONLY", ""))}
MS = [int(m) for m in os.environ.get("MS", "1,16").split(",")]
OUT = sys.argv[1] if len(sys.argv) > 1 else "w8a8_gemv_sweep.json"
BUDGET_S = float(os.environ.get("BUDGET_S", "300"))
T0 = time.time()
dev = torch.device("cuda")
ws = GemvWorkspace(dev, max_elems=1 << 24)


def bench(fn) -> float:
    # 100 ms of warm-up: the GPU idles (and drops its clocks) while each candidate compiles
    return triton.testing.do_bench(fn, warmup=100, rep=30, return_mode="median") * 1e3


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def configs(n: int, k: int) -> list[GemvConfig]:
    """The launch shapes to try. WIDE=1 draws SAMPLE (default 40) from a wider space: tiles of 16-128 rows,
    split-K also for gate/up (more, shorter programs: fewer idle SMs in the last wave), 2-5 stages, 8 warps
    (the int8 W8A8 loop is 111 instructions against bf16's 77, yet streams 3.0 TB/s against 4.1)."""
    if os.environ.get("WIDE") == "1":
        splits = (1, 2, 4) if n >= 16384 else ((2, 4, 8) if k < 12288 else (4, 8, 16))
        space = itertools.product((16, 32, 64, 128), (128, 256, 512), splits, (2, 3, 4, 5), (4, 8))
        out = [GemvConfig(bn, bk, sk, w, st) for bn, bk, sk, st, w in space if k // sk >= 2 * bk]
        random.Random(n * k).shuffle(out)
        return out[: int(os.environ.get("SAMPLE", "40"))]
    splits = (1,) if n >= 16384 else ((2, 4, 8) if k < 12288 else (4, 8, 16))
    out = []
    for bn, bk, sk, st in itertools.product((32, 64), (128, 256, 512), splits, (3, 4)):
        if k % (bk * sk) == 0 or k // sk >= 2 * bk:
            out.append(GemvConfig(bn, bk, sk, 4, st))
    return out


def case(name: str, n: int, k: int, qdtype: torch.dtype, m: int) -> dict:
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    codes, scale = quantize_weight_per_channel(w, qdtype)
    scale = scale.reshape(-1).contiguous()
    xq, xs = quantize_rows(x, qdtype, qmax(qdtype), 1e-12, None)
    ref16 = (x.double() @ codes.double().T) * scale.double()
    ref8 = (xq.double() @ codes.double().T) * xs.double() * scale.double()
    row = {"shape": name, "n": n, "k": k, "dtype": str(qdtype).split(".")[-1], "m": m}
    row["cublas_bf16_us"] = bench(lambda: F.linear(x, w))
    row["w8a16_us"] = bench(lambda: gemv(x, codes, None, ws, weight_scale=scale))
    row["w8a16_err"] = rel(gemv(x, codes, None, ws, weight_scale=scale), ref16)
    row["quantize_us"] = bench(lambda: quantize_rows(x, qdtype, qmax(qdtype), 1e-12, None))
    row["w8a8_default_us"] = bench(
        lambda: gemv(xq, codes, None, ws, weight_scale=scale, x_scale=xs, out_dtype=torch.bfloat16)
    )
    best = []
    for cfg in configs(n, k):
        if time.time() - T0 > BUDGET_S:
            break
        try:
            y = gemv(xq, codes, None, ws, cfg, weight_scale=scale, x_scale=xs, out_dtype=torch.bfloat16)
        except Exception as e:  # a launch shape the compiler rejects
            print(f"skip {cfg}: {type(e).__name__} {str(e)[:80]}", flush=True)
            continue
        err = rel(y, ref8)
        if not err < 5e-3:
            print(f"BAD {name} {row['dtype']} m={m} {cfg} err={err:.3g}", flush=True)
            continue
        t = bench(
            lambda c=cfg: gemv(
                xq, codes, None, ws, c, weight_scale=scale, x_scale=xs, out_dtype=torch.bfloat16
            )
        )
        best.append((t, cfg, err, rel(y, ref16)))
    best.sort(key=lambda b: b[0])
    row["w8a8"] = [{"us": t, "cfg": vars(c), "err": e, "err_vs_bf16_x": e16} for t, c, e, e16 in best[:5]]
    row["tbps_w8a16"] = codes.numel() / row["w8a16_us"] / 1e6
    if best:
        row["tbps_w8a8"] = codes.numel() / best[0][0] / 1e6
    return row


def main() -> None:
    rows = []
    for (name, (n, k)), qdtype, m in itertools.product(SHAPES.items(), (torch.float8_e4m3fn, torch.int8), MS):
        rows.append(case(name, n, k, qdtype, m))
        r = rows[-1]
        top = r["w8a8"][0] if r["w8a8"] else {"us": float("nan"), "cfg": "-", "err": float("nan")}
        print(
            f"{name:8s} {r['dtype']:14s} m={m:2d} cublas {r['cublas_bf16_us']:6.1f} | w8a16 "
            f"{r['w8a16_us']:6.1f} ({r['tbps_w8a16']:.2f} TB/s) | w8a8 {top['us']:6.1f} "
            f"({r.get('tbps_w8a8', 0):.2f} TB/s; default {r['w8a8_default_us']:.1f}) err {top['err']:.1e} "
            f"{top['cfg']} | quant "
            f"{r['quantize_us']:.1f}",
            flush=True,
        )
    with open(OUT, "w") as f:
        json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
