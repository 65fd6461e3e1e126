"""An experiment for batch-1 int4 decode: the row GEMV with packed fp16 arithmetic (`f16x2`).

`qwick.kernels.row_gemv` decodes each nibble to fp32 and multiplies on the CUDA cores: ncu on the H200 had its
gate/up launch issue-bound (64% of issue slots busy, 1.61 TB/s). Here two nibbles become one f16x2 value
in one `lop3` (`(w >> 4p) & 0x000F000F | 0x64006400` reads 1024 + q for elements p and p + 4 of a word),
one `sub.f16x2` takes the zero point off (exact: small integers), one `fma.rn.f16x2` multiplies by the
matching pair of activations and accumulates, so a word of eight codes costs 15 instructions instead of
~25. Four words (32 products) are summed in fp16, then once in fp32 and scaled by the group's scale.
The activations are prepared once per row on the host (`half2_pairs`): fp16, divided by 64 so that 32
products of up to 15 x |x| / 64 stay far below fp16's 65504 for activations up to ~1e4, paired in the
order the nibbles come out.

Prints, per qwen2.5-7b layer shape: the row GEMV (today's default) and the f16x2 kernel over a few launch
shapes (us, TB/s of int4 bytes) with their relative error against a float64 reference. argv[1]: JSON out.
"""

import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from qwick.kernels.gemv import GemvWorkspace  # noqa: E402
from qwick.kernels.row_gemv import _row_epilogue, w4_row_gemv  # noqa: E402
from qwick.kernels.w4a16 import ZERO_CONST, ZERO_TENSOR  # noqa: E402
from qwick.quantization.formats import rtn  # noqa: E402
from qwick.quantization.formats.layout import dequantize  # noqa: E402

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
X_DIV = 64.0
X_MUL = tl.constexpr(X_DIV)  # the kernel's copy: it scales the sums back


def _dot4_asm() -> str:
    """PTX for one call: four words ($1-$4), their 16 activation pairs ($5 + 4 * word + pair), the row's
    f16x2 (1024 + z, 1024 + z) ($21) -> the fp32 sum of the 32 products ($0)."""
    lines = ["{", ".reg .b32 t, v, d, acc;", ".reg .b16 lo, hi;", ".reg .f32 fa, fb;", "mov.b32 acc, 0;"]
    for k in range(4):
        for p in range(4):
            src = f"${1 + k}"
            if p:
                lines.append(f"shr.u32 t, {src}, {4 * p};")
                src = "t"
            lines.append(f"lop3.b32 v, {src}, 0x000F000F, 0x64006400, 0xEA;")
            lines.append("sub.f16x2 d, v, $21;")
            lines.append(f"fma.rn.f16x2 acc, d, ${5 + 4 * k + p}, acc;")
    lines += [
        "mov.b32 {lo, hi}, acc;",
        "cvt.f32.f16 fa, lo;",
        "cvt.f32.f16 fb, hi;",
        "add.f32 $0, fa, fb;",
        "}",
    ]
    return "\n".join(lines)


DOT4_ASM = _dot4_asm()


@triton.jit
def _split4(t):
    """A [..., 2, 2] tensor -> its four [...] slices in index order (0, 1, 2, 3) of the flattened pair."""
    a, b = tl.split(t)  # last index 0 / 1: flat 0, 2 / 1, 3
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _half(bits):
    """The fp16 in the low 16 bits of int32 `bits`, as fp32."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dot4_emulated(ws, xs, z):
    """What DOT4_ASM computes, in fp32: sum over words k, pairs p of (nibble - z) * x for the two nibbles."""
    part = tl.zeros(ws[0].shape, tl.float32)
    for k in tl.static_range(4):
        for p in tl.static_range(4):
            lo = ((ws[k] >> (4 * p)) & 0xF).to(tl.float32) - z[:, None]
            hi = ((ws[k] >> (4 * p + 16)) & 0xF).to(tl.float32) - z[:, None]
            part += lo * _half(xs[k][p])[None, :] + hi * _half(xs[k][p] >> 16)[None, :]
    return part


@triton.jit
def _w4_half2_kernel(
    xp_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    N,
    KW,
    stride_qn,
    stride_sn,
    ZERO_POINT: tl.constexpr,
    ZERO_MODE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ASM: tl.constexpr,
    EMULATE: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    C: tl.constexpr = BLOCK_W // 4
    rc = tl.arange(0, C)
    r4 = tl.arange(0, 4)
    w_per_split = tl.cdiv(tl.cdiv(KW, SPLIT_K), BLOCK_W) * BLOCK_W
    j_start = pid_k * w_per_split
    j_end = tl.minimum(j_start + w_per_split, KW)
    rn64 = rn.to(tl.int64)
    q_rows = qw_ptr + rn64[:, None, None] * stride_qn
    s_rows = s_ptr + rn64 * stride_sn
    z_rows = z_ptr + rn64 * stride_sn
    acc = tl.zeros((BLOCK_N, C), dtype=tl.float32)
    for j in tl.range(j_start, j_end, BLOCK_W, num_stages=LOOP_STAGES):
        g = j // BLOCK_W  # the tile is one group
        cols = j + rc[:, None] * 4 + r4[None, :]  # [C, 4]: words 4c .. 4c + 3 of the tile
        words = tl.load(q_rows + cols[None, :, :], mask=n_ok[:, None, None], other=0)
        w0, w1, w2, w3 = _split4(words.reshape(BLOCK_N, C, 2, 2))
        xs = tl.load(xp_ptr + cols[:, :, None] * 4 + r4[None, None, :])  # [C, word, pair] f16x2 bits
        pa, pb, pc, pd = _split4(xs.reshape(C, 4, 2, 2))  # [C, word] each
        xa0, xa1, xa2, xa3 = _split4(pa.reshape(C, 2, 2))
        xb0, xb1, xb2, xb3 = _split4(pb.reshape(C, 2, 2))
        xc0, xc1, xc2, xc3 = _split4(pc.reshape(C, 2, 2))
        xd0, xd1, xd2, xd3 = _split4(pd.reshape(C, 2, 2))
        s = tl.load(s_rows + g, mask=n_ok, other=0.0).to(tl.float32)
        if ZERO_MODE == 1:
            z = tl.load(z_rows + g, mask=n_ok, other=0).to(tl.float32)
        else:
            z = tl.zeros((BLOCK_N,), dtype=tl.float32) + ZERO_POINT
        zh = (z + 1024.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        zz = (zh | (zh << 16))[:, None]
        xs4 = (
            (xa0, xb0, xc0, xd0), (xa1, xb1, xc1, xd1), (xa2, xb2, xc2, xd2), (xa3, xb3, xc3, xd3)
        )  # fmt: skip
        if EMULATE:  # the same products in fp32 Triton arithmetic (the Triton interpreter runs no PTX)
            part = _dot4_emulated((w0, w1, w2, w3), xs4, z)
        else:
            part = tl.inline_asm_elementwise(
                ASM,
                "=r" + ",r" * 21,
                [w0, w1, w2, w3,
                 xa0[None, :], xb0[None, :], xc0[None, :], xd0[None, :],
                 xa1[None, :], xb1[None, :], xc1[None, :], xd1[None, :],
                 xa2[None, :], xb2[None, :], xc2[None, :], xd2[None, :],
                 xa3[None, :], xb3[None, :], xc3[None, :], xd3[None, :],
                 zz],
                dtype=tl.float32,
                is_pure=True,
                pack=1,
            )  # fmt: skip
        acc += s[:, None] * part
    _row_epilogue(
        acc * X_MUL, s_ptr, y_ptr, ws_ptr, counter_ptr, rn, n_ok, pid_n, pid_k, N, False, SPLIT_K, BLOCK_N
    )


def half2_pairs(x: torch.Tensor) -> torch.Tensor:
    """x [1, K] -> int32 [K / 8, 4]: per word of codes, fp16 pairs (x[p] / 64, x[p + 4] / 64), p = 0..3."""
    xf = (x.float().reshape(-1, 8) / X_DIV).half()
    pairs = torch.stack([xf[:, :4], xf[:, 4:]], dim=-1).contiguous()  # [K / 8, 4, 2]
    return pairs.view(torch.int32).reshape(-1, 4)


def half2_gemv(xp, qw, ws, block_n=64, split=1, stages=1, warps=4, emulate=False):
    n = qw.qweight.shape[0]
    kw = qw.qweight.shape[1]
    y = torch.empty((1, n), dtype=torch.bfloat16, device=xp.device)
    tiles = triton.cdiv(n, block_n)
    ws.check(split, 1, n, tiles, "half2")
    mode, extra = (ZERO_TENSOR, qw.zeros) if qw.zeros is not None else (ZERO_CONST, qw.scales)
    _w4_half2_kernel[(tiles, split)](
        xp, qw.qweight, qw.scales, extra, y, ws.partials, ws.counters, n, kw, qw.qweight.stride(0),
        qw.scales.stride(0), ZERO_POINT=qw.zero_point, ZERO_MODE=mode, SPLIT_K=split, LOOP_STAGES=stages,
        BLOCK_N=block_n, BLOCK_W=qw.group_size // 8, ASM=DOT4_ASM, EMULATE=emulate, num_warps=warps,
    )  # fmt: skip
    return y


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=100, rep=30, return_mode="median") * 1e3


def case(name: str, n: int, k: int, ws: GemvWorkspace) -> dict:
    """Today's row GEMV and the f16x2 kernel over its launch shapes, for one layer shape."""
    w = torch.randn(n, k, device=ws.partials.device, dtype=torch.bfloat16) / k**0.5
    x = torch.randn(1, k, device=w.device, dtype=torch.bfloat16)
    qw = rtn.quantize(w, group_size=128)
    ref = x.double() @ dequantize(qw).double().T

    def err(y: torch.Tensor) -> float:
        return ((y.double() - ref).norm() / ref.norm()).item()

    t_row = bench(lambda: w4_row_gemv(x, qw, None, ws))
    row = {"shape": name, "row_gemv_us": t_row, "row_gemv_err": err(w4_row_gemv(x, qw, None, ws))}
    xp = half2_pairs(x)
    row["pairs_us"] = bench(lambda: half2_pairs(x))
    found = []
    splits = (1, 2) if n >= 16384 else (4, 8, 16)
    for cfg in itertools.product((32, 64, 128), splits, (1, 3), (4, 8)):
        try:
            e = err(half2_gemv(xp, qw, ws, *cfg))
        except Exception as ex:  # a shape the compiler rejects
            print(f"skip {name} {cfg}: {type(ex).__name__} {str(ex)[:100]}", flush=True)
            continue
        if not e < 5e-3:
            print(f"BAD {name} {cfg} err={e:.3g}", flush=True)
            continue
        found.append((bench(lambda c=cfg: half2_gemv(xp, qw, ws, *c)), cfg, e))
    found.sort()
    row["half2"] = [{"us": t, "bn_split_stages_warps": c, "err": e} for t, c, e in found[:5]]
    best = found[0] if found else (float("nan"), "-", float("nan"))
    tbs = qw.nbytes / 1e6
    print(
        f"{name:8s} row GEMV {t_row:6.1f} us ({tbs / t_row:.2f} TB/s, err {row['row_gemv_err']:.1e}) | "
        f"f16x2 {best[0]:6.1f} us ({tbs / best[0]:.2f} TB/s, err {best[2]:.1e}) {best[1]} | "
        f"pairs {row['pairs_us']:.1f} us",
        flush=True,
    )
    return row


def main() -> None:
    ws = GemvWorkspace(torch.device("cuda"), max_elems=1 << 24)
    rows = [case(name, n, k, ws) for name, (n, k) in SHAPES.items()]
    with open(sys.argv[1] if len(sys.argv) > 1 else "int4_half2_gemv.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
