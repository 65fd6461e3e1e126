"""What holds the batch-1 int4 GEMV near 1.9 TB/s? One kernel with the row GEMV's tiling (64 rows x one
group of 16 int32 words per iteration, split 1, 4 warps, qwen2.5-7b gate/up), built up stage by stage:

    load      the code tiles only (XORed together so the loads stay);
    +scales   and each group's scale and zero point per row
    +x        and the eight activations of every word (`_x_of_words`), summed
    full      the row GEMV's decoding and products (`decode_tile_dot`), as `qwick.kernels.row_gemv`
    wide      `load` with 32-word tiles (128 B of each row per iteration instead of 64 B)

and `load` and `full` with each tile brought in by the copy engine (TMA, a host tensor descriptor),
software-pipelined 2-6 tiles deep: the bytes in flight then cost shared memory, not registers.

beside a device copy of the same bytes. If `load` alone stays near 2 TB/s, the tiling (not the arithmetic)
is the limit; if it streams near the copy, the stage that loses the most is. CUDA-graph replays over weight
copies that overflow the L2; us per call and TB/s of code bytes. argv[1]: JSON out. With NCU="variant;...",
one launch of each named variant (as printed) between profiler start and stop instead, for Nsight Compute:

    NCU="full, loop stages 1;load, loop stages 1" ncu --clock-control none --profile-from-start off \
        --section WarpStateStats --section SchedulerStats python benchmarks/int4_stream_diag.py
"""

import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.getcwd())
from qwick.kernels.half2 import split4  # noqa: E402
from qwick.kernels.row_gemv import (  # noqa: E402
    FLOAT_2_23_BITS,
    _x_of_words,
    decode_tile_dot,
    group_scale_and_zero,
)
from qwick.kernels.row_gemv_half2 import DOT4_ASM, X_DIV, half_pairs  # noqa: E402
from qwick.quantization.formats import rtn  # noqa: E402
from qwick.quantization.formats.layout import dequantize  # noqa: E402

N, K = 37888, 3584  # qwen2.5-7b gate/up
L2_OVERFLOW = 200 << 20
STAGES = ("load", "+scales", "+x", "full", "full f16x2")
_PAIRS: dict = {}  # x -> its half2_pairs, made once (their small torch kernels are not the GEMV's time)
_X_DIV = tl.constexpr(X_DIV)


def half2_pairs(x: torch.Tensor) -> torch.Tensor:
    """x [1, K] -> int32 [K / 8, 4]: per word, the fp16 pairs (x[8w + p], x[8w + p + 4]) / X_DIV."""
    return half_pairs(x).view(-1, 4)


@triton.jit
def _half2_tile_dot(words, xp_ptr, j, z, ASM: tl.constexpr):
    """[BLOCK_N, BLOCK_W / 4] sums of 32 products (q - z) * x / X_DIV: four words of a row per element."""
    BLOCK_N: tl.constexpr = words.shape[0]
    C: tl.constexpr = words.shape[1] // 4
    r4 = tl.arange(0, 4)
    cols = j + tl.arange(0, C)[:, None] * 4 + r4[None, :]  # [C, 4]: words 4c .. 4c + 3
    xs = tl.load(xp_ptr + cols[:, :, None] * 4 + r4[None, None, :])  # [C, word, shift]
    pa, pb, pc, pd = split4(xs.reshape(C, 4, 2, 2))  # [C, word] per shift
    xa0, xa1, xa2, xa3 = split4(pa.reshape(C, 2, 2))
    xb0, xb1, xb2, xb3 = split4(pb.reshape(C, 2, 2))
    xc0, xc1, xc2, xc3 = split4(pc.reshape(C, 2, 2))
    xd0, xd1, xd2, xd3 = split4(pd.reshape(C, 2, 2))
    w0, w1, w2, w3 = split4(words.reshape(BLOCK_N, C, 2, 2))
    zh = (z + 1024.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    nz = (-(z + 64.0)).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return tl.inline_asm_elementwise(
        ASM,
        "=r" + ",r" * 22,
        [w0, w1, w2, w3,
         xa0[None, :], xb0[None, :], xc0[None, :], xd0[None, :],
         xa1[None, :], xb1[None, :], xc1[None, :], xd1[None, :],
         xa2[None, :], xb2[None, :], xc2[None, :], xd2[None, :],
         xa3[None, :], xb3[None, :], xc3[None, :], xd3[None, :],
         (zh | (zh << 16))[:, None], (nz | (nz << 16))[:, None]],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )  # fmt: skip


@triton.jit
def _stream_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, KW, stride_sn, exponent, STAGE: tl.constexpr,
                   TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_W: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """STAGE 0 load, 1 +scales, 2 +x, 3 full, 4 full in f16x2 (x_ptr: `half2_pairs`) (see the module
    docstring); one row per output. TMA: qw_ptr is a tensor descriptor of the codes and each tile comes
    through the copy engine."""
    row0 = tl.program_id(0) * BLOCK_N
    rn = row0 + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, BLOCK_W)
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    acc4 = tl.zeros((BLOCK_N, BLOCK_W // 4), dtype=tl.float32)  # f16x2: four words per element
    bits = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.int32)
    for j in tl.range(0, KW, BLOCK_W, num_stages=LOOP_STAGES):
        if TMA:
            words = qw_ptr.load([row0, j])
        else:
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
            elif STAGE == 3:
                acc += s[:, None] * decode_tile_dot(words, _x_of_words(x_ptr, j + rj), z, exponent)
            else:
                acc4 += s[:, None] * _half2_tile_dot(words, x_ptr, j, z, ASM)
    out = tl.sum(acc + bits.to(tl.float32), axis=1) + tl.sum(acc4, axis=1) * _X_DIV
    tl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty))


def run(x, qw, codes, stage: int, block_w: int, loop_stages: int, block_n: int = 64, warps: int = 4,
        tma: bool = False):  # fmt: skip
    kw = qw.qweight.shape[1]
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    if tma:
        codes = TensorDescriptor.from_tensor(codes, [block_n, block_w])
    if stage == STAGES.index("full f16x2"):  # the pairs made once per x, outside the timed calls
        if _PAIRS.get("x") is not x:
            _PAIRS.update(x=x, pairs=half2_pairs(x))
        xin = _PAIRS["pairs"]
    else:
        xin = x
    _stream_kernel[(N // block_n,)](
        xin, codes, qw.scales, qw.zeros, y, kw, qw.scales.stride(0), FLOAT_2_23_BITS, STAGE=stage, TMA=tma,
        LOOP_STAGES=loop_stages, BLOCK_N=block_n, BLOCK_W=block_w, ASM=DOT4_ASM, num_warps=warps,
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
    errs = {}
    full_stages = STAGES[3:] if dev.type == "cuda" else STAGES[3:4]  # the interpreter runs no PTX
    for stage, tma in itertools.product(full_stages, (False, True)):
        full = run(x, qw, copies[0], STAGES.index(stage), 16, 3, tma=tma).double()
        errs[f"{stage}{', TMA' if tma else ''}"] = ((full - ref).norm() / ref.norm()).item()
    print("relative error against float64:", {k: f"{v:.2g}" for k, v in errs.items()}, flush=True)
    err = max(errs.values())
    assert err < 5e-3, f"a full stage does not compute the GEMV: relative errors {errs}"
    rows = []
    dst = [torch.empty_like(c) for c in copies]

    def copy_all() -> None:
        for a, b in zip(copies, dst):
            b.copy_(a)

    t = graph_us(copy_all, len(copies))
    rows.append({"variant": "device copy (read + write)", "us": t, "read_tb_s": nbytes / t / 1e6})
    # (label, stage, words per row per tile, rows per tile, warps, TMA), loop stages
    cases = [((name, i, 16, 64, 4, False), (1, 3)) for i, name in enumerate(STAGES[:4])]
    cases += [(("wide (load, 32 words)", 0, 32, 64, 4, False), (1, 3))]
    cases += [
        ((f"{name}, TMA", i, 16, 64, 4, True), (2, 3, 4, 6)) for i, name in enumerate(STAGES) if i in (0, 3)
    ]
    cases += [
        (("full, TMA, 128 rows", 3, 16, 128, 4, True), (3, 4)),
        (("full, TMA, 32 words", 3, 32, 64, 4, True), (3,)),
    ]
    cases += [(("full, TMA, 8 warps", 3, 16, 64, 8, True), (3, 4))]
    if dev.type == "cuda":
        cases += [
            (("full f16x2", 4, 16, 64, 4, False), (1, 3)),
            (("full f16x2, TMA", 4, 16, 64, 4, True), (2, 3, 4, 6)),
        ]
        cases += [(("full f16x2, TMA, 32 words", 4, 32, 64, 4, True), (2, 3, 4))]
        cases += [(("full f16x2, TMA, 64 words", 4, 64, 64, 4, True), (2, 3))]
        cases += [(("full f16x2, TMA, 32 rows x 32 words", 4, 32, 32, 4, True), (3, 4))]
        cases += [(("full f16x2, TMA, 32 rows x 64 words", 4, 64, 32, 4, True), (3,))]
        cases += [(("full f16x2, TMA, 128 rows", 4, 16, 128, 4, True), (3,))]
        cases += [(("full f16x2, TMA, 32 words, 8 warps", 4, 32, 64, 8, True), (3,))]
        cases += [(("full f16x2, 32 words", 4, 32, 64, 4, False), (1, 3))]
    if os.environ.get("NCU"):  # one launch of each named variant between profiler start and stop
        picked = set(os.environ["NCU"].split(";"))
        chosen = [(c, st) for c, stages in cases for st in stages if f"{c[0]}, loop stages {st}" in picked]
        for (_name, *shape), loop_stages in chosen:
            run(x, qw, copies[0], shape[0], shape[1], loop_stages, *shape[2:])  # compile, warm
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for (_name, *shape), loop_stages in chosen:
            run(x, qw, copies[1], shape[0], shape[1], loop_stages, *shape[2:])
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print("profiled, in order:", [f"{c[0]}, loop stages {st}" for c, st in chosen])
        return
    for (name, *shape), loop_stages in ((c, st) for c, stages in cases for st in stages):

        def calls(shape=shape, loop_stages=loop_stages) -> None:
            stage, block_w, block_n, warps, tma = shape
            for c in copies:
                run(x, qw, c, stage, block_w, loop_stages, block_n, warps, tma)

        t = graph_us(calls, len(copies))
        rows.append({"variant": f"{name}, loop stages {loop_stages}", "us": t, "read_tb_s": nbytes / t / 1e6})
    for r in rows:
        print(f"{r['variant']:40s} {r['us']:7.1f} us {r['read_tb_s']:5.2f} TB/s", flush=True)
    with open(sys.argv[1] if len(sys.argv) > 1 else "int4_stream_diag.json", "w") as f:
        json.dump({"n": n_rows, "k": k, "code_bytes": nbytes, "full_rel_err": err, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
