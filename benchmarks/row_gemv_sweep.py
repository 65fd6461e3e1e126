"""Batch-1 GEMV on 8-bit and 4-bit codes on the CUDA cores (int4: `qwick.kernels.row_gemv`; 8-bit:
`qwick.kernels.row_gemv_w8`) against the tensor-core kernels (`gemv` on 8-bit codes, `w4a16.quant_matmul`) and
cuBLAS on the bf16 layer, at the qwen2.5-7b layer shapes. Sweeps launch shapes, checks every candidate
against a float64 reference, prints a table and writes JSON (argv[1], default row_gemv_sweep.json).

MODES=int8,fp8,int4 picks the weight formats; ONLY=7b.down picks shapes by prefix; BUDGET_S caps the sweep;
GROUP=64|128|256 the int4 group size (default 128). Times are `triton.testing.do_bench` medians (L2 flushed
between runs), except the int4 row-GEMV candidates: CUDA-graph replays over copies of the weight that
together overflow the L2, as a model's layers do in a decode graph (per-launch `do_bench` also times the
host's launch gaps, several us at these sizes). GRAPHS=1 times the 8-bit variant and the tensor-core
kernel (`gemv`, W8A16 at its default launch shape) that way too. TB/s counts the bytes of the codes (plus
scales and zero points for int4).
"""

import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.getcwd())
from qwick.kernels.gemv import GemvWorkspace, gemv  # noqa: E402
from qwick.kernels.row_gemv import (  # noqa: E402
    RowGemvConfig,
    default_w4_config,
    w4_row_gemv,
)
from qwick.kernels.row_gemv_w8 import default_w8_row_config, w8_row_gemv  # noqa: E402
from qwick.kernels.w4a16 import quant_matmul  # noqa: E402
from qwick.quantization.formats import rtn  # noqa: E402
from qwick.quantization.formats.layout import dequantize  # noqa: E402
from qwick.quantization.w8a8 import quantize_weight_per_channel  # noqa: E402

SHAPES = {
    "7b.qkv": (4608, 3584),
    "7b.o": (3584, 3584),
    "7b.gate_up": (37888, 3584),
    "7b.down": (3584, 18944),
}
if torch.cuda.is_available():
    dev = torch.device("cuda")
    ws = GemvWorkspace(dev, max_elems=1 << 24)
else:  # a smoke test of this script: TRITON_INTERPRET=1 on the CPU, tiny shapes, fake timings
    dev = torch.device("cpu")
    ws = GemvWorkspace.__new__(GemvWorkspace)
    ws.partials, ws.counters, ws.num_sms = torch.empty(1 << 20), torch.zeros(1 << 12, dtype=torch.int32), 4
    ws.configs = {}
    SHAPES = {"tiny.a": (64, 512), "tiny.b": (32, 1024)}
    triton.testing.do_bench = lambda fn, **kw: (fn(), 1.0)[1]
SHAPES = {k: v for k, v in SHAPES.items() if k.startswith(os.environ.get("ONLY", ""))}
MODES = os.environ.get("MODES", "int8,fp8,int4").split(",")
BUDGET_S = float(os.environ.get("BUDGET_S", "400"))
GROUP = int(os.environ.get("GROUP", "128"))
L2_OVERFLOW = 200 << 20  # bytes of weight copies per graph timing: four times the H200's L2
GRAPHS = os.environ.get("GRAPHS") == "1" and dev.type == "cuda"  # 8-bit timed in CUDA graphs too
OUT = sys.argv[1] if len(sys.argv) > 1 else "row_gemv_sweep.json"
T0 = time.time()


def bench(fn):
    # 100 ms of warm-up: the GPU idles (and drops its clocks) while each candidate compiles
    return triton.testing.do_bench(fn, warmup=100, rep=25, return_mode="median")


def bench_graph(call, weights: list) -> float:
    """us per `call(weight)`, replayed in one CUDA graph over `weights` (see the module docstring)."""

    def calls() -> None:
        for weight in weights:
            call(weight)

    calls()  # compile outside the capture
    if dev.type != "cuda":
        return 1.0
    return triton.testing.do_bench_cudagraph(calls, rep=30, return_mode="median") * 1e3 / len(weights)


def sweep(name, run, cands, ref, nbytes, timer=None):
    """Time every candidate that matches the reference (with `timer(args)` in us if given); returns
    [(us, label, TB/s)] sorted."""
    out = []
    for label, args in cands:
        if time.time() - T0 > BUDGET_S:
            print("budget spent, stopping the sweep", flush=True)
            break
        try:
            y = run(*args)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            if not err < 5e-3:
                print(f"BAD {name} {label} err={err:.3g}", flush=True)
                continue
            out.append((timer(args) if timer else bench(lambda a=args: run(*a)) * 1e3, label))
        except Exception as e:  # a shape the compiler rejects (registers, shared memory)
            print(f"skip {name} {label}: {type(e).__name__} {str(e)[:100]}", flush=True)
    out.sort()
    return [(t, label, nbytes / (t * 1e-6) / 1e12) for t, label in out]


def case(name: str, n: int, k: int, mode: str) -> dict:
    """Old kernel, cuBLAS and the swept row-GEMV candidates for one layer shape and weight format."""
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    t_cublas = bench(lambda w=w, x=x: F.linear(x, w)) * 1e3
    splits = (1, 2) if n >= 16384 else (4, 8, 16)
    if mode in ("int8", "fp8"):
        qdtype = torch.int8 if mode == "int8" else torch.float8_e4m3fn
        codes, scale = quantize_weight_per_channel(w, qdtype)
        scale = scale.reshape(-1).contiguous()
        ref = (x.double() @ codes.double().T) * scale.double()
        nbytes = codes.numel() + 4 * n
        copies = [codes] + [codes.clone() for _ in range(-(-L2_OVERFLOW // nbytes) - 1 if GRAPHS else 0)]
        if GRAPHS:
            t_old = bench_graph(lambda c: gemv(x, c, None, ws, weight_scale=scale), copies)
        else:
            t_old = bench(lambda: gemv(x, codes, None, ws, weight_scale=scale)) * 1e3
        cands = [("default " + str(default_w8_row_config(n, k, ws.num_sms)), (None,))]
        cands += [
            (f"bn{bn} bk{bk} split{sk} w4 pf{pf}", (RowGemvConfig(bn, bk, sk, 4, 1, bool(pf)),))
            for (bn, bk), sk, pf in itertools.product(
                ((16, 256), (32, 256), (16, 512), (32, 128)), splits, (0, 1)
            )
        ]
        rows = sweep(
            name,
            lambda cfg: w8_row_gemv(x, codes, scale, None, ws, cfg),
            cands,
            ref,
            nbytes,
            timer=(lambda a: bench_graph(lambda c: w8_row_gemv(x, c, scale, None, ws, a[0]), copies))
            if GRAPHS
            else None,
        )
    else:
        qw = rtn.quantize(w, group_size=GROUP)
        qws = [qw] + [rtn.quantize(w, group_size=GROUP) for _ in range(-(-L2_OVERFLOW // qw.nbytes) - 1)]
        ref = x.double() @ dequantize(qw).double().T
        nbytes = qw.nbytes
        t_old = bench(lambda: quant_matmul(x, qw, None, ws)) * 1e3
        words = GROUP // 8
        cands = [("default " + str(default_w4_config(n, k // 8, words, ws.num_sms)), (None,))]
        cands += [
            (f"bn{bn} split{sk} w{nw} pf{int(pf)} ls{ls}", (RowGemvConfig(bn, words, sk, nw, 1, pf, ls),))
            for bn, sk, nw, pf, ls in itertools.product((32, 64, 128), splits, (4, 8), (False, True), (1, 3))
            if not (pf and ls > 1)  # the register double buffer or the software pipeline, not both
        ]
        rows = sweep(
            name,
            lambda cfg: w4_row_gemv(x, qw, None, ws, cfg),
            cands,
            ref,
            nbytes,
            timer=lambda args: bench_graph(lambda q: w4_row_gemv(x, q, None, ws, args[0]), qws),
        )
    default = next((r for r in rows if r[1].startswith("default")), None)
    result = {
        "n": n,
        "k": k,
        "bytes": nbytes,
        "cublas_bf16_us": t_cublas,
        "old_kernel_us": t_old,
        "default_us": default[0] if default else None,
        "best": rows[:8],
    }
    best = rows[0] if rows else (float("nan"), "-", 0.0)
    print(
        f"{name:22s} cuBLAS bf16 {t_cublas:7.1f} us | old {t_old:7.1f} us ({nbytes / t_old / 1e6:4.2f} TB/s)"
        f" | default {default[0] if default else float('nan'):7.1f} us"
        f" | best {best[0]:7.1f} us ({best[2]:4.2f} TB/s) {best[1]}",
        flush=True,
    )
    for t, label, tbs in rows[1:5]:
        print(f"{'':22s}   {t:7.1f} us ({tbs:4.2f} TB/s) {label}", flush=True)
    return result


results = {
    f"{sname}.{mode}": case(f"{sname}.{mode}", n, k, mode)
    for (sname, (n, k)), mode in itertools.product(SHAPES.items(), MODES)
}
with open(OUT, "w") as f:
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    json.dump({"device": device, "results": results}, f, indent=1)
print("wrote", OUT, f"in {time.time() - T0:.0f} s")
