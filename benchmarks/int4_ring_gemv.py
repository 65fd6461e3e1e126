"""Batch-1 int4 GEMV with its code tiles streamed by TMA through a shared-memory ring (Gluon, warp
specialized), against the engine's f16x2 kernel (`qwick.kernels.row_gemv_half2`) at the qwen2.5-7b layer
shapes. A prototype, not an engine path.

Why: in the 49th session Nsight Compute's per-instruction sampling of the f16x2 gate/up launch on an H100
put 42% of its warps' stalls on each tile's own code loads (the loop is not pipelined: the register
prefetch and Triton's shared-memory pipeline both lost) and 34% at the two `bar.sync` a tile of the
activation pairs' exchange through shared memory, the four warps of a program in lockstep. Here:

- one producer warp per program issues TMA copies of [BN, BW] code tiles (BW words of BN rows) into a
  ring of STAGES shared-memory slots, as far ahead as the ring has room: the bytes in flight cost shared
  memory, not registers, and no consumer issues a code load;
- the activation pairs (`half_pairs`, what decode's producers write) are copied into shared memory once
  per program, transposed so that each of a quad's 16 pairs is one `ld.shared.b32` in the layout the
  products need: no exchange per tile;
- the consumer warps decode and multiply as the f16x2 kernel does (its `DOT4_ASM`, 13 instructions per
  word), each thread one quad (4 words) of BN / (8 * WARPS) / ... rows, and hand each slot back (one
  barrier among the consumer warps, then one arrive);
- work is split as (row block, K split) items, contiguous ranges per program; K splits add their fp32
  sums with atomics into a zeroed output (timed with its memset).

Scales and zero points (per row and group) are loaded from global memory one tile ahead. Each candidate is
checked against float64, then timed as decode runs it: CUDA-graph replays over weight copies that together
overflow the L2 (the harness of `benchmarks/int4_half2_sweep.py`), beside the f16x2 kernel's default.

Result on an H100 (49th session, gate/up 37888 x 3584, four calls, us): it loses. The f16x2 default
26.7-26.8; the ring's best 30.5, twice (32 x 32-word tiles, 4 stages, 3 programs an SM, 4 consumer warps,
at most 80 registers a thread). Without a cap the consumer warps take 255 registers (the worker warp is
padded to a warpgroup), one program fills an SM, and the best was 35.4 (64-row tiles). More programs an
SM help (2: 33.6, 3: 30.5); more consumer warps a program do not (8: 34.8-60.1), nor 16-row tiles
(33.7-60.1), and 4-6 programs at 56-72 registers gave 33.0-43.7. So the consumers limit it: each tile
carries a wait, two barriers, an arrive and 16 `ldmatrix` of the pairs for a few dot products a thread,
with 12 consumer warps an SM against the f16x2 kernel's 36. The code bytes arriving by TMA are not the
problem. Every timed launch matched float64 within 4e-3. Next steps, not taken: more work a tile per
synchronization, and the scales through the ring too. (Offline, sm_90 PTX with Triton 3.6: releasing the
slot after the products instead of after its load still leaves two `bar.sync` a tile, since one comes
before each `mbarrier.wait`; not timed, not kept.)

    python benchmarks/int4_ring_gemv.py out.json   # env SHAPES, BNS, STAGES, PROGS (a grid of PROGS x SMs
                                                    # programs), WARPS (consumer warps), HALF_SPLITS=1
    OFFLINE=1 python benchmarks/int4_ring_gemv.py      # no GPU: compile for sm_90, print registers
"""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass, replace

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from int4_half2_sweep import sweep_against_f16x2  # noqa: E402  (beside this script)

from qwick.kernels.row_gemv_half2 import DOT4_ASM, X_DIV, default_half2_config  # noqa: E402

ALL_SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
SHAPES = {s: ALL_SHAPES[s] for s in os.environ.get("SHAPES", " ".join(ALL_SHAPES)).split()}
_copy_in = getattr(tma, "async_copy_global_to_shared", None) or tma.async_load
_DOT4 = gl.constexpr(DOT4_ASM)
_X_DIV = gl.constexpr(X_DIV)


@dataclass(frozen=True)
class RingConfig:
    block_n: int = 32  # rows per tile
    block_w: int = 32  # words per tile (8 quads)
    stages: int = 8
    split_k: int = 1
    programs_per_sm: int = 2
    warps: int = 4  # consumer warps
    # ptxas's register cap (Triton's `maxnreg`): without one the consumer warps take 255 registers a thread
    # and one program fills an SM (49th session); 128 lets two in
    max_registers: int | None = None


@gluon.jit
def _producer(w_desc, ring, ready, empty, item0, item1, n_kt, SPLIT: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the program's code tiles, item by item, K tile by K tile, into the ring."""
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BW: gl.constexpr = w_desc.block_type.shape[1]
    i = 0
    for item in range(item0, item1):
        rb = item // SPLIT
        s = item % SPLIT
        for kt in range(s * n_kt, (s + 1) * n_kt):
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), BN * BW * 4)
            _copy_in(w_desc, [rb * BN, kt * BW], ready.index(slot), ring.index(slot))
            i += 1


@gluon.jit
def _f16_pair(v):
    """fp32 v rounded to fp16, in both halves of an int32."""
    b = v.to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return b | (b << 16)


@gluon.jit
def _x(xs, kt, r: gl.constexpr, NKT_PAD: gl.constexpr, LW: gl.constexpr):
    """Pair r % 4 of word r // 4 of each quad of K tile kt, [1, C], broadcast over the rows."""
    return xs.index(r * NKT_PAD + kt).load(LW)


@gluon.jit
def quad_products(w, xs, kt, z, BN: gl.constexpr, C: gl.constexpr, NKT_PAD: gl.constexpr, LW: gl.constexpr):
    """[BN, C] unscaled sums of code tile w [BN, 4 C] against K tile kt's pairs in xs (pair r of the tile's
    quads in row r * NKT_PAD + kt: word r // 4, pair r % 4), z the fp32 zero points: `DOT4_ASM`."""
    wa, wb = gl.split(gl.reshape(w, [BN, C, 2, 2]))
    w0, w2 = gl.split(wa)
    w1, w3 = gl.split(wb)
    return gl.inline_asm_elementwise(
        _DOT4, "=r" + ",r" * 22,
        [w0, w1, w2, w3,
         _x(xs, kt, 0, NKT_PAD, LW), _x(xs, kt, 1, NKT_PAD, LW), _x(xs, kt, 2, NKT_PAD, LW),
         _x(xs, kt, 3, NKT_PAD, LW), _x(xs, kt, 4, NKT_PAD, LW), _x(xs, kt, 5, NKT_PAD, LW),
         _x(xs, kt, 6, NKT_PAD, LW), _x(xs, kt, 7, NKT_PAD, LW), _x(xs, kt, 8, NKT_PAD, LW),
         _x(xs, kt, 9, NKT_PAD, LW), _x(xs, kt, 10, NKT_PAD, LW), _x(xs, kt, 11, NKT_PAD, LW),
         _x(xs, kt, 12, NKT_PAD, LW), _x(xs, kt, 13, NKT_PAD, LW), _x(xs, kt, 14, NKT_PAD, LW),
         _x(xs, kt, 15, NKT_PAD, LW), _f16_pair(z + 1024.0), _f16_pair(-(z + 64.0))],
        dtype=gl.float32, is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _scales(s_ptr, z_ptr, rows, ok, kt, quad4, stride_sn, BW: gl.constexpr, GROUP_W: gl.constexpr):
    """[BN, C] scales (fp32) and zero points (as stored) of tile kt's quads for `rows`."""
    g = (kt * BW + quad4) // GROUP_W
    off = gl.expand_dims(rows.to(gl.int64) * stride_sn, 1) + gl.expand_dims(g, 0)
    mask = gl.expand_dims(ok, 1)
    return gl.load(s_ptr + off, mask=mask, other=0.0), gl.load(z_ptr + off, mask=mask, other=0)


@gluon.jit
def _consumer(
    ring,
    ready,
    empty,
    xs,
    pt_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    N,
    stride_sn,
    item0,
    item1,
    n_kt,
    n_quads,
    SPLIT: gl.constexpr,
    BN: gl.constexpr,
    BW: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    GROUP_W: gl.constexpr,
    NKT_PAD: gl.constexpr,
):
    C: gl.constexpr = BW // 4
    L2: gl.constexpr = gl.BlockedLayout([1, 4], [32 // C, C], [WARPS, 1], [1, 0])  # a quad's words a thread
    # the layout of a word of each quad ([BN, C]), found by splitting a dummy tile the way the loop does
    probe = gl.zeros([BN, BW], gl.int32, L2)
    pa, pb = gl.split(gl.reshape(probe, [BN, C, 2, 2]))
    p0, p1 = gl.split(pa)
    LW: gl.constexpr = p0.type.layout
    XL: gl.constexpr = gl.SliceLayout(0, LW)
    RL: gl.constexpr = gl.SliceLayout(1, LW)
    # the activation pairs, transposed ([16, quads] in global), into xs [16 * NKT_PAD, 1, C], once
    SL3: gl.constexpr = gl.BlockedLayout([1, 1, 1], [32 // C, 1, C], [WARPS, 1, 1], [2, 1, 0])
    ktr = gl.arange(0, NKT_PAD, layout=gl.SliceLayout(1, gl.SliceLayout(2, SL3)))
    qc = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, SL3)))
    q = gl.expand_dims(gl.expand_dims(ktr, 1), 2) * C + gl.expand_dims(
        gl.expand_dims(qc, 0), 1
    )  # [NKT_PAD, 1, C]
    for r in gl.static_range(16):
        xs.slice(r * NKT_PAD, NKT_PAD).store(gl.load(pt_ptr + r * n_quads + q, mask=q < n_quads, other=0))
    gl.thread_barrier()
    # the same bytes viewed with a rank-2 layout, so that `index` gives [1, C] rows to load in LW
    xs = xs._reinterpret(gl.int32, [16 * NKT_PAD, 1, C], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    quad4 = gl.arange(0, C, layout=XL) * 4
    i = 0
    for item in range(item0, item1):
        rb = item // SPLIT
        s = item % SPLIT
        rows = rb * BN + gl.arange(0, BN, layout=RL)
        ok = rows < N
        acc = gl.zeros([BN, C], gl.float32, LW)
        kt0 = s * n_kt
        sc, z = _scales(s_ptr, z_ptr, rows, ok, kt0, quad4, stride_sn, BW, GROUP_W)
        for kt in range(kt0, kt0 + n_kt):
            nsc, nz = _scales(
                s_ptr, z_ptr, rows, ok, gl.minimum(kt + 1, kt0 + n_kt - 1), quad4, stride_sn, BW, GROUP_W
            )
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            w = ring.index(slot).load(L2)
            gl.thread_barrier()  # every consumer warp has read the slot before it goes back
            mbarrier.arrive(empty.index(slot), count=1)
            acc += sc.to(gl.float32) * quad_products(w, xs, kt, z.to(gl.float32), BN, C, NKT_PAD, LW)
            sc, z = nsc, nz
            i += 1
        out = gl.sum(acc, axis=1) * _X_DIV
        if SPLIT == 1:
            gl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty), mask=ok)
        else:
            gl.atomic_add(y_ptr + rows, out, mask=ok, sem="relaxed")


@gluon.jit
def _ring_kernel(
    w_desc,
    pt_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    N,
    stride_sn,
    n_items,
    n_kt,
    n_quads,
    SPLIT: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    GROUP_W: gl.constexpr,
    NKT_PAD: gl.constexpr,
):
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BW: gl.constexpr = w_desc.block_type.shape[1]
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    item0 = n_items * pid // nprog
    item1 = n_items * (pid + 1) // nprog
    ring = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BW], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for p in gl.static_range(STAGES):
        mbarrier.init(ready.index(p), count=1)
        mbarrier.init(empty.index(p), count=1)
    xs = gl.allocate_shared_memory(
        gl.int32, [16 * NKT_PAD, 1, BW // 4], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    )
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    ring,
                    ready,
                    empty,
                    xs,
                    pt_ptr,
                    s_ptr,
                    z_ptr,
                    y_ptr,
                    N,
                    stride_sn,
                    item0,
                    item1,
                    n_kt,
                    n_quads,
                    SPLIT,
                    BN,
                    BW,
                    STAGES,
                    WARPS,
                    GROUP_W,
                    NKT_PAD,
                ),
            ),  # fmt: skip
            (_producer, (w_desc, ring, ready, empty, item0, item1, n_kt, SPLIT, STAGES)),
        ],
        [1],
        [24],
    )


def pairs_transposed(pairs: torch.Tensor) -> torch.Tensor:
    """`half_pairs` [1, K / 2] -> [16, K / 32]: row 4 j + p holds pair p of word j of every quad (the layout a
    producer would write for this kernel)."""
    return pairs.view(-1, 16).t().contiguous()


class RingGemv:
    """One weight's launches: its TMA descriptor, made once (as a graph would capture it)."""

    def __init__(self, qw, cfg: RingConfig, num_sms: int) -> None:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        n, kw = qw.qweight.shape
        assert qw.zeros is not None and kw % (cfg.block_w * cfg.split_k) == 0 and cfg.block_w % 4 == 0
        self.qw, self.cfg, self.n, self.kw = qw, cfg, n, kw
        layout = gl.NVMMASharedLayout.get_default_for([cfg.block_n, cfg.block_w], gl.int32)
        self.desc = TensorDescriptor(qw.qweight, [n, kw], [kw, 1], [cfg.block_n, cfg.block_w], layout)
        self.n_kt = kw // cfg.block_w // cfg.split_k
        self.n_items = triton.cdiv(n, cfg.block_n) * cfg.split_k
        self.grid = (min(self.n_items, cfg.programs_per_sm * num_sms),)

    def __call__(self, pt: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if cfg.split_k > 1:
            y.zero_()
        _ring_kernel[self.grid](
            self.desc, pt, self.qw.scales, self.qw.zeros, y, self.n, self.qw.scales.stride(0), self.n_items,
            self.n_kt, self.kw // 4, SPLIT=cfg.split_k, STAGES=cfg.stages, WARPS=cfg.warps,
            GROUP_W=self.qw.group_size // 8, NKT_PAD=triton.next_power_of_2(self.kw // cfg.block_w),
            num_warps=cfg.warps, **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
        )  # fmt: skip
        return y


def candidates(n: int, kw: int, num_sms: int) -> list[RingConfig]:
    """Launch shapes: rows a tile, stages, programs per SM, and K splits (the f16x2 default's for the narrow
    layers, so that enough items go round)."""
    split = default_half2_config(n, kw, num_sms).split_k
    bns = [int(v) for v in os.environ.get("BNS", "32 64").split()]
    stages = [int(v) for v in os.environ.get("STAGES", "4 8").split()]
    progs = [int(v) for v in os.environ.get("PROGS", "1 2").split()]
    warps = [int(v) for v in os.environ.get("WARPS", "4 8").split()]
    caps = [int(v) or None for v in os.environ.get("MAXNREG", "0").split()]  # 0: no cap
    splits = sorted({split, max(1, split // 2)}) if os.environ.get("HALF_SPLITS") else [split]
    out = []
    for bn, st, pp, w, sk, cap in itertools.product(bns, stages, progs, warps, splits, caps):
        if kw % (32 * sk) == 0:
            cfg = RingConfig(block_n=bn, stages=st, split_k=sk, programs_per_sm=pp, warps=w)
            out.append(replace(cfg, max_registers=cap))
    return out


def offline() -> None:
    """Compile the kernel for sm_90 without a GPU (Triton's own ptxas) and print its resources."""
    from ptx_counts import registers, sass_counts  # beside this script
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    for cfg in (RingConfig(), RingConfig(64), RingConfig(split_k=8), RingConfig(64, max_registers=128)):
        layout = gl.NVMMASharedLayout.get_default_for([cfg.block_n, cfg.block_w], gl.int32)
        sig = {"w_desc": f"tensordesc<i32[{cfg.block_n}, {cfg.block_w}],{layout!r}>", "pt_ptr": "*i32"}
        sig |= {"s_ptr": "*fp16", "z_ptr": "*u8", "y_ptr": "*bf16" if cfg.split_k == 1 else "*fp32"}
        sig |= {n: "i32" for n in ("N", "stride_sn", "n_items", "n_kt", "n_quads")}
        const = dict(SPLIT=cfg.split_k, STAGES=cfg.stages, WARPS=cfg.warps, GROUP_W=16, NKT_PAD=16)
        src = GluonASTSource(
            fn=_ring_kernel, signature=sig | {k: "constexpr" for k in const}, constexprs=const
        )
        opts = dict(num_warps=cfg.warps) | ({"maxnreg": cfg.max_registers} if cfg.max_registers else {})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        n_sass, ops = sass_counts(k)
        top = ", ".join(
            f"{op} {ops[op]}" for op in ("LDS", "LDG", "BAR", "SYNCS", "UTMALDG", "LOP3", "HFMA2")
        )
        print(f"{cfg}: {k.metadata.shared} B shared, {registers(k)} registers, SASS {n_sass}: {top}")


def label(cfg: RingConfig) -> str:
    out = f"ring {cfg.block_n}x{cfg.block_w} st{cfg.stages} split{cfg.split_k} {cfg.programs_per_sm}/SM"
    return out + f" {cfg.warps}w" + (f" <={cfg.max_registers} regs" if cfg.max_registers else "")


def prepare(cfg: RingConfig, qw, copies, pairs, ws):
    """(one launch, every copy's launch) of `cfg` (see `sweep_against_f16x2`)."""
    pt = pairs_transposed(pairs)
    y = torch.empty(
        1, qw.shape[0], device=pt.device, dtype=torch.bfloat16 if cfg.split_k == 1 else torch.float32
    )
    runs = [RingGemv(c, cfg, ws.num_sms) for c in copies]

    def calls() -> None:
        for r in runs:
            r(pt, y)

    return (lambda: runs[0](pt, y)), calls


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "int4_ring_gemv.json"
    sweep_against_f16x2(SHAPES, candidates, prepare, label, out)


if __name__ == "__main__":
    offline() if os.environ.get("OFFLINE") else main()
