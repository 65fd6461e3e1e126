"""Where the one-row RMSNorm with activation codes spends its time: the engine's kernel at 2.8-3.0 us
against 1.42-1.45 for the plain norm (3584 columns, in a CUDA graph), and grouped codes, which drop the
second block-wide reduction, were no faster (56th session). Each variant below removes or replaces one
part of the codes path, so the differences say which part costs:

- `copy`: the engine's path re-written here (must time as the library's kernel does);
- `division`: the same with `codes_by_division`;
- `mul`: codes by multiplying with 1 / scale instead of IEEE division (not the reference's bits);
- `nomax`: the scale a constant, no second reduction (wrong codes; the reduction's cost);
- `onepass`: both sums in one tuple reduction, the scale rstd * max|w * x| / qmax (not the reference's
  bits), codes by multiplication;
- `noout`: the codes path without the bf16 output's store;
- `nocodes`: the output, no codes (the plain norm in this kernel, to compare with the library's).

Run first in the 57th session, when `codes_of` still divided per element (`codes_by_division` below,
which `use_division` puts back into the kernel modules: the old arm of an end-to-end A/B, and a row of
this table). A prototype for measuring, not an engine path. On the GPU machine:

    python benchmarks/norm_codes_ablation.py
"""

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from qwick.bench import gpu_timing  # noqa: E402
from qwick.kernels.codes import _ROUNDER, codes_of, inv_qmax  # noqa: E402
from qwick.kernels.elementwise import rms_norm  # noqa: E402
from qwick.layers.linear import RowQuant  # noqa: E402
from qwick.quantization.w8a8 import _MIN_AMAX, qmax  # noqa: E402

HIDDEN = 3584
MODES = ("copy", "division", "mul", "nomax", "onepass", "noout", "nocodes")


@triton.jit
def codes_by_division(x, scale, QMAX: tl.constexpr, IS_INT: tl.constexpr):
    """`codes_of` until the 57th session: IEEE division per element (the same codes)."""
    q = tl.math.div_rn(x, scale)
    if IS_INT:
        q = (q + _ROUNDER) - _ROUNDER
    return tl.minimum(tl.maximum(q, -QMAX), QMAX)


def use_division() -> None:
    """Every kernel that writes activation codes back on `codes_by_division`: call before any compiles."""
    import qwick.kernels.elementwise
    import qwick.kernels.gemv
    import qwick.kernels.w8a8

    for module in (qwick.kernels.elementwise, qwick.kernels.gemv, qwick.kernels.w8a8):
        module.codes_of = codes_by_division


@triton.jit
def _max_and_sum(a_max, a_sum, b_max, b_sum):
    return tl.maximum(a_max, b_max), a_sum + b_sum


@triton.jit
def _norm_codes(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    q_ptr,
    s_ptr,
    N,
    eps,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + cols, mask=mask, other=0.0)
    r = tl.load(res_ptr + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(res_ptr + cols, x, mask=mask)
    xf = x.to(tl.float32)
    if MODE == "onepass":
        wx_max, sq = tl.reduce((tl.abs(w * xf), xf * xf), 0, _max_and_sum)
        rstd = tl.rsqrt(sq / N + eps)
    else:
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    y = (w * normed).to(out_ptr.dtype.element_ty)
    if MODE != "noout":
        tl.store(out_ptr + cols, y, mask=mask)
    if MODE != "nocodes":
        yf = y.to(tl.float32)
        if MODE == "nomax":
            scale = 0.01 + 0.0 * rstd
        elif MODE == "onepass":
            scale = tl.maximum(wx_max * rstd, MIN_AMAX) * INV_QMAX
        else:
            scale = tl.maximum(tl.max(tl.abs(yf), axis=0), MIN_AMAX) * INV_QMAX
        tl.store(s_ptr, scale)
        if MODE == "division":
            q = codes_by_division(yf, scale, QMAX, True)
        elif MODE == "mul" or MODE == "onepass":
            q = yf * (1.0 / scale)
            q = (q + _ROUNDER) - _ROUNDER
            q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
        else:
            q = codes_of(yf, scale, QMAX, True)
        tl.store(q_ptr + cols, q.to(tl.int8), mask=mask)


def main() -> None:
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    q = torch.empty(1, HIDDEN, device="cuda", dtype=torch.int8)
    s = torch.empty(1, 1, device="cuda", dtype=torch.float32)
    quant = RowQuant(torch.int8, qmax(torch.int8), _MIN_AMAX)
    block = triton.next_power_of_2(HIDDEN)

    def ours(mode: str, warps: int):
        return lambda: _norm_codes[(1,)](
            x, res, w, out, q, s, HIDDEN, 1e-6, QMAX=quant.qmax, INV_QMAX=inv_qmax(quant.qmax),
            MIN_AMAX=quant.min_amax, MODE=mode, BLOCK=block, num_warps=warps,
        )  # fmt: skip

    # `copy` must give the library's bits (the check that it is the same computation)
    lib = rms_norm(x, w, 1e-6, res.clone(), quant, num_warps=32)
    res_before = res.clone()
    ours("copy", 32)()
    res.copy_(res_before)
    assert torch.equal(q, lib.codes) and torch.equal(s, lib.scales), "copy differs from the library's kernel"
    print(f"{'variant (1 row, 3584 columns, int8 codes)':44s} {'us':>6}")
    plain = gpu_timing.graph_us(lambda: rms_norm(x, w, 1e-6, res), 200, 10)
    print(f"{'library plain norm (8 warps)':44s} {plain:6.2f}")
    for warps in (32, 16, 8):
        us = gpu_timing.graph_us(lambda nw=warps: rms_norm(x, w, 1e-6, res, quant, num_warps=nw), 200, 10)
        print(f"{f'library with codes, {warps} warps':44s} {us:6.2f}")
        for mode in MODES:
            us = gpu_timing.graph_us(ours(mode, warps), 200, 10)
            print(f"{f'{mode}, {warps} warps':44s} {us:6.2f}")


if __name__ == "__main__":
    main()
