"""Batch-1 int4 GEMV: the packed-fp16 kernel (`qwick.kernels.row_gemv_half2`) over launch shapes, beside
the fp32 row GEMV (`qwick.kernels.row_gemv`) at its default, at the qwen2.5-7b layer shapes. Each candidate
is checked against float64, then timed as decode runs it: CUDA-graph replays over weight copies that
together overflow the L2, the f16x2 kernel reading the `HalfPairs` operand x's producer writes (env
PAIRS=0: pairing x in registers instead). Each launch shape runs with and without the two-tile register
prefetch (`RowGemvConfig.prefetch`); env TILE_WORDS (default "16 32") narrows the tiles; the default and
64-row tiles also run under each register cap of env MAX_REGISTERS (default "32 40 48 64"). Prints the
default and the best three per shape and the per-layer sums; argv[1]: JSON out. With TRITON_INTERPRET=1
on the CPU: tiny shapes, a smoke test without timings.

NCU=1: instead, one launch per shape of the default (32-row tiles) and of the 64-row tiles that were the
default before the 31st session, with the producer's pairs, on weights the L2 does not hold, for

    NCU=1 ncu --clock-control none --profile-from-start off --section LaunchStats --section Occupancy \
        --section SpeedOfLight --section SchedulerStats --section WarpStateStats \
        python benchmarks/int4_half2_sweep.py
"""

import itertools
import json
import os
import sys
from dataclasses import replace

import torch
import triton

sys.path.insert(0, os.getcwd())
from qwick.kernels.gemv import GemvWorkspace  # noqa: E402
from qwick.kernels.row_gemv import RowGemvConfig, w4_row_gemv  # noqa: E402
from qwick.kernels.row_gemv_half2 import default_half2_config, half_pairs, w4_half2_gemv  # noqa: E402
from qwick.quantization.formats import rtn  # noqa: E402
from qwick.quantization.formats.layout import dequantize  # noqa: E402

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
L2_OVERFLOW = 200 << 20
ROWS_WARPS = ((16, 2), (32, 2), (64, 2), (64, 8), (128, 8))  # rows per tile against warps
CUDA = torch.cuda.is_available()
PAIRS = os.environ.get("PAIRS", "1") != "0"
TILE_WORDS = tuple(int(v) for v in os.environ.get("TILE_WORDS", "16 32").split())
MAX_REGISTERS = tuple(int(v) for v in os.environ.get("MAX_REGISTERS", "32 40 48 64").split())
if not CUDA:
    SHAPES = {"tiny": (64, 512)}


def graph_us(calls, n: int) -> float:
    calls()  # compile outside the capture
    if not CUDA:
        return float("nan")
    return triton.testing.do_bench_cudagraph(calls, rep=40, return_mode="median") * 1e3 / n


def profile_one_launch_each() -> None:
    """With NCU=1: the default and the 64-row launch of each shape, once each, between profiler start and
    stop, each after a write that evicts the weights from the L2."""
    dev = torch.device("cuda")
    ws = GemvWorkspace(dev, max_elems=1 << 24)
    flush = torch.empty(L2_OVERFLOW, dtype=torch.uint8, device=dev)
    for n, k in SHAPES.values():
        qw = rtn.quantize(torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5, group_size=128)
        pairs = half_pairs(torch.randn(1, k, device=dev, dtype=torch.bfloat16))
        x = torch.empty(1, k, device=dev, dtype=torch.bfloat16)
        new = default_half2_config(n, k // 8, ws.num_sms)
        old = RowGemvConfig(64, new.block_k, 16 if k > 8192 else (1 if n > 16384 else 8))
        for cfg in (new, old):
            w4_half2_gemv(x, qw, None, ws, cfg, pairs=pairs)  # compile outside the profiled range
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for cfg in (new, old):
            flush.zero_()
            w4_half2_gemv(x, qw, None, ws, cfg, pairs=pairs)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def workspace(dev: torch.device) -> GemvWorkspace:
    """The split-K scratch; on the CPU (the interpreter's smoke test) one made without CUDA's device query."""
    if CUDA:
        return GemvWorkspace(dev, max_elems=1 << 24)
    ws = GemvWorkspace.__new__(GemvWorkspace)
    ws.partials, ws.num_sms = torch.empty(1 << 20), 4
    ws.counters = torch.zeros(1 << 12, dtype=torch.int32)
    ws.configs = {}
    return ws


def layer_inputs(n: int, k: int, dev: torch.device):
    """A random [n, k] layer in RTN int4 (groups of 128), a bf16 input row, their float64 product, and
    copies of the codes that together overflow the L2 (one on the CPU)."""
    qw = rtn.quantize(torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5, group_size=128)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    ref = x.double() @ dequantize(qw).double().T
    n_copies = max(1, -(-L2_OVERFLOW // qw.nbytes)) if CUDA else 1
    return qw, x, ref, [replace(qw, qweight=qw.qweight.clone()) for _ in range(n_copies)]


def sweep_against_f16x2(shapes: dict, candidates, prepare, label, out_path: str) -> None:
    """The prototype kernels' sweep (`int4_ring_gemv.py`, `int4_staged_gemv.py`): per shape, the f16x2
    kernel at its default, then each of `candidates(n, kw, num_sms)`. `prepare(cfg, qw, copies, pairs, ws)`
    gives (one, calls): `one()` a launch on the first copy, returning y, checked against float64 (skipped
    past 4e-3); `calls()` a launch on every copy, timed in CUDA graphs. `label(cfg)` names a candidate.
    Launch shapes that do not compile or fit are reported and skipped; the figures go to out_path."""
    dev = torch.device("cuda")
    ws = workspace(dev)
    report = {}
    for name, (n, k) in shapes.items():
        qw, x, ref, copies = layer_inputs(n, k, dev)
        pairs = half_pairs(x)
        base = default_half2_config(n, k // 8, ws.num_sms)

        def f16x2(copies=copies, x=x, pairs=pairs, base=base) -> None:
            for c in copies:
                w4_half2_gemv(x, c, None, ws, base, pairs=pairs)

        t = graph_us(f16x2, len(copies))
        rows = [{"candidate": "f16x2 default", "us": t, "tb_s": qw.nbytes / t / 1e6}]
        print(f"{name:8s} {'f16x2 default':44s} {t:7.2f} us {qw.nbytes / t / 1e6:5.2f} TB/s", flush=True)
        for cfg in candidates(n, k // 8, ws.num_sms):
            try:
                one, calls = prepare(cfg, qw, copies, pairs, ws)
                err = ((one().double() - ref).norm() / ref.norm()).item()
            except Exception as e:  # a launch shape that does not compile or fit: reported, not fatal
                print(f"{name} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            if err > 4e-3:
                print(f"{name} {label(cfg)}: relative error {err:.3g}, skipped", flush=True)
                continue
            t = graph_us(calls, len(copies))
            rows.append({"candidate": label(cfg), "us": t, "tb_s": qw.nbytes / t / 1e6, "err": err})
            print(f"{name:8s} {label(cfg):44s} {t:7.2f} us {qw.nbytes / t / 1e6:5.2f} TB/s", flush=True)
        report[name] = rows
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


def main() -> None:
    dev = torch.device("cuda" if CUDA else "cpu")
    ws = workspace(dev)
    report = {}
    for name, (n, k) in SHAPES.items():
        qw, x, ref, copies = layer_inputs(n, k, dev)
        nbytes = qw.nbytes
        kw = k // 8
        cands = [("fp32 row GEMV, default", None)]
        base = default_half2_config(n, kw, ws.num_sms)
        cands.append(("f16x2, default", base))
        for bn, bw, split, pf in itertools.product(
            (16, 32, 64, 128), TILE_WORDS, (1, 2, 4, 8, 16), (False, True)
        ):
            # splits beyond about twelve programs per SM only add reduction work (`default_half2_config`)
            if kw % bw == 0 and kw // bw >= split and (split == 1 or (n // bn) * split <= 12 * ws.num_sms):
                label = f"f16x2 {bn}x{bw} split {split}" + (", prefetch" if pf else "")
                cands.append((label, RowGemvConfig(bn, bw, split, prefetch=pf)))
        for (bn, warps), pf in itertools.product(ROWS_WARPS, (False, True)):
            cfg = replace(base, block_n=bn, num_warps=warps, prefetch=pf)  # rows per thread against warps
            label = f"f16x2 {bn}x{cfg.block_k} split {cfg.split_k}, {warps} warps" + (
                ", prefetch" if pf else ""
            )
            cands.append((label, cfg))
        for bn, regs in itertools.product((32, 64), MAX_REGISTERS):  # more programs resident, or spills
            cfg = replace(base, block_n=bn, max_registers=regs)
            if bn != base.block_n:
                cfg = replace(cfg, split_k=max(1, min(base.split_k * base.block_n // bn, 16)))
            cands.append((f"f16x2 {bn}x{cfg.block_k} split {cfg.split_k}, at most {regs} registers", cfg))
        pairs = half_pairs(x) if PAIRS else None
        rows = []
        for label, cfg in cands:
            fn = w4_row_gemv if label.startswith("fp32") else w4_half2_gemv
            kwargs = {"pairs": pairs} if fn is w4_half2_gemv else {}
            out = fn(x, qw, None, ws, cfg, **kwargs).double()
            err = ((out - ref).norm() / ref.norm()).item()
            if err > 4e-3:
                print(f"{name} {label}: relative error {err:.3g}, skipped", flush=True)
                continue

            def calls(fn=fn, cfg=cfg, x=x, copies=copies, kwargs=kwargs) -> None:
                for c in copies:
                    fn(x, c, None, ws, cfg, **kwargs)

            t = graph_us(calls, len(copies))
            rows.append({"candidate": label, "us": t, "tb_s": nbytes / t / 1e6, "err": err})
        report[name] = rows
        best = sorted((r for r in rows if "default" not in r["candidate"]), key=lambda r: r["us"])[:3]
        for r in [r for r in rows if "default" in r["candidate"]] + best:
            print(f"{name:8s} {r['candidate']:40s} {r['us']:7.1f} us {r['tb_s']:5.2f} TB/s", flush=True)
    for label in ("fp32 row GEMV, default", "f16x2, default"):
        total = sum(next(r["us"] for r in report[s] if r["candidate"] == label) for s in report)
        print(f"per layer, {label}: {total:.1f} us")
    with open(sys.argv[1] if len(sys.argv) > 1 else "int4_half2_sweep.json", "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    profile_one_launch_each() if os.environ.get("NCU") else main()
