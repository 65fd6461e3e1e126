"""Batch-1 int4 GEMV: `qwick.kernels.row_gemv` (fp32 arithmetic, today's path) against the packed-fp16
variant `qwick.kernels.row_gemv_half2` over its launch shapes, at the qwen2.5-7b layer shapes: us, TB/s of
int4 bytes, and relative error against a float64 dequantize-then-matmul. `pairs` is the activation
preparation launch the f16x2 kernel needs (included in its time). argv[1]: JSON out.
"""

import itertools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.getcwd())
from qwick.kernels.gemv import GemvWorkspace  # noqa: E402
from qwick.kernels.row_gemv import RowGemvConfig, w4_row_gemv  # noqa: E402
from qwick.kernels.row_gemv_half2 import half2_pairs, w4_half2_gemv  # noqa: E402
from qwick.quantization.formats import rtn  # noqa: E402
from qwick.quantization.formats.layout import dequantize  # noqa: E402

L2_OVERFLOW = 200 << 20  # bytes of weight copies per timing: four times the H200's L2
SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}


def half2_gemv(x, qw, ws, block_n=64, split=1, stages=1, warps=4, prefetch=False):
    return w4_half2_gemv(
        x, qw, None, ws, RowGemvConfig(block_n, qw.group_size // 8, split, warps, 1, prefetch, stages)
    )


def bench(gemv, qws: list) -> float:
    """us per call, replayed in a CUDA graph as decode runs them (`do_bench` would also time the host's
    launch gaps, which at these sizes exceed the kernels; an f16x2 call is two launches), over copies of
    the weight that together overflow the L2 cache, as a model's layers do."""

    def calls() -> None:
        for qw in qws:
            gemv(qw)

    calls()  # compile outside the capture
    return triton.testing.do_bench_cudagraph(calls, rep=30, return_mode="median") * 1e3 / len(qws)


def case(name: str, n: int, k: int, ws: GemvWorkspace) -> dict:
    """Today's row GEMV and the f16x2 kernel over its launch shapes, for one layer shape."""
    w = torch.randn(n, k, device=ws.partials.device, dtype=torch.bfloat16) / k**0.5
    x = torch.randn(1, k, device=w.device, dtype=torch.bfloat16)
    qw = rtn.quantize(w, group_size=128)
    ref = x.double() @ dequantize(qw).double().T
    qws = [qw] + [rtn.quantize(w, group_size=128) for _ in range(-(-L2_OVERFLOW // qw.nbytes) - 1)]

    def err(y: torch.Tensor) -> float:
        return ((y.double() - ref).norm() / ref.norm()).item()

    t_row = bench(lambda q: w4_row_gemv(x, q, None, ws), qws)
    row = {"shape": name, "row_gemv_us": t_row, "row_gemv_err": err(w4_row_gemv(x, qw, None, ws))}
    row["pairs_us"] = bench(lambda q: half2_pairs(x), [qw])
    found = []
    splits = (1, 2) if n >= 16384 else (8, 16) if k > 8192 else (4, 8)
    loops = ((1, False), (1, True), (3, False))  # (loop stages, register prefetch)
    for bn, sp, (st, pf), wp in itertools.product((64, 128), splits, loops, (4, 8)):
        cfg = (bn, sp, st, wp, pf)
        try:
            e = err(half2_gemv(x, qw, ws, *cfg))
        except Exception as ex:  # a shape the compiler rejects
            print(f"skip {name} {cfg}: {type(ex).__name__} {str(ex)[:100]}", flush=True)
            continue
        if not e < 5e-3:
            print(f"BAD {name} {cfg} err={e:.3g}", flush=True)
            continue
        found.append((bench(lambda q, c=cfg: half2_gemv(x, q, ws, *c), qws), cfg, e))
    found.sort()
    # timed again after the sweep: the first timing of a case can catch the clocks still low after compiling
    t_row = row["row_gemv_us"] = min(t_row, bench(lambda q: w4_row_gemv(x, q, None, ws), qws))
    row["half2"] = [{"us": t, "bn_split_stages_warps_prefetch": c, "err": e} for t, c, e in found[:5]]
    best = found[0] if found else (float("nan"), "-", float("nan"))
    tbs = qw.nbytes / 1e6
    print(
        f"{name:8s} row GEMV {t_row:6.1f} us ({tbs / t_row:.2f} TB/s, err {row['row_gemv_err']:.1e}) | "
        f"f16x2 {best[0]:6.1f} us ({tbs / best[0]:.2f} TB/s, err {best[2]:.1e}) {best[1]} | "
        f"pairs {row['pairs_us']:.1f} us",
        flush=True,
    )
    return row


def main() -> None:
    ws = GemvWorkspace(torch.device("cuda"), max_elems=1 << 24)
    rows = [case(name, n, k, ws) for name, (n, k) in SHAPES.items()]
    with open(sys.argv[1] if len(sys.argv) > 1 else "int4_half2_gemv.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
