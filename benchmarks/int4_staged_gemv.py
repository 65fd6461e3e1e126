"""Batch-1 int4 GEMV with the activation pairs staged in shared memory once per program and no barrier in
its loop (Gluon), against the engine's f16x2 kernel (`qwick.kernels.row_gemv_half2`) at the qwen2.5-7b
layer shapes. A prototype, not an engine path.

Why: in the 49th session Nsight Compute's per-instruction sampling of the f16x2 gate/up launch on an H100
put 34% of its warps' stalls at the two `bar.sync` of each tile, around the exchange of the tile's
activation pairs through shared memory (each thread loads one int32 of them, stores it, and after the
barrier reads its quad's 16 back), and 42% on each tile's own code loads. The four warps of a program
move in lockstep, so one warp's late tile holds the others. The TMA ring of that session
(`benchmarks/int4_ring_gemv.py`) staged the pairs once per program too, but it also moved the code bytes
through shared memory with an mbarrier wait, a barrier and an arrive a tile, on a third of the decoding
warps; it lost (30.5 us against 26.7 at gate/up). Here only the pairs move:

- each program (one row block, one K split: the f16x2 kernel's grid) copies its split's activation pairs
  (`half_pairs`, what decode's RMSNorm and SiLU-and-mul write for the f16x2 kernel: a thread reads one
  quad's 16, 64 bytes) into shared memory as [16, quads], then one barrier;
- its loop loads each code tile from global memory straight into the registers the products read (each
  thread a quad of words of BN / (32 / C) / WARPS rows), the scales one tile ahead, and reads its quad's
  16 pairs from shared memory (`ldmatrix`, one register each, the same for every row a thread holds): no
  barrier, no exchange, so the warps drift apart as their loads land;
- the decode and products are the f16x2 kernel's (`DOT4_ASM`, 13 instructions a word); PREFETCH keeps a
  second tile in flight (A and B alternating, as `RowGemvConfig.prefetch`).

K splits end as the engine's (`gemv.split_k_epilogue`): each program writes its partial sums, and the row
block's last program to finish (an acq_rel counter) adds them in split order and writes the output.

    python benchmarks/int4_staged_gemv.py out.json   # env SHAPES, BNS, BWS, WARPS, PREFETCH ("0 1")
    OFFLINE=1 python benchmarks/int4_staged_gemv.py      # no GPU: compile for sm_90, print SASS counts

Offline (56th session, Triton 3.6, sm_90 SASS): one `BAR.SYNC` in the whole kernel (the f16x2 kernel: two a
tile), 16 `LDSM` and two `LDG.128` a tile, 40 registers a thread against the f16x2 kernel's 54 (so 12
programs of 4 warps an SM, not 9), and 40 with the prefetch too. Not yet timed on a GPU.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from int4_half2_sweep import graph_us, layer_inputs, workspace  # noqa: E402  (beside this script)
from int4_ring_gemv import SHAPES, _f16_pair, _scales, _x  # noqa: E402

from qwick.kernels.row_gemv_half2 import DOT4_ASM, X_DIV, default_half2_config, half_pairs, w4_half2_gemv  # noqa: E402

_DOT4 = gl.constexpr(DOT4_ASM)
_X_DIV = gl.constexpr(X_DIV)


@dataclass(frozen=True)
class StagedConfig:
    block_n: int = 32  # rows per tile
    block_w: int = 32  # words per tile (8 quads)
    split_k: int = 1
    warps: int = 4
    prefetch: bool = False


@gluon.jit
def _tile_part(w, xs, kt, sc, z, BN: gl.constexpr, C: gl.constexpr, NKT_PAD: gl.constexpr, LW: gl.constexpr):
    """[BN, C] scaled sums of one code tile w [BN, 4 C] (tile kt of the program's split)."""
    wa, wb = gl.split(gl.reshape(w, [BN, C, 2, 2]))
    w0, w2 = gl.split(wa)
    w1, w3 = gl.split(wb)
    zf = z.to(gl.float32)
    part = gl.inline_asm_elementwise(
        _DOT4, "=r" + ",r" * 22,
        [w0, w1, w2, w3,
         _x(xs, kt, 0, NKT_PAD, LW), _x(xs, kt, 1, NKT_PAD, LW), _x(xs, kt, 2, NKT_PAD, LW),
         _x(xs, kt, 3, NKT_PAD, LW), _x(xs, kt, 4, NKT_PAD, LW), _x(xs, kt, 5, NKT_PAD, LW),
         _x(xs, kt, 6, NKT_PAD, LW), _x(xs, kt, 7, NKT_PAD, LW), _x(xs, kt, 8, NKT_PAD, LW),
         _x(xs, kt, 9, NKT_PAD, LW), _x(xs, kt, 10, NKT_PAD, LW), _x(xs, kt, 11, NKT_PAD, LW),
         _x(xs, kt, 12, NKT_PAD, LW), _x(xs, kt, 13, NKT_PAD, LW), _x(xs, kt, 14, NKT_PAD, LW),
         _x(xs, kt, 15, NKT_PAD, LW), _f16_pair(zf + 1024.0), _f16_pair(-(zf + 64.0))],
        dtype=gl.float32, is_pure=True, pack=1,
    )  # fmt: skip
    return sc.to(gl.float32) * part


@gluon.jit
def _staged_kernel(
    qw_ptr,
    p_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    N,
    stride_qn,
    stride_sn,
    n_quads,
    n_kt,
    SPLIT: gl.constexpr,
    BN: gl.constexpr,
    BW: gl.constexpr,
    WARPS: gl.constexpr,
    GROUP_W: gl.constexpr,
    NKT_PAD: gl.constexpr,
    PREFETCH: gl.constexpr,
):
    """y[n] = sum_k (q[n, k] - z) * s * x[k] over K split program_id(1) (up to n_kt tiles of BW words,
    the last split fewer or none) for the BN rows of row block program_id(0)."""
    C: gl.constexpr = BW // 4
    L2: gl.constexpr = gl.BlockedLayout([1, 4], [32 // C, C], [WARPS, 1], [1, 0])  # a quad's words a thread
    probe = gl.zeros([BN, BW], gl.int32, L2)  # the layout of one word of each quad, as the loop splits it
    pa, pb = gl.split(gl.reshape(probe, [BN, C, 2, 2]))
    p0, p1 = gl.split(pa)
    LW: gl.constexpr = p0.type.layout
    XL: gl.constexpr = gl.SliceLayout(0, LW)
    RL: gl.constexpr = gl.SliceLayout(1, LW)
    rb = gl.program_id(0)
    kt0 = gl.program_id(1) * n_kt
    last = n_quads // C - 1  # the row's last tile: tiles past the split's end read it with scale 0
    n_here = gl.minimum(n_kt, last + 1 - kt0)  # tiles in this split (<= 0: none)

    # the split's activation pairs into xs [16 * NKT_PAD, 1, C], pair r of tile kt's quads in row
    # r * NKT_PAD + kt, once
    # (`half_pairs` holds pair r of quad j at 16 j + r: a thread reads one quad's 16, 64 bytes)
    SL3: gl.constexpr = gl.BlockedLayout([16, 1, 1], [1, 32 // C, C], [1, WARPS, 1], [0, 2, 1])
    r3 = gl.expand_dims(
        gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, SL3))), 1), 2
    )
    kt3 = gl.expand_dims(
        gl.expand_dims(gl.arange(0, NKT_PAD, layout=gl.SliceLayout(0, gl.SliceLayout(2, SL3))), 0), 2
    )
    qc3 = gl.expand_dims(
        gl.expand_dims(gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, SL3))), 0), 1
    )
    q = (kt0 + kt3) * C + qc3  # [1, NKT_PAD, C] quad indices
    pairs = gl.load(p_ptr + q * 16 + r3, mask=(kt3 < n_here) & (r3 < 16), other=0)
    xs = gl.allocate_shared_memory(
        gl.int32, [16, NKT_PAD, C], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]), pairs
    )
    gl.thread_barrier()
    xs = xs._reinterpret(gl.int32, [16 * NKT_PAD, 1, C], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    # the code tiles straight from global memory, in the layout the products take them
    rows_w = rb * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, L2))
    cols_w = gl.arange(0, BW, layout=gl.SliceLayout(0, L2))
    w_ptrs = (
        qw_ptr + gl.expand_dims(rows_w.to(gl.int64) * stride_qn, 1) + gl.expand_dims(kt0 * BW + cols_w, 0)
    )
    w_mask = gl.expand_dims(rows_w < N, 1)
    rows = rb * BN + gl.arange(0, BN, layout=RL)
    ok = rows < N
    quad4 = gl.arange(0, C, layout=XL) * 4
    acc = gl.zeros([BN, C], gl.float32, LW)
    if PREFETCH:  # tiles A (even) and B (odd) in flight together; B past the end: the last tile, scale 0
        ka = gl.minimum(kt0, last) - kt0
        w_a = gl.load(w_ptrs + ka * BW, mask=w_mask, other=0)
        s_a, z_a = _scales(s_ptr, z_ptr, rows, ok, kt0 + ka, quad4, stride_sn, BW, GROUP_W)
        for kt in range(0, n_here, 2):
            kb = gl.minimum(kt + 1, n_here - 1)
            w_b = gl.load(w_ptrs + kb * BW, mask=w_mask, other=0)
            s_b, z_b = _scales(s_ptr, z_ptr, rows, ok, kt0 + kb, quad4, stride_sn, BW, GROUP_W)
            s_b = gl.where(kt + 1 < n_here, s_b, 0.0)
            acc += _tile_part(w_a, xs, kt, s_a, z_a, BN, C, NKT_PAD, LW)
            ka = gl.minimum(kt + 2, n_here - 1)
            w_a = gl.load(w_ptrs + ka * BW, mask=w_mask, other=0)
            s_a, z_a = _scales(s_ptr, z_ptr, rows, ok, kt0 + ka, quad4, stride_sn, BW, GROUP_W)
            acc += _tile_part(w_b, xs, kb, s_b, z_b, BN, C, NKT_PAD, LW)
    else:
        sc, z = _scales(s_ptr, z_ptr, rows, ok, gl.minimum(kt0, last), quad4, stride_sn, BW, GROUP_W)
        for kt in range(0, n_here):
            w = gl.load(w_ptrs + kt * BW, mask=w_mask, other=0)
            nxt = gl.minimum(kt + 1, n_here - 1)
            nsc, nz = _scales(s_ptr, z_ptr, rows, ok, kt0 + nxt, quad4, stride_sn, BW, GROUP_W)
            acc += _tile_part(w, xs, kt, sc, z, BN, C, NKT_PAD, LW)
            sc, z = nsc, nz
    out = gl.sum(acc, axis=1) * _X_DIV
    if SPLIT == 1:
        gl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty), mask=ok)
    else:  # as the engine's `split_k_epilogue`: partials [SPLIT, N], the row block's last program sums them
        gl.store(ws_ptr + gl.program_id(1) * N + rows, out, mask=ok)
        gl.thread_barrier()  # every thread's partial is written before the release below
        done = gl.atomic_add(counter_ptr + rb, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            total = gl.zeros([BN], gl.float32, RL)
            for k in range(SPLIT):
                total += gl.load(ws_ptr + k * N + rows, mask=ok, other=0.0, cache_modifier=".cg")
            gl.store(y_ptr + rows, total.to(y_ptr.dtype.element_ty), mask=ok)
            gl.atomic_xchg(counter_ptr + rb, 0, sem="relaxed", scope="gpu")


class Scratch:
    """The split-K partials and the row blocks' counters (zero between launches), shared by every layer."""

    def __init__(self, dev: torch.device) -> None:
        self.partials = torch.empty(1 << 22, dtype=torch.float32, device=dev)
        self.counters = torch.zeros(1 << 14, dtype=torch.int32, device=dev)


def launch(qw, pairs: torch.Tensor, y: torch.Tensor, cfg: StagedConfig, scratch: Scratch) -> torch.Tensor:
    """y [1, N] from x's `half_pairs`."""
    n, kw = qw.qweight.shape
    assert kw % cfg.block_w == 0
    n_kt = triton.cdiv(kw // cfg.block_w, cfg.split_k)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    _staged_kernel[grid](
        qw.qweight, pairs, qw.scales, qw.zeros, y, scratch.partials, scratch.counters, n,
        qw.qweight.stride(0), qw.scales.stride(0), kw // 4, n_kt,
        SPLIT=cfg.split_k, BN=cfg.block_n, BW=cfg.block_w, WARPS=cfg.warps, GROUP_W=qw.group_size // 8,
        NKT_PAD=triton.next_power_of_2(n_kt), PREFETCH=cfg.prefetch, num_warps=cfg.warps,
    )  # fmt: skip
    return y


def candidates(n: int, kw: int, num_sms: int) -> list[StagedConfig]:
    """The f16x2 default's rows, warps and split, then the swept rows, tile widths (BWS, words), warps and
    prefetch at its split."""
    base = default_half2_config(n, kw, num_sms)
    out = [StagedConfig(base.block_n, base.block_k, base.split_k, base.num_warps, base.prefetch)]
    bns = [int(v) for v in os.environ.get("BNS", "32 64").split()]
    bws = [int(v) for v in os.environ.get("BWS", str(base.block_k)).split()]
    warps = [int(v) for v in os.environ.get("WARPS", "2 4 8").split()]
    pfs = [bool(int(v)) for v in os.environ.get("PREFETCH", "0 1").split()]
    for bn, bw, w, pf in itertools.product(bns, bws, warps, pfs):
        cfg = StagedConfig(bn, bw, base.split_k, w, pf)
        if cfg not in out and kw % bw == 0 and bn % (32 // (bw // 4) * w) == 0:  # whole warps of rows
            out.append(cfg)
    return out


def offline() -> None:
    """Compile for sm_90 without a GPU (Triton's own ptxas) with the divisibility a launch would see, and
    print the resources and the SASS of each shape's default launch (barriers, shared and global loads)."""
    from ptx_counts import registers, sass_counts  # beside this script
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    for name, (n, k) in SHAPES.items():
        kw = k // 8
        for cfg in candidates(n, kw, 132)[:1] + [StagedConfig(prefetch=True)] * (name == "gate_up"):
            n_kt = triton.cdiv(kw // cfg.block_w, cfg.split_k)
            sig = {"qw_ptr": "*i32", "p_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8"}
            sig |= {"y_ptr": "*bf16", "ws_ptr": "*fp32", "counter_ptr": "*i32"}
            sig |= {a: "i32" for a in ("N", "stride_qn", "stride_sn", "n_quads", "n_kt")}
            const = dict(
                SPLIT=cfg.split_k, BN=cfg.block_n, BW=cfg.block_w, WARPS=cfg.warps, GROUP_W=16,
                NKT_PAD=triton.next_power_of_2(n_kt), PREFETCH=cfg.prefetch,
            )  # fmt: skip
            names = list(sig)
            divisible = [*names[:7], "N", "stride_qn", "stride_sn", "n_quads"]  # pointers, rows, strides
            attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible}
            src = GluonASTSource(
                fn=_staged_kernel,
                signature=sig | {c: "constexpr" for c in const},
                constexprs=const,
                attrs=attrs,
            )
            kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg.warps))
            n_sass, ops = sass_counts(kern)
            top = ", ".join(f"{op} {ops[op]}" for op in ("LDG", "LDSM", "STSM", "BAR", "HFMA2", "REDG"))
            regs = registers(kern)
            print(f"{name} {cfg}: {kern.metadata.shared} B shared, {regs} registers, SASS {n_sass}: {top}")


def main() -> None:
    dev = torch.device("cuda")
    ws = workspace(dev)
    scratch = Scratch(dev)
    report = {}
    for name, (n, k) in SHAPES.items():
        qw, x, ref, copies = layer_inputs(n, k, dev)
        pairs = half_pairs(x)
        base = default_half2_config(n, k // 8, ws.num_sms)

        def f16x2(copies=copies, x=x, pairs=pairs, base=base) -> None:
            for c in copies:
                w4_half2_gemv(x, c, None, ws, base, pairs=pairs)

        t = graph_us(f16x2, len(copies))
        rows = [{"candidate": "f16x2 default", "us": t, "tb_s": qw.nbytes / t / 1e6}]
        print(f"{name:8s} {'f16x2 default':40s} {t:7.2f} us {qw.nbytes / t / 1e6:5.2f} TB/s", flush=True)
        for cfg in candidates(n, k // 8, ws.num_sms):
            y = torch.zeros(1, n, device=dev, dtype=torch.bfloat16)
            try:
                err = ((launch(qw, pairs, y, cfg, scratch).double() - ref).norm() / ref.norm()).item()
            except Exception as e:  # a launch shape that does not compile or fit: reported, not fatal
                print(f"{name} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            label = f"staged {cfg.block_n}x{cfg.block_w} split{cfg.split_k} {cfg.warps}w" + (
                " prefetch" if cfg.prefetch else ""
            )
            if err > 4e-3:
                print(f"{name} {label}: relative error {err:.3g}, skipped", flush=True)
                continue

            def staged(copies=copies, y=y, pairs=pairs, cfg=cfg) -> None:
                for c in copies:
                    launch(c, pairs, y, cfg, scratch)

            t = graph_us(staged, len(copies))
            rows.append({"candidate": label, "us": t, "tb_s": qw.nbytes / t / 1e6, "err": err})
            print(f"{name:8s} {label:40s} {t:7.2f} us {qw.nbytes / t / 1e6:5.2f} TB/s", flush=True)
        report[name] = rows
    with open(sys.argv[1] if len(sys.argv) > 1 else "int4_staged_gemv.json", "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    offline() if os.environ.get("OFFLINE") else main()
