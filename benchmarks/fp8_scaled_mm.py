"""cuBLAS fp8 GEMMs (`torch._scaled_mm`, row-wise scales) at qwen2.5-7b layer shapes: exact fp32
accumulation (`use_fast_accum=False`, what qwick runs) against Hopper's fast accumulation, per M, with each
one's worst relative error against a float64 product of the same codes.

    python benchmarks/fp8_scaled_mm.py
"""

import functools

import torch
from triton.testing import do_bench

FP8 = torch.float8_e4m3fn
SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}


def codes(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, cols, device="cuda")
    scale = x.abs().amax(dim=1, keepdim=True) / 448.0
    return (x / scale).to(FP8), scale


def scaled_mm(x, xs, w, ws, fast: bool) -> torch.Tensor:
    return torch._scaled_mm(
        x, w.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16, use_fast_accum=fast
    )


print(f"{'layer':8} {'M':>5} {'exact us':>9} {'fast us':>8} {'speedup':>7} {'exact err':>9} {'fast err':>9}")
for name, (n, k) in SHAPES.items():
    w, ws = codes(n, k)
    for m in (64, 256, 1024, 8192):
        x, xs = codes(m, k)
        ref = (x.double() @ w.double().t()) * xs.double() * ws.double().view(1, -1)
        us, errs = [], []
        for fast in (False, True):
            mm = functools.partial(scaled_mm, x, xs, w, ws, fast)
            us.append(do_bench(mm) * 1e3)
            errs.append(((mm().double() - ref).abs().max() / ref.abs().max()).item())
        times = f"{us[0]:9.1f} {us[1]:8.1f} {us[0] / us[1]:7.2f}"
        print(f"{name:8} {m:5d} {times} {errs[0]:9.2e} {errs[1]:9.2e}", flush=True)
