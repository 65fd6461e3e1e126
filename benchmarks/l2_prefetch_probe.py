"""Can the small kernels of a batch-1 decode step pull the next GEMV's weights into the L2?

Between the weight GEMVs of a decode step, HBM idles: the norms, the KV write and decode attention read a
few KB. If those kernels issued L2 prefetches of the next projection's weights (fire and forget), the GEMV
would find part of its bytes in the L2 and stream less from HBM.

This probe builds one qwen2.5-7b decode layer's shape 28 times (qwick's bf16 GEMVs at M = 1) with a
compute-only "small kernel" of about the real one's length before each GEMV (2 us before QKV, gate/up and
down; 6 us before o_proj, where attention runs), and replays it in a CUDA graph:

    gemv only / spin only        the four GEMVs per layer alone; the small kernels alone
    no prefetch                  both, the small kernels prefetching nothing (the reference)
    o gemv twice                 o_proj's GEMV run twice in a row: the second finds its weights in the L2
    bulk <MB> p<P>               each small kernel, run as P programs, issues `cp.async.bulk.prefetch.L2`
                                 of the first <MB> of the next weight
    line 2 p<P>                  the same with one `prefetch.global.L2::evict_last` per 128-byte line
    o only 24 p<P>               only the kernel before o_proj prefetches (24 MB of its 25.7)
    side o p<P>                  o_proj's weights prefetched by a kernel on a parallel branch of the graph
    spin+bulk <MB> p<P>          the prefetching small kernels alone (how long the prefetch holds them)

us per layer (replay / 28) and the saving against "no prefetch". argv[1]: JSON out.
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from qwick.kernels.gemv import gemv, shared_workspace  # noqa: E402

LAYERS = 28
HIDDEN, INTER, QKV = 3584, 18944, 4608


@triton.jit
def _prefetch_l2(addr, nbytes, pid, nprog, LANES: tl.constexpr, CHUNK: tl.constexpr, BULK: tl.constexpr):
    """Program `pid` of `nprog` prefetches its share of [addr, addr + nbytes) into the L2: CHUNK bytes per
    lane, LANES lanes per program, strided over the programs."""
    lane = tl.arange(0, LANES)
    step = nprog * LANES * CHUNK
    for base in range(0, nbytes, step):
        start = base + (pid * LANES + lane).to(tl.int64) * CHUNK
        size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
        if BULK:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
                "mov.u32 $0, 0; }",
                "=r,l,r",
                [addr + start, size],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        else:
            for line in range(0, CHUNK, 128):
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; "
                    "mov.u32 $0, 0; }",
                    "=r,l,r",
                    [addr + start + line, size - line],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )


@triton.jit
def _spin_kernel(out_ptr, iters, pf_addr, pf_bytes, PF: tl.constexpr, BULK: tl.constexpr):
    pid = tl.program_id(0)
    if PF:
        _prefetch_l2(pf_addr, pf_bytes, pid, tl.num_programs(0), 128, 16384, BULK)
    x = tl.arange(0, 128).to(tl.float32)
    for _ in range(iters):
        x = x * 0.999 + 1.0
    tl.store(out_ptr + pid * 128 + tl.arange(0, 128), x)


def spin(out, iters, weight=None, nbytes=0, bulk=True, programs=32):
    _spin_kernel[(programs,)](
        out,
        iters,
        weight.data_ptr() if weight is not None else 0,
        nbytes,
        PF=weight is not None and nbytes > 0,
        BULK=bulk,
        num_warps=4,
    )


def main() -> None:
    dev = torch.device("cuda")
    ws = shared_workspace(dev)
    gen = torch.Generator(device=dev).manual_seed(0)

    def w(n, k):
        return torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02

    shapes = ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))
    layers = [tuple(w(n, k) for n, k in shapes) for _ in range(LAYERS)]
    x = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    xi = torch.randn(1, INTER, device=dev, dtype=torch.bfloat16)
    out = torch.empty(32 * 128, device=dev)

    # Iterations for ~2 us and ~6 us spins, found by timing.
    def time_spin(iters):
        g = torch.cuda.CUDAGraph()
        spin(out, iters)
        with torch.cuda.graph(g):
            for _ in range(100):
                spin(out, iters)
        return replay_us(g) / 100

    def replay_us(g, reps=20):
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000)
        times.sort()
        return times[len(times) // 2]

    calib = {it: time_spin(it) for it in (50, 200, 800, 2000)}
    print("spin calibration (iters: us):", {k: round(v, 2) for k, v in calib.items()}, flush=True)
    per_iter = (calib[2000] - calib[200]) / 1800
    base = calib[200] - 200 * per_iter
    short_it = max(1, int((2.0 - base) / per_iter))
    long_it = max(1, int((6.0 - base) / per_iter))

    side = torch.cuda.Stream()

    def layer_step(
        prefetch_mb, bulk, spins=True, gemvs=True, programs=32, o_mb=None, side_o=False, o_twice=False
    ):
        for qkv, o, gu, d in layers:
            if side_o:  # o_proj's weights prefetched by a kernel on a parallel branch of the graph
                ev = torch.cuda.Event()
                ev.record()
                side.wait_event(ev)
                with torch.cuda.stream(side):
                    spin(out, 1, o, o.numel() * 2, True, programs)
            mb = int(prefetch_mb * (1 << 20))
            o_bytes = min(int((prefetch_mb if o_mb is None else o_mb) * (1 << 20)), o.numel() * 2)
            # (weight, the small kernel's length before its GEMV, bytes it prefetches, the GEMV's input)
            stages = ((qkv, short_it, min(mb, qkv.numel() * 2), x), (o, long_it, o_bytes, x))
            stages += ((gu, short_it, mb, x), (d, short_it, mb, xi))
            for weight, iters, nbytes, inp in stages:
                if spins:
                    spin(out, iters, weight, nbytes, bulk, programs)
                if gemvs:
                    gemv(inp, weight, None, ws)
                    if o_twice and weight is o:
                        gemv(inp, weight, None, ws)
        if side_o:
            torch.cuda.current_stream().wait_stream(side)

    variants = {
        "gemv only": dict(prefetch_mb=0, bulk=True, spins=False),
        "spin only": dict(prefetch_mb=0, bulk=True, gemvs=False),
        "no prefetch": dict(prefetch_mb=0, bulk=True),
    }
    variants["o gemv twice"] = dict(prefetch_mb=0, bulk=True, o_twice=True)
    for programs in (8, 32, 132):
        for mb in (0.5, 2, 8):
            variants[f"bulk {mb} p{programs}"] = dict(prefetch_mb=mb, bulk=True, programs=programs)
        variants[f"line 2 p{programs}"] = dict(prefetch_mb=2, bulk=False, programs=programs)
        variants[f"o only 24 p{programs}"] = dict(prefetch_mb=0, o_mb=24, bulk=True, programs=programs)
        variants[f"side o p{programs}"] = dict(prefetch_mb=0, bulk=True, programs=programs, side_o=True)
        variants[f"spin+bulk 8 p{programs}"] = dict(prefetch_mb=8, bulk=True, programs=programs, gemvs=False)
        variants[f"spin+bulk 0.5 p{programs}"] = dict(
            prefetch_mb=0.5, bulk=True, programs=programs, gemvs=False
        )
    graphs = {}
    for name, kw in variants.items():
        layer_step(**kw)  # compile outside capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            layer_step(**kw)
        graphs[name] = g
    results: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(3):  # rounds, variants interleaved
        for name, g in graphs.items():
            results[name].append(replay_us(g) / LAYERS)
    report = {name: sorted(v)[1] for name, v in results.items()}
    ref = report["no prefetch"]
    weight_bytes = 2 * HIDDEN * (QKV + HIDDEN + 2 * INTER + INTER)
    print(f"short spin {short_it} iters, long {long_it}; us per layer (median of 3 rounds):")
    for name, us in report.items():
        alone = name in ("gemv only", "spin only") or name.startswith("spin+")
        extra = "" if alone else f"  saving {ref - us:+.2f} us"
        print(f"  {name:20s} {us:8.2f}{extra}")
    print(f"gemv only: {weight_bytes / report['gemv only'] / 1e6:.2f} TB/s")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"us_per_layer": report, "rounds": results, "calib": calib}, f, indent=1)


if __name__ == "__main__":
    main()
