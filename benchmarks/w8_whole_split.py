"""Experiment (42nd session, not kept): the 8-bit one-row GEMVs with each program's whole share of the
weights loaded before its programmatic-dependent-launch wait, so that a small projection streams entirely
while the kernel before it runs.

Imported, it patches `qwick.kernels.row_gemv_w8.w8_row_gemv` (the fp8 / int8 o projection, W8A16) and,
with QKV_MAX_N set, `qwick.kernels.gemv.gemv`'s one-row W8A8 launches narrower than that (the QKV
projection): grids of [O_BN rows x O_BK codes] programs (default 16 x 512, O_WARPS 2 warps), K / O_BK
splits, one tile a program (1,568 programs at the 7b o projection: one wave, 56 registers a thread under
Triton 3.6). Batch 1 with it, from the repository root:

    python -c "import sys; sys.path[:0] = ['benchmarks']; import w8_whole_split
    from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))" bench latency --num-iters 3 \
      --shape qwen2.5-7b --max-model-len 4096 --input-len 128 --output-len 128 --quantization fp8

Run as a script: its sums against PyTorch's (CUDA, or Triton's interpreter on the CPU).
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())  # run from the repository root
import qwick.kernels.row_gemv_w8 as R  # noqa: E402
from qwick.kernels.half2 import _EMULATE  # noqa: E402
from qwick.kernels.pdl import pdl_supported, pdl_trigger, pdl_wait  # noqa: E402
from qwick.kernels.row_gemv import RowGemvConfig, _check_workspace, _row_epilogue  # noqa: E402

BN = int(os.environ.get("O_BN", "16"))
BK = int(os.environ.get("O_BK", "512"))
WARPS = int(os.environ.get("O_WARPS", "2"))


@triton.jit
def _w8_row_whole_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    N,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EARLY: tl.constexpr,
    xs_ptr=None,
    HAS_XS: tl.constexpr = False,
    TRIGGER: tl.constexpr = False,
    TRIGGER_START: tl.constexpr = False,
):
    if TRIGGER_START:
        pdl_trigger()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :], mask=n_ok[:, None], other=0.0)
    if EARLY and not _EMULATE:
        pdl_wait()
    x = tl.load(x_ptr + rk).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if TRIGGER and not TRIGGER_START:
        pdl_trigger()
    if HAS_XS:
        acc *= tl.load(xs_ptr)
    acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)
    _row_epilogue(
        acc[:, None], b_ptr, y_ptr, ws_ptr, counter_ptr, rn, n_ok, pid_n, pid_k, N, HAS_BIAS, SPLIT_K, BLOCK_N
    )


_stock = R.w8_row_gemv
USED = {"whole": 0, "stock": 0, "qkv": 0}


def _whole(x, codes, scale, bias, ws, out_dtype, x_scale=None, trigger=False, at_start=False):
    """y [1, N] = (x @ codes.T) * scale (* x_scale) + bias, one whole-split tile a program."""
    n, k = codes.shape
    cfg = RowGemvConfig(BN, BK, k // BK, WARPS)
    tiles = _check_workspace(ws, n, cfg)
    y = torch.empty((1, n), dtype=out_dtype, device=x.device)
    early = pdl_supported(x.device)
    scale = scale.reshape(n)
    flags = dict(HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k, BLOCK_N=BN, BLOCK_K=BK, EARLY=early)
    flags |= dict(HAS_XS=x_scale is not None, TRIGGER=trigger and early, TRIGGER_START=at_start and early)
    _w8_row_whole_kernel[(tiles, cfg.split_k)](
        x.contiguous(),
        codes,
        scale,
        bias if bias is not None else scale,
        y,
        ws.partials,
        ws.counters,
        n,
        codes.stride(0),
        xs_ptr=x_scale,
        num_warps=WARPS,
        num_stages=1,
        **flags,
        **({"launch_pdl": True} if early else {}),
    )
    return y


def w8_row_gemv(x, codes, scale, bias, ws, config=None, preload=False):
    n, k = codes.shape
    if not preload or config is not None or k % BK or x.shape != (1, k) or codes.stride(1) != 1:
        USED["stock"] += 1
        return _stock(x, codes, scale, bias, ws, config, preload)
    USED["whole"] += 1
    return _whole(x, codes, scale, bias, ws, x.dtype)


R.w8_row_gemv = w8_row_gemv

import qwick.kernels.gemv as G  # noqa: E402

_stock_gemv = G.gemv
QKV_MAX_N = int(os.environ.get("QKV_MAX_N", "0"))  # W8A8 one-row GEMVs narrower than this: whole splits


def gemv(x, weight, bias, ws, config=None, weight_scale=None, x_scale=None, out_dtype=None, **kw):
    """`qwick.kernels.gemv.gemv`, with one-row W8A8 launches narrower than QKV_MAX_N (and K at most
    8192, one activation scale) in whole splits."""
    n, k = weight.shape
    x_group = kw.get("x_group")
    takes = x_scale is not None and x.shape[0] == 1 and n < QKV_MAX_N and k <= 8192 and k % BK == 0
    takes = takes and kw.get("preload", False) and not kw.get("gated") and config is None
    if not takes or (x_group is not None and x_group < k):
        USED["stock"] += 1
        return _stock_gemv(x, weight, bias, ws, config, weight_scale, x_scale, out_dtype, **kw)
    USED["qkv"] += 1
    trigger = kw.get("trigger", False)
    at_start = trigger and kw.get("trigger_at_start", False)
    return _whole(x, weight, weight_scale, bias, ws, out_dtype, x_scale, trigger, at_start)


G.gemv = gemv

import atexit  # noqa: E402

atexit.register(lambda: print("w8_whole_split launches:", USED, flush=True))

if __name__ == "__main__":  # correctness against torch, both code types, with and without bias
    from qwick.kernels.gemv import GemvWorkspace

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    ws = GemvWorkspace(dev) if dev.type == "cuda" else None
    if ws is None:  # the interpreter: a CPU workspace
        ws = GemvWorkspace.__new__(GemvWorkspace)
        ws.partials = torch.empty(1 << 20, dtype=torch.float32)
        ws.counters = torch.zeros(1 << 12, dtype=torch.int32)
        ws.num_sms = 8
        ws.configs = {}
    QKV_MAX_N = 1 << 30
    for dt in (torch.float8_e4m3fn, torch.int8):
        for n, k in ((3584, 3584), (100, 1024)):
            w = (torch.randn(n, k, device=dev) * 4).clamp(-100, 100).to(dt)
            s = torch.rand(n, device=dev) * 0.01
            x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
            for b in (None, torch.randn(n, device=dev, dtype=torch.bfloat16)):
                y = w8_row_gemv(x, w, s, b, ws, preload=True)
                ref = (x.float() @ w.float().T) * s
                if b is not None:
                    ref = ref + b.float()
                err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                print(dt, n, k, b is not None, f"rel err {err:.2e}", "OK" if err < 1e-2 else "BAD")
            # W8A8: codes in, one scale
            xs = x.float().abs().amax().clamp(min=1e-6) / (448.0 if dt != torch.int8 else 127.0)
            xq = x.float() / xs
            xq = xq.round().clamp(-127, 127).to(dt) if dt == torch.int8 else xq.to(dt)
            b = torch.randn(n, device=dev, dtype=torch.bfloat16)
            y = gemv(
                xq,
                w,
                b,
                ws,
                weight_scale=s,
                x_scale=xs.reshape(1, 1),
                out_dtype=torch.bfloat16,
                preload=True,
                trigger=True,
                trigger_at_start=True,
            )
            ref = (xq.float() @ w.float().T) * xs * s + b.float()
            err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
            print("w8a8", dt, n, k, f"rel err {err:.2e}", "OK" if err < 1e-2 else "BAD")
    print(USED)
