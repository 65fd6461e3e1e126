"""Does the int4 batch-1 GEMV stream faster when each [64 rows x 16 words] tile is contiguous in memory?

`qwick.kernels.row_gemv` reads a row-major [N, K/8] int32 weight: every tile reads 64 B from each of 64
rows, 1.8 KB apart at the 7b gate/up shape, and streams ~1.9 TB/s, where the bf16 GEMV (512 B per row per
tile) reaches 4.1. This script runs one minimal kernel (the row GEMV's decoding, split 1, no bias) on the
same codes in both layouts: row-major, and tiled ([N/64, K/128, 64, 16], each tile 4 KB contiguous).
CUDA-graph replays over weight copies that overflow the L2; us per call and TB/s of int4 bytes.
"""

import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from qwick.kernels.row_gemv import (  # noqa: E402
    FLOAT_2_23_BITS,
    _x_of_words,
    decode_tile_dot,
    group_scale_and_zero,
)
from qwick.quantization.formats import rtn  # noqa: E402
from qwick.quantization.formats.layout import dequantize  # noqa: E402

SHAPES = {"gate_up": (37888, 3584), "down": (3584, 18944), "qkv": (4608, 3584)}
L2_OVERFLOW = 200 << 20


@triton.jit
def _kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, KW, stride_sn, exponent, TILED: tl.constexpr,
            LOOP_STAGES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    r = tl.arange(0, BLOCK_N)
    rn = pid * BLOCK_N + r
    rj = tl.arange(0, BLOCK_W)
    groups = KW // BLOCK_W
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    for g in tl.range(0, groups, num_stages=LOOP_STAGES):
        if TILED:
            tile = qw_ptr + (pid * groups + g).to(tl.int64) * (BLOCK_N * BLOCK_W)
            words = tl.load(tile + r[:, None] * BLOCK_W + rj[None, :])
        else:
            words = tl.load(qw_ptr + rn.to(tl.int64)[:, None] * KW + g * BLOCK_W + rj[None, :])
        s, z = group_scale_and_zero(
            s_ptr + rn * stride_sn, z_ptr + rn * stride_sn, g, rn >= 0, 0, 1
        )  # 1: ZERO_TENSOR (a zero point per row and group)
        part = decode_tile_dot(words, _x_of_words(x_ptr, g * BLOCK_W + rj), z, exponent)
        acc += s[:, None] * part
    tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


def tiled(qweight: torch.Tensor, block_n: int) -> torch.Tensor:
    """[N, K/8] -> [N/block_n, K/128, block_n, 16]: every tile contiguous."""
    n, kw = qweight.shape
    return qweight.view(n // block_n, block_n, kw // 16, 16).permute(0, 2, 1, 3).contiguous()


def gemv(x, qweight, qw, layout_tiled: bool, block_n: int, stages: int, warps: int) -> torch.Tensor:
    n, kw = qw.qweight.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _kernel[(n // block_n,)](
        x, qweight, qw.scales, qw.zeros, y, kw, qw.scales.stride(0), FLOAT_2_23_BITS, TILED=layout_tiled,
        LOOP_STAGES=stages, BLOCK_N=block_n, BLOCK_W=16, num_warps=warps,
    )  # fmt: skip
    return y


def main() -> None:
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        qw = rtn.quantize(w, group_size=128)
        ref = x.double() @ dequantize(qw).double().T
        copies = -(-L2_OVERFLOW // qw.nbytes)
        for block_n, stages, warps in itertools.product((32, 64, 128), (1, 3), (4, 8)):
            for layout_tiled in (False, True):
                codes = [
                    tiled(qw.qweight, block_n) if layout_tiled else qw.qweight.clone() for _ in range(copies)
                ]
                y = gemv(x, codes[0], qw, layout_tiled, block_n, stages, warps)
                err = ((y.double() - ref).norm() / ref.norm()).item()

                def calls(codes=codes, x=x, qw=qw, t=layout_tiled, c=(block_n, stages, warps)):
                    for q in codes:
                        gemv(x, q, qw, t, *c)

                us = triton.testing.do_bench_cudagraph(calls, rep=30, return_mode="median") * 1e3 / copies
                print(
                    f"{name:8s} bn{block_n:<3d} ls{stages} w{warps} {'tiled' if layout_tiled else 'rows '}"
                    f" {us:6.1f} us {qw.nbytes / us / 1e6:5.2f} TB/s err {err:.1e}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
