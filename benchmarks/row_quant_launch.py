"""Launch shapes of the three kernels that write per-token fp8 codes beside a W8A8 model's projections, at
the row counts of mid-size decode batches and prompt chunks (qwen2.5-7b sizes): RMSNorm + residual with
codes (its warps), SiLU-and-mul with codes (block, warps, and whether the row stays in registers for its
codes, "r", or is read back, "m") and the stand-alone row quantization before the output projection (block,
warps). In a workload-3 fp8 decode step at 256 rows they took 0.32, 0.36 and
0.14 ms of ~8 ms, against 0.16 and 0.19 ms for the plain RMSNorm and SiLU-and-mul of a bf16 step. Each
variant runs 200 times in one CUDA graph, timed by its replays (`qwick.bench.gpu_timing`); the current
default is starred (the launch shapes of the twenty-first session of 12-02 came from this sweep).

    python benchmarks/row_quant_launch.py [--rows 64 256 ...] [--json best.json]

`--apply best.json -- ARGS` runs the qwick command line with ARGS and the fastest shapes at 256 rows
patched in for every row count above 16 (the decode sizes keep theirs): an end-to-end A/B of the sweep's
pick before it becomes a default.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import qwick.kernels.elementwise as E  # noqa: E402
import qwick.kernels.w8a8 as W  # noqa: E402
from qwick.layers.linear import RowQuant  # noqa: E402
from qwick.quantization.w8a8 import _MIN_AMAX, qmax  # noqa: E402

HIDDEN, INTER = 3584, 18944
NORM_WARPS = (2, 4, 8, 16, 32)
SILU_SHAPES = tuple(
    (block, warps, regs)
    for regs in (True, False)
    for block, warps in ((4096, 16), (4096, 32), (2048, 16), (8192, 16), (8192, 32), (4096, 8))
    if not regs or -(-INTER // block) <= E.MAX_REGISTER_TILES  # 2048-wide steps are 10: read back only
)
QUANT_SHAPES = ((1024, 4), (1024, 8), (2048, 8), (4096, 4), (4096, 8), (4096, 16))
PICK_ROWS = "256"


def report(label: str, times: dict, default) -> object:
    """Print the timings (the default launch starred) and return the fastest key."""

    def shape(key) -> str:
        if not isinstance(key, tuple):
            return str(key)
        return "x".join(str(k) if not isinstance(k, bool) else "rm"[not k] for k in key)

    cells = [f"{shape(key)}: {t:.2f}{'*' if key == default else ''}" for key, t in times.items()]
    print(f"{label} " + ", ".join(cells), flush=True)
    return min(times, key=times.get)


def sweep(rows: int) -> dict:
    from qwick.bench.gpu_timing import graph_us

    def us(fn) -> float:
        return graph_us(fn, calls=200, replays=10)

    quant = RowQuant(torch.float8_e4m3fn, qmax(torch.float8_e4m3fn), _MIN_AMAX)
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    res, w = torch.randn_like(x), torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(rows, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    plain = us(lambda: E.rms_norm(x, w, 1e-6, res))
    times = {nw: us(lambda nw=nw: E.rms_norm(x, w, 1e-6, res, quant, num_warps=nw)) for nw in NORM_WARPS}
    found = {"norm": report(f"{rows:5d} rows  rms_norm (plain {plain:.2f}), with codes by warps", times,
                            E._norm_warps(4096, rows, True))}  # fmt: skip
    plain = us(lambda: E.silu_and_mul(h))
    times = {sh: us(lambda sh=sh: E.silu_and_mul_quant(h, quant, *sh)) for sh in SILU_SHAPES}
    silu_default = (4096, E.silu_quant_warps(rows), E.silu_codes_in_registers(INTER, rows))
    found["silu"] = report(f"{rows:5d} rows  silu (plain {plain:.2f}), with codes", times, silu_default)
    quantize = lambda sh: W.quantize_rows(x, quant.dtype, quant.qmax, quant.min_amax, None, *sh)  # noqa: E731
    times = {sh: us(lambda sh=sh: quantize(sh)) for sh in QUANT_SHAPES}
    found["quant"] = report(f"{rows:5d} rows  quantize_rows", times, (1024, 8))
    return found


def apply(path: str) -> None:
    """Patch the fastest shapes at `PICK_ROWS` rows into the kernels' defaults above 16 rows."""
    with open(path) as f:
        best = json.load(f)[PICK_ROWS]
    norm_warps, (q_block, q_warps) = best["norm"], best["quant"]
    silu_block, silu_warps, silu_regs = best["silu"]
    old_norm = E._norm_warps
    E._norm_warps = lambda b, rows, codes: norm_warps if codes and rows > 16 else old_norm(b, rows, codes)
    old_silu = E.silu_and_mul_quant

    def silu(x, quant, block=4096, num_warps=None, in_registers=None):
        if quant.group is None and x.shape[0] > 16:
            block, num_warps, in_registers = silu_block, silu_warps, silu_regs
        return old_silu(x, quant, block, num_warps, in_registers)

    E.silu_and_mul_quant = silu
    old_quant = W.quantize_rows

    def quantize(x, qdtype, qmax_, min_amax, group=None, block=None, num_warps=None):
        if group is None and x.shape[0] > 16:
            block, num_warps = q_block, q_warps
        return old_quant(x, qdtype, qmax_, min_amax, group, block, num_warps)

    W.quantize_rows = quantize
    print(f"patched above 16 rows: rms_norm {norm_warps} warps, silu {silu_block}x{silu_warps}x{silu_regs}, "
          f"quantize_rows {q_block}x{q_warps}", flush=True)  # fmt: skip


def main() -> None:
    if "--apply" in sys.argv:
        i = sys.argv.index("--apply")
        apply(sys.argv[i + 1])
        from qwick.entrypoints.cli import main as cli

        sys.exit(cli(sys.argv[sys.argv.index("--") + 1 :]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[17, 64, 128, 256, 512, 2048, 8192])
    ap.add_argument("--json")
    args = ap.parse_args()
    best = {str(rows): sweep(rows) for rows in args.rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(best, f)
    print(json.dumps(best))


if __name__ == "__main__":
    main()
