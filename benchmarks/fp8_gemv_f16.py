"""Is the fp8 skinny GEMM bound by converting codes to bf16? A diagnostic at qwen2.5-7b shapes.

e4m3 converts to fp16 in one instruction per pair of codes and to bf16 in three, and the 8-bit GEMVs
stream only ~2.6 TB/s against bf16's 3.9. This times `qwick.kernels.gemv` (codes -> bf16, bf16 dot) against
a variant whose dot runs in fp16: codes -> fp16 (exact), activations -> fp16 after a 2^-8 scale (exact for
|x| in [2^-6, 2^24): bf16's 8-bit mantissa fits fp16's 11), the scale undone on the fp32 sums. Variant
"x16" takes the activations already in fp16 (what a producing kernel could write), "xcvt" converts them
in the loop. `do_bench` medians, L2 flushed.

    python benchmarks/fp8_gemv_f16.py
"""

import functools
import itertools
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.getcwd())
from qwick.kernels.gemv import MAX_M, GemvConfig, gemv, load_k_tiles, shared_workspace, split_k_epilogue  # noqa: E402
from qwick.quantization.w8a8 import quantize_weight_per_channel  # noqa: E402

X_SCALE = 2.0**-8


@triton.jit(do_not_specialize=["M"])
def _gemv_f16_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, counter_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    CONVERT_X: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        w, x = load_k_tiles(w_rows, x_rows, k + rk, k_end, n_ok, m_ok, EVEN_K)
        if CONVERT_X:
            x = (x.to(tl.float32) * 0.00390625).to(tl.float16)
        acc = tl.dot(x, tl.trans(w.to(tl.float16)), acc)
    acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :] * 256.0
    split_k_epilogue(
        acc, y_ptr, y_ptr, ws_ptr, counter_ptr, rm, rn, m_ok, n_ok, pid_n, pid_k, N, stride_ym, False,
        SPLIT_K, BLOCK_M, BLOCK_N,
    )  # fmt: skip


def gemv_f16(x, codes, scale, ws, cfg: GemvConfig, convert_x: bool) -> torch.Tensor:
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    tiles = triton.cdiv(n, cfg.block_n)
    ws.check(cfg.split_k, MAX_M, n, tiles, cfg)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    _gemv_f16_kernel[(tiles, cfg.split_k)](
        x, codes, scale, y, ws.partials, ws.counters, m, n, k, x.stride(0), codes.stride(0), y.stride(0),
        CONVERT_X=convert_x, SPLIT_K=cfg.split_k, BLOCK_M=MAX_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % k_per_split == 0 and k_per_split % cfg.block_k == 0, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
ws = shared_workspace(torch.device("cuda"))
bench = functools.partial(do_bench, warmup=10, rep=50)
print(
    f"{'layer':8} {'M':>3} {'bf16 dot us':>11} {'TB/s':>5} {'x16 us':>7} {'TB/s':>5} {'xcvt us':>7}  "
    "best x16 config"
)
for name, (n, k) in SHAPES.items():
    codes, scale = quantize_weight_per_channel(torch.randn(n, k, device="cuda") * 0.02, torch.float8_e4m3fn)
    scale = scale.view(-1).contiguous()
    for m in (1, 4, 16):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        x16 = (x.float() * X_SCALE).to(torch.float16)
        ref = gemv(x, codes, None, ws, weight_scale=scale).float()
        base = bench(functools.partial(gemv, x, codes, None, ws, weight_scale=scale)) * 1e3
        d = ws.config_for(m, n, k, 1)
        best, best_cfg, cvt = float("inf"), None, float("nan")
        for bn, bk, split, stages in itertools.product(
            (32, 64), (256, 512), sorted({d.split_k, 2 * d.split_k}), (3, 4)
        ):
            cfg = GemvConfig(bn, bk, split, 4, stages)
            if not ws.fits(split, MAX_M, n, triton.cdiv(n, bn)):
                continue
            y = gemv_f16(x16, codes, scale, ws, cfg, False).float()
            assert (y - ref).norm() / ref.norm() < 1e-2, (name, m, cfg)
            t = bench(functools.partial(gemv_f16, x16, codes, scale, ws, cfg, False)) * 1e3
            if t < best:
                best, best_cfg = t, cfg
        cvt = bench(functools.partial(gemv_f16, x, codes, scale, ws, best_cfg, True)) * 1e3
        tb = n * k / 1e6
        print(
            f"{name:8} {m:3d} {base:11.1f} {tb / base:5.2f} {best:7.1f} {tb / best:5.2f} {cvt:7.1f}  "
            f"{best_cfg}",
            flush=True,
        )
