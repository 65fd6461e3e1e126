"""A batch-1 W8A8 MLP in one launch, against the engine's three. Its engine version (`qwick.kernels.mlp_row`
in commit a2a8c98: down read as it is, h's codes, sums in int64 fixed point so that every run gives the
same bits) lost 2.2% (fp8) and 3.1% (int8) at batch 1 on an H100 and was removed (BENCHMARKS.md, 50th
session); with this script's fp32 atomics it had gained 0.1-1.4%.

Today one decode row's 8-bit MLP is the gate/up GEMV on the norm's activation codes, SiLU-and-mul writing
the down projection's codes (one scale per 512 columns), and the down GEMV, each launched early
(`qwick.kernels.pdl`). The 42nd session's critical path (fp8, H100) put down ~4 us and SiLU-and-mul ~1.8
us a layer past what their bytes take: the down GEMV cannot start its sums before every gate/up program
has ended.

Here each program owns C channels of the intermediate: it streams their C gate and C up rows against
the activation codes (tensor cores, the x tile padded to 16 rows as `qwick.kernels.gemv` does), forms
h = silu(gate) * up for its C channels in registers, then streams the down weight's C columns of those
channels and adds its share of every output with fp32 atomics. No program waits for another, so the MLP
streams as one launch with one tail. The down weight is read either as it is ([H, I], C-byte pieces of
each row: DOWN_T=0) or from a transposed copy ([I, H], C whole rows: DOWN_T=1, which would cost a second
copy of down's codes in the engine). `H_CODES`: h quantized per program (one scale per C channels, finer
than the engine's 512) and multiplied code by code, else h in bf16 against the codes converted to bf16.
ATOMIC=0 stores each program's partial row instead (not summed: a bound on what the atomics cost).

Each variant is checked against float64 sums of the same codes, then timed in CUDA graphs: `LAYERS`
copies of the norm and the MLP (each copy's weights ~203 MB, past the L2), us per MLP, the norm included
on both sides.

    python benchmarks/fused_mlp_w8.py out.json   # env MODES (fp8 int8), CS (32 64), LAYERS (4), LAUNCHES
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from qwick.bench.gpu_timing import graph_us  # noqa: E402
from qwick.kernels.codes import codes_of  # noqa: E402
from qwick.kernels.elementwise import rms_norm, silu_and_mul_quant  # noqa: E402
from qwick.kernels.gemv import GemvWorkspace, gemv  # noqa: E402
from qwick.kernels.pdl import pdl_trigger, pdl_wait  # noqa: E402
from qwick.kernels.swiglu import silu_times  # noqa: E402
from qwick.layers.linear import RowQuant  # noqa: E402
from qwick.quantization.w8a8 import _MIN_AMAX, _QMAX, FP8_DTYPE, quantize_weight_per_channel  # noqa: E402

HIDDEN, INTER = 3584, 18944
MODES = os.environ.get("MODES", "fp8 int8").split()
CS = [int(c) for c in os.environ.get("CS", "32 64").split()]
LAYERS = int(os.environ.get("LAYERS", "4"))
# (BLOCK_H, warps, stages) of each variant; env LAUNCHES "256,4,3 256,8,3"
_LAUNCHES = os.environ.get("LAUNCHES", "256,4,3 256,8,3")
LAUNCHES = [tuple(int(v) for v in t.split(",")) for t in _LAUNCHES.split()]
OFFLINE = bool(os.environ.get("OFFLINE"))


@triton.jit
def _fused_mlp_kernel(
    xq_ptr,
    xs_ptr,
    wgu_ptr,
    sgu_ptr,
    wd_ptr,
    sd_ptr,
    out_ptr,
    K,
    N_INTER,
    H,
    stride_gu,
    stride_d,
    QMAX: tl.constexpr,
    C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DOWN_T: tl.constexpr,
    INT_DOT: tl.constexpr,
    H_CODES: tl.constexpr,
    ATOMIC: tl.constexpr,
    PRELOAD: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    pid = tl.program_id(0)
    c0 = pid * C
    r = tl.arange(0, 2 * C)
    row = (r // C) * N_INTER + c0 + r % C  # C gate rows, then the up rows of the same channels
    rm = tl.arange(0, 16)
    m_ok = rm < 1
    rk = tl.arange(0, BLOCK_K)
    w_rows = wgu_ptr + row.to(tl.int64)[:, None] * stride_gu
    x_rows = xq_ptr + rm[:, None] * 0
    acc = tl.zeros((16, 2 * C), dtype=tl.int32 if INT_DOT else tl.float32)
    k0 = 0
    if PRELOAD:
        w = tl.load(w_rows + rk[None, :])
        pdl_wait()
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, out_dtype=acc.dtype)
        k0 = BLOCK_K
    for k in range(k0, K, BLOCK_K):
        w = tl.load(w_rows + (k + rk)[None, :])
        x = tl.load(x_rows + (k + rk)[None, :], mask=m_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, out_dtype=acc.dtype)
    y = tl.sum(acc.to(tl.float32), axis=0) * tl.load(sgu_ptr + row) * tl.load(xs_ptr)
    gate, up = tl.split(tl.permute(tl.reshape(y.to(tl.bfloat16), (2, C)), (1, 0)))
    h = silu_times(gate, up).to(tl.float32)  # [C]
    if H_CODES:
        hs = tl.maximum(tl.max(tl.abs(h), axis=0), 1e-10) / QMAX
        hq = codes_of(h, hs, QMAX, INT_DOT)
        h16 = tl.where(m_ok[:, None], hq[None, :], 0.0).to(wd_ptr.dtype.element_ty)
    else:
        h16 = tl.where(m_ok[:, None], h[None, :], 0.0).to(tl.bfloat16)
    cc = c0 + tl.arange(0, C)
    rh = tl.arange(0, BLOCK_H)
    for j in range(0, H, BLOCK_H):
        if DOWN_T:
            t = tl.load(wd_ptr + cc.to(tl.int64)[:, None] * stride_d + (j + rh)[None, :])  # [C, BLOCK_H]
        else:
            t = tl.trans(tl.load(wd_ptr + (j + rh).to(tl.int64)[:, None] * stride_d + cc[None, :]))
        if H_CODES:
            d = tl.dot(h16, t, out_dtype=tl.int32 if INT_DOT else tl.float32).to(tl.float32)
        else:
            d = tl.dot(h16, t.to(tl.bfloat16), tl.zeros((16, BLOCK_H), tl.float32))
        part = tl.sum(d, axis=0) * tl.load(sd_ptr + j + rh)
        if H_CODES:
            part *= hs
        if ATOMIC:
            tl.atomic_add(out_ptr + j + rh, part, sem="relaxed")
        else:
            tl.store(out_ptr + pid * H + j + rh, part)
    if TRIGGER:
        pdl_trigger()


def fused_mlp(xq, xs, wgu, sgu, wd, sd, out, c, block_k, block_h, down_t, h_codes, atomic, warps, stages):
    """One launch of the fused MLP for x codes [1, K] (scale xs [1, 1]) into out (fp32 [H], zeroed; or
    [P, H] with atomic=False)."""
    k = xq.shape[1]
    inter = wgu.shape[0] // 2
    hidden = sd.numel()
    pdl = xq.device.type == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    _fused_mlp_kernel[(inter // c,)](
        xq, xs, wgu, sgu, wd, sd, out, k, inter, hidden, wgu.stride(0), wd.stride(0),
        QMAX=_QMAX[wgu.dtype], C=c, BLOCK_K=block_k, BLOCK_H=block_h, DOWN_T=down_t,
        INT_DOT=wgu.dtype == torch.int8, H_CODES=h_codes, ATOMIC=atomic, PRELOAD=pdl, TRIGGER=pdl,
        num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip


def make_layer(qdtype: torch.dtype, dev: torch.device, seed: int) -> dict:
    g = torch.Generator(device=dev).manual_seed(seed)
    wgu = torch.randn(2 * INTER, HIDDEN, device=dev, generator=g) / HIDDEN**0.5
    wd = torch.randn(HIDDEN, INTER, device=dev, generator=g) / INTER**0.5
    qgu, sgu = quantize_weight_per_channel(wgu, qdtype)
    qd, sd = quantize_weight_per_channel(wd, qdtype)
    return {"wgu": qgu, "sgu": sgu.reshape(-1), "wd": qd, "wdT": qd.t().contiguous(), "sd": sd.reshape(-1)}


def reference(layer: dict, xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """float64: gate/up of the codes, silu(gate) * up, then down (h unquantized)."""
    y = (xq.double() @ layer["wgu"].double().t()) * xs.double() * layer["sgu"].double()
    gate, up = y[0, :INTER], y[0, INTER:]
    h = torch.nn.functional.silu(gate) * up
    return (layer["wd"].double() @ h) * layer["sd"].double()


def variants() -> list[dict]:
    """Every combination of the env lists: CS, DOWN_TS (0 1), H_CODES (1 0), BLOCK_KS (256), LAUNCHES."""
    down_ts = [int(v) for v in os.environ.get("DOWN_TS", "1 0").split()]
    h_codes = [int(v) for v in os.environ.get("H_CODES", "1 0").split()]
    block_ks = [int(v) for v in os.environ.get("BLOCK_KS", "256").split()]
    out = []
    for c, down_t, hc, bk, (block_h, warps, stages) in itertools.product(
        CS, down_ts, h_codes, block_ks, LAUNCHES
    ):
        out.append(dict(c=c, block_k=bk, block_h=block_h, down_t=down_t, h_codes=hc, atomic=1, warps=warps,
                        stages=stages))  # fmt: skip
    return out


def run_mode(mode: str, ws: GemvWorkspace) -> list[dict]:
    """The engine's three launches, then every variant, for one weight type (us per MLP)."""
    dev = ws.partials.device
    qdtype = FP8_DTYPE if mode == "fp8" else torch.int8
    layers = [make_layer(qdtype, dev, s) for s in range(LAYERS)]
    x = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    res = torch.zeros_like(x)
    norm_w = torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)
    quant = RowQuant(qdtype, _QMAX[qdtype], _MIN_AMAX)
    hquant = RowQuant(qdtype, _QMAX[qdtype], _MIN_AMAX, 512)
    acc = torch.zeros(HIDDEN, device=dev, dtype=torch.float32)
    parts = torch.zeros(INTER // min(CS), HIDDEN, device=dev, dtype=torch.float32)

    def baseline():
        for lay in layers:
            q = rms_norm(x, norm_w, 1e-6, residual=res, quant=quant, early=True)
            y = gemv(q.codes, lay["wgu"], None, ws, weight_scale=lay["sgu"], x_scale=q.scales,
                     out_dtype=torch.bfloat16, preload=True, trigger=True)  # fmt: skip
            a = silu_and_mul_quant(y, hquant)
            gemv(a.codes, lay["wd"], None, ws, weight_scale=lay["sd"], x_scale=a.scales,
                 out_dtype=torch.bfloat16, x_group=512, preload=True, trigger=True)  # fmt: skip

    def candidate(v: dict):
        for lay in layers:
            q = rms_norm(x, norm_w, 1e-6, residual=res, quant=quant, early=True)
            dst = acc if v["atomic"] else parts
            wd = lay["wdT"] if v["down_t"] else lay["wd"]
            fused_mlp(q.codes, q.scales, lay["wgu"], lay["sgu"], wd, lay["sd"], dst, **v)

    q0 = rms_norm(x, norm_w, 1e-6, quant=quant)
    ref = reference(layers[0], q0.codes, q0.scales)
    lay = layers[0]
    y = gemv(
        q0.codes, lay["wgu"], None, ws, weight_scale=lay["sgu"], x_scale=q0.scales, out_dtype=torch.bfloat16
    )
    a = silu_and_mul_quant(y, hquant)
    y = gemv(a.codes, lay["wd"], None, ws, weight_scale=lay["sd"], x_scale=a.scales, out_dtype=torch.bfloat16,
             x_group=512)  # fmt: skip
    base_err = ((y[0].double() - ref).norm() / ref.norm()).item()
    base_us = graph_us(baseline, calls=2, replays=10) / LAYERS
    rows = [
        {"variant": "engine: gate/up GEMV, SiLU-and-mul codes, down GEMV", "us": base_us, "rel_err": base_err}
    ]
    print(f"{mode}: engine's three launches {base_us:.2f} us per MLP (norm included), rel err {base_err:.2e}")
    for v in variants():
        lay = layers[0]
        try:
            acc.zero_()
            wd = lay["wdT"] if v["down_t"] else lay["wd"]
            fused_mlp(q0.codes, q0.scales, lay["wgu"], lay["sgu"], wd, lay["sd"], acc, **v)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a launch the GPU refuses is a result too
            print(f"  {v}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        err = ((acc.double() - ref).norm() / ref.norm()).item()
        us = graph_us(lambda v=v: candidate(v), calls=2, replays=10) / LAYERS
        rows.append({**v, "us": us, "rel_err": err})
        print(f"  {v}: {us:.2f} us ({us - base_us:+.2f}), rel err {err:.2e}", flush=True)
        if os.environ.get("NO_ATOMIC_TOO"):  # the atomics' share
            nv = {**v, "atomic": 0}
            us0 = graph_us(lambda nv=nv: candidate(nv), calls=2, replays=10) / LAYERS
            rows.append({**nv, "us": us0})
            print(f"  same, partial rows stored, no atomics: {us0:.2f} us", flush=True)
    return rows


def main() -> None:
    ws = GemvWorkspace(torch.device("cuda"), max_elems=1 << 24)
    results = {}
    for mode in MODES:
        results[mode] = run_mode(mode, ws)
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


def offline() -> None:
    """No GPU: compile the variants for sm_90 (Triton's ptxas) and print registers, shared memory and the
    PTX's global atomics and async copies."""
    from benchmarks.ptx_counts import compile_ptx, registers

    ptrs = ("xq_ptr", "xs_ptr", "wgu_ptr", "sgu_ptr", "wd_ptr", "sd_ptr", "out_ptr")
    ints = ("K", "N_INTER", "H", "stride_gu", "stride_d")
    c, warps, stages = int(os.environ.get("C", "32")), int(os.environ.get("WARPS", "4")), 3
    for qdt, down_t, h_codes in itertools.product(("fp8e4nv", "i8"), (1, 0), (1, 0)):
        sig = {n: (f"*{qdt}" if n in ("xq_ptr", "wgu_ptr", "wd_ptr") else "*fp32") for n in ptrs}
        sig.update({n: "i32" for n in ints})
        const = dict(QMAX=448.0 if qdt == "fp8e4nv" else 127.0, C=c, BLOCK_K=256, BLOCK_H=256)
        const |= dict(DOWN_T=down_t, INT_DOT=qdt == "i8", H_CODES=h_codes, ATOMIC=1, PRELOAD=1, TRIGGER=1)
        k = compile_ptx(_fused_mlp_kernel, sig, const, [*ptrs, *ints], warps, stages)
        ptx = k.asm["ptx"].splitlines()
        picked = [ln.split() for ln in ptx if "atom." in ln or "red.global" in ln or "cp.async" in ln]
        ops = sorted({[w for w in words if not w.startswith("@")][0] for words in picked})
        print(f"{qdt} down_t={down_t} h_codes={h_codes}: {registers(k)} registers, "
              f"{k.metadata.shared} B shared, {ops}")  # fmt: skip


if __name__ == "__main__":
    offline() if OFFLINE else main()
