"""The split-K fp8 GEMM's default launch on 7b's down projection at 128-256 rows, timed three ways: `do_bench`
(eager, L2 flushed, as `fp8_mid_m_sweep.py` times it), CUDA-graph replays (as decode runs it) and the host's
time per call; with the config computed inside the call and passed in, TMA and plain loads, and the
pre-TMA 128 x 64 tiles, beside cuBLAS. The twenty-third session saw the default at ~93 us in `do_bench`
where the sweep had timed the same launch shape at 39 us.

    python benchmarks/rowwise_launch_diag.py            # the down projection, three ways
    python benchmarks/rowwise_launch_diag.py o qkv      # other layers: TMA launch shapes in CUDA graphs
"""

import functools
import os
import sys
import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.getcwd())
from qwick.kernels.gemv import shared_workspace  # noqa: E402
from qwick.kernels.w8a8 import RowwiseConfig, rowwise_config, rowwise_fp8_mm  # noqa: E402

FP8 = torch.float8_e4m3fn
N, K = 3584, 18944
LAYERS = {"qkv": (4608, 3584), "o": (3584, 3584)}


def codes(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, cols, device="cuda")
    scale = x.abs().amax(dim=1, keepdim=True) / 448.0
    return (x / scale).to(FP8), scale


def main() -> None:
    ws = shared_workspace(torch.device("cuda"))
    w, wscale = codes(N, K)
    for m in (128, 192, 256):
        x, xs = codes(m, K)
        d = rowwise_config(m, N, K, ws)
        cfgs = {
            "default (computed)": None,
            "default (passed)": d,
            "plain loads": RowwiseConfig(d.block_m, d.block_n, d.block_k, d.split_k, 4, d.num_stages),
            "128 x 64, split 4": RowwiseConfig(128, 64, 128, 4, 4, 4),
        }
        for name, cfg in cfgs.items():
            f = functools.partial(rowwise_fp8_mm, x, xs, w, wscale, None, ws, torch.bfloat16, cfg)
            f()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(100):
                f()
            host = (time.perf_counter() - t0) * 1e4
            torch.cuda.synchronize()
            eager = do_bench(f, warmup=10, rep=40) * 1e3
            graph = do_bench_cudagraph(f, rep=40) * 1e3
            print(f"M={m} {name:20} do_bench {eager:6.1f} us  graph {graph:6.1f} us  host {host:5.1f} us")
        c = functools.partial(
            torch._scaled_mm, x, w.t(), scale_a=xs, scale_b=wscale.view(1, -1), out_dtype=torch.bfloat16
        )
        eager, graph = do_bench(c, warmup=10, rep=40) * 1e3, do_bench_cudagraph(c, rep=40) * 1e3
        print(f"M={m} {'cuBLAS':20} do_bench {eager:6.1f} us  graph {graph:6.1f} us", flush=True)


def layers(names: list[str]) -> None:
    """TMA launch shapes (fp32 promotion every 128 products) against cuBLAS, both in CUDA graphs."""
    ws = shared_workspace(torch.device("cuda"))
    for name in names:
        n, k = LAYERS[name]
        w, wscale = codes(n, k)
        for m in (128, 256):
            x, xs = codes(m, k)
            c = functools.partial(
                torch._scaled_mm,
                x,
                w.t(),
                scale_a=xs,
                scale_b=wscale.view(1, -1),
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )
            cells = [f"cuBLAS {do_bench_cudagraph(c, rep=40) * 1e3:.1f}"]
            for bm, bn, split in ((64, 128, 1), (64, 128, 2), (64, 128, 3), (128, 64, 1), (128, 64, 2)):
                cfg = RowwiseConfig(bm, bn, 128, split, 4, 4, tma=True)
                f = functools.partial(rowwise_fp8_mm, x, xs, w, wscale, None, ws, torch.bfloat16, cfg)
                f()
                cells.append(f"{bm}x{bn} split {split} {do_bench_cudagraph(f, rep=40) * 1e3:.1f}")
            print(f"{name} M={m} graph us: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        layers(sys.argv[1:])
    else:
        main()
