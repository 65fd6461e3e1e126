"""Decode GEMV with the weight as the tall operand: y^T = W x^T, so that a 64-128-row weight tile is the
M side of a Hopper warpgroup MMA (wgmma) read straight from shared memory, and the (at most 16) activation
rows are its N side. `qwick.kernels.gemv` computes y = x W^T with x padded to 16 rows as the M side, which
Triton lowers to mma.sync: native for bf16 and int8, but fp8 has no mma.sync on sm_90 and is emulated by
converting to fp16 (BENCHMARKS.md: the fp8 W8A8 loop is 257 SASS instructions per tile against int8's 111).

Modes: bf16 (bf16 W and x), w8a8 (fp8 or int8 W and x codes, one scale per row of each), w8a16 (8-bit W
converted to bf16 in registers, bf16 x). Each is timed against today's `gemv` on the same inputs, over a
grid of launch shapes, and checked against a float64 reference. Prints one line per layer shape and mode;
writes JSON to argv[1]. Env: ONLY (shape prefix), MODES, MS (batch sizes), BUDGET_S.
"""

import itertools
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from qwick.kernels.gemv import GemvWorkspace, gemv, split_k_epilogue  # noqa: E402

SHAPES = {"gate_up": (37888, 3584), "down": (3584, 18944), "qkv": (4608, 3584), "o": (3584, 3584)}
SHAPES = {k: v for k, v in SHAPES.items() if k.startswith(os.environ.get("ONLY", ""))}
MODES = os.environ.get("MODES", "fp8,int8,bf16,w8a16").split(",")
MS = [int(m) for m in os.environ.get("MS", "1").split(",")]
BUDGET_S = float(os.environ.get("BUDGET_S", "240"))
T0 = time.time()


@triton.jit(do_not_specialize=["M"])
def _wx_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    xs_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_SCALE: tl.constexpr,
    X_CODES: tl.constexpr,
    INT_DOT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
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
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32 if INT_DOT else tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        kk = k + rk
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
        if X_CODES:
            acc = tl.dot(w, tl.trans(x), acc, out_dtype=acc.dtype)
        else:
            acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    out = tl.trans(acc.to(tl.float32))  # [BLOCK_M, BLOCK_N]
    if HAS_SCALE:
        out *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if X_CODES:
        out *= tl.load(xs_ptr + rm, mask=m_ok, other=0.0)[:, None]
    split_k_epilogue(
        out, s_ptr, y_ptr, ws_ptr, counter_ptr, rm, rn, m_ok, n_ok, pid_n, pid_k, N, stride_ym,
        False, SPLIT_K, BLOCK_M, BLOCK_N,
    )  # fmt: skip


def wx_gemv(x, w, scale, x_scale, ws, bn, bk, split, warps, stages):
    """y [M, N] bf16 = (x @ w.T) * x_scale * scale, with W as the wgmma M side. K % (bk * split) == 0."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    tiles = triton.cdiv(n, bn)
    ws.check(split, 16, n, tiles, None)
    _wx_kernel[(tiles, split)](
        x, w, scale if scale is not None else y, x_scale if x_scale is not None else y, y,
        ws.partials, ws.counters, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        HAS_SCALE=scale is not None, X_CODES=x_scale is not None, INT_DOT=x.dtype == torch.int8,
        SPLIT_K=split, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, num_warps=warps,
    )  # fmt: skip
    return y


def bench(fn) -> float:
    # 100 ms of warm-up: the GPU idles (and drops its clocks) while each candidate compiles
    return triton.testing.do_bench(fn, warmup=100, rep=30, return_mode="median") * 1e3


def launch_shapes(n: int, k: int, w_bytes: int):
    """Tiles of 64 or 128 weight rows, 128-512 columns deep, 3-5 stages that fit in shared memory."""
    splits = (1, 2) if n >= 16384 else (2, 4, 8)
    for bn, bk, sk, w, st in itertools.product((64, 128), (128, 256, 512), splits, (4, 8), (3, 4, 5)):
        smem = st * bk * (bn * w_bytes + 16 * (1 if w_bytes == 1 and bk else 2))
        if k % (bk * sk) or k // (bk * sk) < 2 or (w == 8 and bn == 64) or smem > 200_000:
            continue
        if bk == 512 and bn == 128:
            continue
        yield bn, bk, sk, w, st


def inputs(n: int, k: int, m: int, mode: str, dev):
    """(x, w, weight scale, x scale, float64 reference, kwargs of today's gemv) for one mode."""
    from qwick.kernels.w8a8 import quantize_rows
    from qwick.quantization.w8a8 import qmax, quantize_weight_per_channel

    wf = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    xf = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    if mode == "bf16":
        return xf, wf, None, None, xf.double() @ wf.double().T, {}
    qdtype = torch.int8 if mode == "int8" else torch.float8_e4m3fn
    codes, scale = quantize_weight_per_channel(wf, qdtype)
    scale = scale.reshape(-1).contiguous()
    if mode == "w8a16":
        ref = (xf.double() @ codes.double().T) * scale.double()
        return xf, codes, scale, None, ref, {"weight_scale": scale}
    xq, xs = quantize_rows(xf, qdtype, qmax(qdtype), 1e-12, None)
    ref = (xq.double() @ codes.double().T) * xs.double() * scale.double()
    return xq, codes, scale, xs, ref, {"weight_scale": scale, "x_scale": xs, "out_dtype": torch.bfloat16}


def case(name: str, n: int, k: int, mode: str, m: int, ws: GemvWorkspace) -> dict:
    """Today's gemv and every W-as-M launch shape that matches the reference, for one layer and mode."""
    x, w, scale, xs, ref, kw = inputs(n, k, m, mode, ws.partials.device)
    nbytes = w.numel() * w.element_size()
    t_today = bench(lambda: gemv(x, w, None, ws, **kw))
    found = []
    for shape in launch_shapes(n, k, w.element_size()):
        if time.time() - T0 > BUDGET_S:
            print("budget spent", flush=True)
            break
        try:
            y = wx_gemv(x, w, scale, xs, ws, *shape)
        except Exception as e:  # a shape the compiler rejects (shared memory, registers)
            print(f"skip {name} {mode} {shape}: {type(e).__name__} {str(e)[:80]}", flush=True)
            continue
        err = ((y.double() - ref).norm() / ref.norm()).item()
        if not err < 5e-3:
            print(f"BAD {name} {mode} {shape} err={err:.3g}", flush=True)
            continue
        found.append((bench(lambda s=shape: wx_gemv(x, w, scale, xs, ws, *s)), shape, err))
    found.sort()
    head = found[0] if found else (float("nan"), "-", float("nan"))
    print(
        f"{name:8s} {mode:6s} m={m:2d} today {t_today:6.1f} us ({nbytes / t_today / 1e6:.2f} TB/s) | "
        f"W-as-M {head[0]:6.1f} us ({nbytes / head[0] / 1e6:.2f} TB/s) {head[1]} err {head[2]:.1e}",
        flush=True,
    )
    for t, s, _ in found[1:4]:
        print(f"{'':24s} {t:6.1f} us {s}", flush=True)
    best = [{"us": t, "bn_bk_split_warps_stages": s, "err": e} for t, s, e in found[:6]]
    return {"shape": name, "mode": mode, "m": m, "n": n, "k": k, "today_us": t_today, "best": best}


def main() -> None:
    ws = GemvWorkspace(torch.device("cuda"), max_elems=1 << 24)
    rows = [
        case(name, n, k, mode, m, ws)
        for (name, (n, k)), mode, m in itertools.product(SHAPES.items(), MODES, MS)
    ]
    with open(sys.argv[1] if len(sys.argv) > 1 else "gemv_wgmma_sweep.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
