"""What limits the batch-1 GEMVs on 8-bit and 4-bit codes: one launch of each, under Nsight Compute.

Launches, at M = 1 and the qwen2.5-7b gate/up and down shapes, the skinny GEMM on bf16 weights (the good
case, ~3.9 TB/s), on fp8 and int8 codes (W8A16, ~2.6 TB/s; and W8A8 as batch-1 decode runs it, down with
one activation scale per 512 columns), the int4 fp32 row GEMV (~1.4 TB/s) and the f16x2 one decode runs
(`row_gemv_half2`, ungated), plus cuBLAS on the bf16 layer and a plain copy; only the launches between
`profiler.start()` and `stop()` are profiled.
Run under ncu on the GPU machine (Firecracker kinds read the counters; leave the clocks alone):

    ncu --clock-control none --profile-from-start off --set full python benchmarks/gemv_ncu.py OUTDIR

OUTDIR also gets the compiled Triton kernels (TTGIR, PTX, cubin) to read the load widths and layouts.
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
from qwick.kernels import gemv as gemv_mod  # noqa: E402
from qwick.kernels import row_gemv as row_mod  # noqa: E402
from qwick.kernels.gemv import GemvWorkspace, gemv  # noqa: E402
from qwick.kernels.row_gemv import w4_row_gemv  # noqa: E402
from qwick.kernels.row_gemv_half2 import _w4_half2_kernel, half_pairs, w4_half2_gemv  # noqa: E402
from qwick.quantization.formats import rtn  # noqa: E402
from qwick.quantization.w8a8 import W8A8LinearMethod as W8A8  # noqa: E402
from qwick.quantization.w8a8 import (  # noqa: E402
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_per_channel,
)

SHAPES = {"gate_up": (37888, 3584), "down": (3584, 18944)}
OUT = sys.argv[1] if len(sys.argv) > 1 else "gemv_ncu_out"


def launches() -> list[tuple[str, object]]:
    """(label, zero-argument launch) for every kernel to profile, inputs made and checked beforehand."""
    dev = torch.device("cuda")
    ws = GemvWorkspace(dev, max_elems=1 << 24)
    out = []
    src = torch.empty(1 << 28, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    out.append(("copy 256MiB", lambda: dst.copy_(src)))
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = x.double() @ w.double().T
        out.append((f"{name} cublas bf16", lambda w=w, x=x: F.linear(x, w)))
        out.append((f"{name} gemv bf16", lambda w=w, x=x: gemv(x, w, None, ws)))
        for qdtype in (torch.float8_e4m3fn, torch.int8):
            codes, scale = quantize_weight_per_channel(w, qdtype)
            scale = scale.reshape(-1).contiguous()
            label = f"{name} gemv {str(qdtype).split('.')[-1]}"
            out.append((label, lambda x=x, c=codes, s=scale: gemv(x, c, None, ws, weight_scale=s)))
            # W8A8 as batch-1 decode runs it: activation codes, one scale a row (K <= 8192) or a group
            group = None if k <= W8A8.decode_w8a8_max_k else W8A8.decode_group
            if group is None:
                xq, xs = quantize_per_token(x, qdtype)
            else:
                xq, xs = quantize_per_token_group(x, qdtype, group)
            kw = dict(weight_scale=scale, x_scale=xs, out_dtype=x.dtype, x_group=group)
            out.append((f"{label} W8A8", lambda q=xq, c=codes, kw=kw: gemv(q, c, None, ws, **kw)))
        qw = rtn.quantize(w, bits=4, group_size=128)
        out.append((f"{name} row_gemv int4", lambda x=x, q=qw: w4_row_gemv(x, q, None, ws)))
        # the f16x2 kernel batch-1 decode runs (its default launch, x's pairs as the producer writes them;
        # decode's gate/up is its gated variant, SiLU-and-mul in the epilogue)
        p = half_pairs(x)
        out.append((f"{name} half2 int4", lambda x=x, q=qw, p=p: w4_half2_gemv(x, q, None, ws, pairs=p)))
        for label, fn in out[-8:]:
            err = ((fn().double() - ref).norm() / ref.norm()).item()
            print(f"{label}: rel err {err:.2e}", flush=True)
    return out


def dump_kernels() -> None:
    """The compiled variants of our GEMV kernels: TTGIR, PTX and cubin, one file each."""
    os.makedirs(OUT, exist_ok=True)
    for fn in (gemv_mod._gemv_kernel, row_mod._w4_row_kernel, _w4_half2_kernel):
        for i, cache in enumerate(fn.device_caches.values()):
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for j, kernel in enumerate(kernels.values()):
                stem = f"{OUT}/{fn.__name__}_{i}_{j}"
                for ext in ("ttgir", "ptx"):
                    with open(f"{stem}.{ext}", "w") as f:
                        f.write(kernel.asm[ext])
                with open(f"{stem}.cubin", "wb") as f:
                    f.write(kernel.asm["cubin"])
                print(
                    f"dumped {stem}: {kernel.metadata.num_warps} warps, {kernel.n_regs} regs, "
                    f"{kernel.metadata.shared} B smem",
                    flush=True,
                )


def main() -> None:
    runs = launches()
    for _, fn in runs:  # compile and warm up outside the profiled region
        fn()
    torch.cuda.synchronize()
    dump_kernels()
    torch.cuda.profiler.start()
    for label, fn in runs:
        torch.cuda.nvtx.range_push(label)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(label for label, _ in runs))


if __name__ == "__main__":
    main()
