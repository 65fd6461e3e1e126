"""fp8 per-channel GEMMs at 17 <= M <= 256 (mid-size decode batches, short prompts): cuBLAS `_scaled_mm`
against qwick's split-K Triton GEMM (`rowwise_fp8_mm`), its default launch shape and the best of a sweep.
Both take the same fp8 codes; the per-token quantization of x is not timed. `do_bench` medians, L2 flushed.

    python benchmarks/fp8_mid_m_sweep.py [7b|14b] [layer ...]
    MS=128,192,256 WIDE=1 python benchmarks/fp8_mid_m_sweep.py 7b down

`MS` picks the row counts; `WIDE=0` times the default launch shape and cuBLAS only; `WIDE=1` sweeps other
launch shapes instead (128-row tiles, 256-wide output tiles, splits of 6), each with the fp32 promotion every
128 products of K as well as every 32; `WIDE=2` loads the tiles through tensor descriptors (TMA) and promotes
every 128 products of K, every 256 (the 256-deep tiles) or never (fast accumulation, too coarse over 7b's down
projection: here to show what promoting costs).
"""

import functools
import itertools
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.getcwd())
from qwick.kernels.gemv import shared_workspace  # noqa: E402
from qwick.kernels.w8a8 import RowwiseConfig, rowwise_config, rowwise_fp8_mm  # noqa: E402
from qwick.quantization.w8a8 import W8A8LinearMethod  # noqa: E402

FP8 = torch.float8_e4m3fn
FAST_ACCUM_MAX_K = W8A8LinearMethod.fast_accum_max_k
SHAPES = {
    "7b": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)},
    "14b": {"qkv": (7168, 5120), "o": (5120, 5120), "gate_up": (27648, 5120), "down": (5120, 13824)},
}
CONFIGS = [
    RowwiseConfig(bm, bn, bk, split, 4 if bm == 64 else 8, stages, 32)
    for (bm, bn, bk), split, stages in itertools.product(
        ((64, 128, 128), (64, 128, 256), (64, 64, 256), (128, 128, 128), (128, 64, 128)), (1, 2, 4, 8), (3, 4)
    )
]
WIDE_CONFIGS = [
    RowwiseConfig(bm, bn, bk, split, 4 if bm * bn <= 64 * 128 else 8, stages, promote)
    for (bm, bn, bk), split, stages, promote in itertools.product(
        ((64, 64, 256), (64, 128, 128), (128, 128, 128), (128, 64, 128), (128, 256, 128), (128, 128, 256)),
        (1, 2, 4, 6),
        (3, 4),
        (32, 128),
    )
]
TMA_CONFIGS = [
    RowwiseConfig(bm, bn, bk, split, 4 if bm * bn <= 64 * 128 else 8, stages, promote, True)
    for (bm, bn, bk), split, stages, promote in itertools.product(
        ((64, 128, 128), (128, 64, 128), (128, 128, 128), (128, 256, 128), (128, 128, 256)),
        (1, 2, 3, 4),
        (3, 4),
        (128, 256, 0),
    )
    if promote <= bk
]
CONFIGS = {"0": [], "1": WIDE_CONFIGS, "2": TMA_CONFIGS}.get(os.environ.get("WIDE", ""), CONFIGS)
ROWS = [int(m) for m in os.environ.get("MS", "17,32,64,128,256").split(",")]
bench = functools.partial(do_bench, warmup=10, rep=40)


def codes(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, cols, device="cuda")
    scale = x.abs().amax(dim=1, keepdim=True) / 448.0
    return (x / scale).to(FP8), scale


def cublas(x, xs, w, wscale, fast: bool = True) -> torch.Tensor:
    """What qwick runs for bf16 models: fast accumulation (K <= 8192) or exact (the down projection)."""
    return torch._scaled_mm(
        x, w.t(), scale_a=xs, scale_b=wscale.view(1, -1), out_dtype=torch.bfloat16, use_fast_accum=fast
    )


def ours(x, xs, w, wscale, cfg=None) -> torch.Tensor:
    return rowwise_fp8_mm(x, xs, w, wscale, None, ws, torch.bfloat16, cfg)


def sweep(name: str, n: int, k: int, m: int, w: torch.Tensor, wscale: torch.Tensor) -> None:
    x, xs = codes(m, k)
    args = (x, xs, w, wscale)
    ref = cublas(*args, False).float()  # exact accumulation
    assert (ours(*args).float() - ref).norm() / ref.norm() < 1e-2, (name, m)
    t_cublas = bench(functools.partial(cublas, *args, k <= FAST_ACCUM_MAX_K))
    t_ours = bench(functools.partial(ours, *args))
    best, best_cfg, timed = float("inf"), None, []
    for cfg in CONFIGS:
        tiles_m = -(-m // cfg.block_m)
        if not ws.fits(cfg.split_k, tiles_m * cfg.block_m, n, tiles_m * -(-n // cfg.block_n)):
            continue
        try:
            t = bench(functools.partial(ours, *args, cfg))
        except Exception as e:  # e.g. out of shared memory for this shape
            print(f"  skip {cfg}: {type(e).__name__}", flush=True)
            continue
        timed.append((t, cfg))
        if t < best:
            best, best_cfg = t, cfg
    d = rowwise_config(m, n, k, ws)
    if os.environ.get("WIDE", "0") != "0":  # the runners-up, and each one's error against exact accumulation
        for t, cfg in sorted(timed, key=lambda tc: tc[0])[:6]:
            err = (ours(*args, cfg).float() - ref).norm() / ref.norm()
            print(f"    {t * 1e3:7.1f} us  rel err {err:.1e}  {cfg}", flush=True)
    print(
        f"{name:8} {m:4d} {t_cublas * 1e3:10.1f} {t_ours * 1e3:8.1f} {best * 1e3:8.1f}  {best_cfg} "
        f"(default {d.block_m}x{d.block_n}x{d.block_k} split {d.split_k})",
        flush=True,
    )


ws = shared_workspace(torch.device("cuda"))
model = sys.argv[1] if len(sys.argv) > 1 else "7b"
print(f"{'layer':8} {'M':>4} {'cuBLAS us':>10} {'ours us':>8} {'best us':>8}  best config")
layers = sys.argv[2:] or list(SHAPES[model])
for name, (n, k) in SHAPES[model].items():
    if name not in layers:
        continue
    w, wscale = codes(n, k)
    for m in ROWS:
        sweep(name, n, k, m, w, wscale)
