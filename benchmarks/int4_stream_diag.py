"""What holds the batch-1 int4 GEMV near 1.9 TB/s? One kernel with the row GEMV's tiling (64 rows x one
group of 16 int32 words per iteration, split 1, 4 warps, qwen2.5-7b gate/up), built up stage by stage:

    load      the code tiles only (XORed together so the loads stay); also at 32 and 128-row tiles
    +scales   and each group's scale and zero point per row
    +x        and the eight activations of every word (`_x_of_words`), summed
    full      the row GEMV's decoding and products (`decode_tile_dot`), as `qwick.kernels.row_gemv`
    wide      `load` with 32-word tiles (128 B of each row per iteration instead of 64 B)

beside a device copy of the same bytes. If `load` alone stays near 2 TB/s, the tiling (not the arithmetic)
is the limit; if it streams near the copy, the stage that loses the most is. CUDA-graph replays over weight
copies that overflow the L2; us per call and TB/s of code bytes. argv[1]: JSON out.
"""

import itertools
import json
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

N, K = 37888, 3584  # qwen2.5-7b gate/up
L2_OVERFLOW = 200 << 20
STAGES = ("load", "+scales", "+x", "full")


@triton.jit
def _stream_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, KW, stride_sn, exponent, STAGE: tl.constexpr,
                   LOOP_STAGES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
    """STAGE 0 load, 1 +scales, 2 +x, 3 full (see the module docstring); one row per output."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, BLOCK_W)
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    bits = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.int32)
    for j in tl.range(0, KW, BLOCK_W, num_stages=LOOP_STAGES):
        words = tl.load(qw_ptr + rn.to(tl.int64)[:, None] * KW + j + rj[None, :])
        if STAGE == 0:
            bits ^= words
        else:
            g = j // 16  # the scale of the tile's first group (wide tiles hold several)
            s, z = group_scale_and_zero(
                s_ptr + rn * stride_sn, z_ptr + rn * stride_sn, g, rn >= 0, 0, 1
            )  # 1: ZERO_TENSOR (a zero point per row and group)
            if STAGE == 1:
                bits ^= words
                acc += (s + z)[:, None]
            elif STAGE == 2:
                x0, x1, x2, x3, x4, x5, x6, x7 = _x_of_words(x_ptr, j + rj)
                xsum = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7
                bits ^= words
                acc += (s + z)[:, None] * xsum[None, :]
            else:
                acc += s[:, None] * decode_tile_dot(words, _x_of_words(x_ptr, j + rj), z, exponent)
    out = tl.sum(acc + bits.to(tl.float32), axis=1)
    tl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty))


def run(x, qw, codes, stage: int, block_w: int, loop_stages: int, block_n: int = 64, warps: int = 4):
    kw = qw.qweight.shape[1]
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    _stream_kernel[(N // block_n,)](
        x, codes, qw.scales, qw.zeros, y, kw, qw.scales.stride(0), FLOAT_2_23_BITS, STAGE=stage,
        LOOP_STAGES=loop_stages, BLOCK_N=block_n, BLOCK_W=block_w, num_warps=warps,
    )  # fmt: skip
    return y


def graph_us(calls, n: int) -> float:
    calls()  # compile outside the capture
    if not torch.cuda.is_available():
        return float("nan")
    return triton.testing.do_bench_cudagraph(calls, rep=30, return_mode="median") * 1e3 / n


def main() -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n_rows, k = (N, K) if dev.type == "cuda" else (128, 512)  # the interpreter: a smoke test
    globals()["N"] = n_rows
    w = torch.randn(n_rows, k, device=dev, dtype=torch.bfloat16) / k**0.5
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    qw = rtn.quantize(w, group_size=128)
    nbytes = qw.qweight.numel() * 4
    copies = [qw.qweight.clone() for _ in range(-(-L2_OVERFLOW // nbytes) if dev.type == "cuda" else 1)]
    ref = x.double() @ dequantize(qw).double().T
    full = run(x, qw, copies[0], STAGES.index("full"), 16, 1).double()
    err = ((full - ref).norm() / ref.norm()).item()
    assert err < 5e-3, f"the full stage does not compute the GEMV: relative error {err:.3g}"
    rows = []
    dst = [torch.empty_like(c) for c in copies]

    def copy_all() -> None:
        for a, b in zip(copies, dst):
            b.copy_(a)

    t = graph_us(copy_all, len(copies))
    rows.append({"variant": "device copy (read + write)", "us": t, "read_tb_s": nbytes / t / 1e6})
    # (label, stage, words per row per tile, rows per tile, warps)
    cases = [(name, i, 16, 64, 4) for i, name in enumerate(STAGES)]
    cases += [("wide (load, 32 words)", 0, 32, 64, 4), ("load, 128 rows", 0, 16, 128, 4)]
    cases += [("load, 128 rows, 8 warps", 0, 16, 128, 8), ("load, 32 rows", 0, 16, 32, 4)]
    for (name, *shape), loop_stages in itertools.product(cases, (1, 3)):

        def calls(shape=shape, loop_stages=loop_stages) -> None:
            stage, block_w, block_n, warps = shape
            for c in copies:
                run(x, qw, c, stage, block_w, loop_stages, block_n, warps)

        t = graph_us(calls, len(copies))
        rows.append({"variant": f"{name}, loop stages {loop_stages}", "us": t, "read_tb_s": nbytes / t / 1e6})
    for r in rows:
        print(f"{r['variant']:34s} {r['us']:7.1f} us {r['read_tb_s']:5.2f} TB/s", flush=True)
    with open(sys.argv[1] if len(sys.argv) > 1 else "int4_stream_diag.json", "w") as f:
        json.dump({"n": n_rows, "k": k, "code_bytes": nbytes, "full_rel_err": err, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
