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

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}


def half2_gemv(x, qw, ws, block_n=64, split=1, stages=1, warps=4):
    return w4_half2_gemv(
        x, qw, None, ws, RowGemvConfig(block_n, qw.group_size // 8, split, warps, 1, False, stages)
    )


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=100, rep=30, return_mode="median") * 1e3


def case(name: str, n: int, k: int, ws: GemvWorkspace) -> dict:
    """Today's row GEMV and the f16x2 kernel over its launch shapes, for one layer shape."""
    w = torch.randn(n, k, device=ws.partials.device, dtype=torch.bfloat16) / k**0.5
    x = torch.randn(1, k, device=w.device, dtype=torch.bfloat16)
    qw = rtn.quantize(w, group_size=128)
    ref = x.double() @ dequantize(qw).double().T

    def err(y: torch.Tensor) -> float:
        return ((y.double() - ref).norm() / ref.norm()).item()

    t_row = bench(lambda: w4_row_gemv(x, qw, None, ws))
    row = {"shape": name, "row_gemv_us": t_row, "row_gemv_err": err(w4_row_gemv(x, qw, None, ws))}
    row["pairs_us"] = bench(lambda: half2_pairs(x))
    found = []
    splits = (1, 2) if n >= 16384 else (4, 8, 16)
    for cfg in itertools.product((32, 64, 128), splits, (1, 3), (4, 8)):
        try:
            e = err(half2_gemv(x, qw, ws, *cfg))
        except Exception as ex:  # a shape the compiler rejects
            print(f"skip {name} {cfg}: {type(ex).__name__} {str(ex)[:100]}", flush=True)
            continue
        if not e < 5e-3:
            print(f"BAD {name} {cfg} err={e:.3g}", flush=True)
            continue
        found.append((bench(lambda c=cfg: half2_gemv(x, qw, ws, *c)), cfg, e))
    found.sort()
    row["half2"] = [{"us": t, "bn_split_stages_warps": c, "err": e} for t, c, e in found[:5]]
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
