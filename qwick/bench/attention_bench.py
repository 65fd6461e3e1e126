"""Micro-benchmark: paged decode attention at qwen2.5-7b shapes, Triton backend vs the PyTorch reference.

    python -m qwick.bench.attention_bench [--batch 1 8 64] [--context 1024 8192 32768] [--json out.json]
                                          [--kv-cache-dtype fp8]

One decode step of one layer (28 query heads, 4 kv heads, head_dim 128, block 16, bf16): the KV write of
the new token plus attention over the whole context, block tables shuffled as in a busy pool. The Triton
step is captured in a CUDA graph (the decode path has no host sync) and replayed, so the figure is device
time; the graph cycles through enough copies of the KV pool (>= 256 MB) that reads come from HBM rather
than the 50 MB L2. Bandwidth = K and V bytes of the context read per step / time, against the 4.3 TB/s
copy bandwidth measured on the H200 (bench.md). The reference runs eagerly (it cannot be captured: it
plans on the host). `--kv-cache-dtype fp8` runs the same steps over an fp8 (e4m3) cache: half the bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics

import torch

from qwick.layers.attention.backend import AttentionRow, kv_cache_torch_dtype, to_kv_layout
from qwick.layers.attention.torch_ref import TorchAttentionBackend

PEAK_TBPS = 4.3
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 28, 4, 128, 16


def _time_ms(fn, iters: int, reps: int = 5) -> float:
    """Median over `reps` of (CUDA-event time of `iters` calls) / iters."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def bench_case(
    batch: int,
    context: int,
    dtype: torch.dtype,
    with_torch: bool,
    configure=None,
    kv_cache_dtype: str = "auto",
    kv_layout: str = "NHD",
) -> dict:
    from qwick.layers.attention.triton_backend import TritonAttentionBackend

    device = torch.device("cuda")
    rng = random.Random(0)
    blocks_per_row = math.ceil(context / BLOCK)
    num_blocks = batch * blocks_per_row + 1
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    rows = [
        AttentionRow(context - 1, 1, ids[i * blocks_per_row : (i + 1) * blocks_per_row]) for i in range(batch)
    ]
    cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
    elt = torch.tensor([], dtype=cache_dtype).element_size()
    kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * elt
    copies = min(64, max(1, math.ceil(256e6 / kv_bytes)))
    caches = [
        to_kv_layout(
            torch.empty(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
            .normal_()
            .to(cache_dtype),
            kv_layout,
        )
        for _ in range(copies)
    ]
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=dtype)
    k = torch.randn(batch, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn(batch, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    scale = HEAD_DIM**-0.5

    tri = TritonAttentionBackend(BLOCK, device)
    if configure is not None:
        configure(tri)
    md = tri.build_metadata(rows)
    splits = tri.num_splits(batch, KV_HEADS, context)

    def triton_step(i: int = 0) -> torch.Tensor:
        return tri.forward(q, k, v, caches[i % copies], md, scale=scale, sliding_window=None)

    out_t = triton_step()  # compiles, and allocates the plan's scratch before capture
    torch.cuda.synchronize()
    result = {"batch": batch, "context": context, "splits": splits, "kv_mb": kv_bytes / 1e6, "copies": copies}

    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(copies):
                triton_step(i)
        graph.replay()
        torch.cuda.synchronize()
        graph_ms = _time_ms(graph.replay, iters=max(2, 64 // copies)) / copies
        result["triton_graph_us"] = 1000 * graph_ms
        result["tbps"] = kv_bytes / (graph_ms * 1e-3) / 1e12
    except Exception as e:  # report, keep going
        result["graph_error"] = repr(e)[:200]
    if configure is not None:  # a sweep: device time only
        caches.clear()
        return result
    cycle = iter(range(10**9))
    result["triton_eager_us"] = 1000 * _time_ms(lambda: triton_step(next(cycle)), iters=2 * copies)

    if with_torch:
        ref = TorchAttentionBackend(BLOCK, device)
        md_r = ref.build_metadata(rows)
        cycle_r = iter(range(10**9))

        def torch_step() -> torch.Tensor:
            cache = caches[next(cycle_r) % copies]
            return ref.forward(q, k, v, cache, md_r, scale=scale, sliding_window=None)

        # the reference reads NHD caches only: an HND run is checked on a copy, and not timed
        out_r = ref.forward(q, k, v, caches[0].contiguous(), md_r, scale=scale, sliding_window=None)
        result["max_abs_diff"] = (out_t.float() - out_r.float()).abs().max().item()
        iters = copies if kv_bytes < 1e9 else 1
        if kv_layout == "NHD":
            result["torch_us"] = 1000 * _time_ms(torch_step, iters=iters, reps=3)
    caches.clear()
    torch.cuda.empty_cache()
    return result


DECODE_SWEEP = [  # (BLOCK_N, num_warps, num_stages)
    (128, 8, 3),
    (128, 8, 2),
    (128, 4, 2),
    (64, 4, 2),
    (64, 8, 2),
    # an fp8 page is half the bytes of a bf16 one: deeper or longer key tiles keep as many bytes in flight
    (128, 8, 4),
    (128, 4, 3),
    (128, 4, 4),
    (256, 8, 2),
    (256, 8, 3),
]
SPLIT_SWEEP = [  # (split_fill, max_num_splits, min_tokens_per_split), with the default kernel config
    (2, 64, 128),
    (4, 128, 128),
    (8, 128, 128),
    (4, 256, 64),
    (8, 256, 64),
    (4, 128, 256),
]
PREFILL_CASES = [(0, 2048), (8192, 512), (0, 8192)]
EXTEND_SWEEP = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (128, 64, 8, 2),
    (128, 128, 8, 2),
    (64, 128, 4, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (64, 128, 4, 3),
    (128, 64, 4, 2),
    (128, 128, 4, 2),
    (64, 64, 4, 4),
]


def sweep(
    dtype: torch.dtype, kv_cache_dtype: str = "auto", prefill: bool = True, kv_layout: str = "NHD"
) -> None:
    """Time kernel meta-parameters (decode: device time per step over a `kv_cache_dtype` cache; prefill:
    TFLOP/s vs torch SDPA). Decode shapes include batch 256 at a 640-token context, the middle of
    workload 3 (100-1024 prompt and output tokens), where attention is a third of the step."""
    shapes = [(1, 1024), (1, 8192), (1, 32768), (8, 8192), (64, 1024), (64, 8192), (256, 640)]
    print(f"\ndecode sweep, KV cache {kv_cache_dtype} in {kv_layout} (us per step; TB/s in brackets)")
    print(f"{'config':>22} " + " ".join(f"{f'b{b}/{c // 1024}k':>15}" for b, c in shapes))
    variants = [
        (f"bn{bn} w{w} s{st}", {"decode_config": dict(BLOCK_N=bn, num_warps=w, num_stages=st)})
        for bn, w, st in DECODE_SWEEP
    ]
    variants += [
        (f"fill{f} max{m} min{t}", {"split_fill": f, "max_num_splits": m, "min_tokens_per_split": t})
        for f, m, t in SPLIT_SWEEP
    ]
    for name, attrs in variants:
        cells = []
        for b, c in shapes:
            try:
                r = bench_case(
                    b,
                    c,
                    dtype,
                    False,
                    lambda t, a=attrs: t.__dict__.update(a),
                    kv_cache_dtype=kv_cache_dtype,
                    kv_layout=kv_layout,
                )
                cells.append(f"{r['triton_graph_us']:7.1f} [{r['tbps']:4.2f}]")
            except Exception as e:
                cells.append(f"{'err ' + type(e).__name__[:10]:>15}")
        print(f"{name:>22} " + " ".join(f"{x:>15}" for x in cells), flush=True)

    if prefill:
        prefill_sweep(dtype, kv_layout)


def prefill_sweep(dtype: torch.dtype, kv_layout: str = "NHD") -> None:
    print("\nprefill sweep: one row, 28/4 heads, d128 (us; TFLOP/s in brackets)")
    cases = PREFILL_CASES
    print(f"{'config':>22} " + " ".join(f"{f'ctx{c}+{n}':>18}" for c, n in cases))
    for bm, bn, w, st in EXTEND_SWEEP:
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
        cells = [prefill_case(c, n, dtype, cfg, kv_layout) for c, n in cases]
        print(f"{f'm{bm} n{bn} w{w} s{st}':>22} " + " ".join(f"{x:>18}" for x in cells), flush=True)
    print(f"{'torch sdpa (dense)':>22} " + " ".join(f"{sdpa_case(c, n, dtype):>18}" for c, n in cases))


def _prefill_flops(context: int, new: int) -> float:
    keys = sum(context + i + 1 for i in range(new))
    return 4.0 * HEADS * HEAD_DIM * keys


def prefill_case(context: int, new: int, dtype: torch.dtype, cfg: dict | None, kv_layout: str = "NHD") -> str:
    from qwick.layers.attention.triton_backend import TritonAttentionBackend

    device = torch.device("cuda")
    total = context + new
    nb = math.ceil(total / BLOCK)
    table = list(range(1, nb + 1))
    random.Random(0).shuffle(table)
    cache = to_kv_layout(
        torch.empty(2, nb + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device=device).normal_(), kv_layout
    )
    q = torch.randn(new, HEADS, HEAD_DIM, device=device, dtype=dtype)
    k = torch.randn(new, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn(new, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    tri = TritonAttentionBackend(BLOCK, device)
    tri.extend_config = cfg
    md = tri.build_metadata([AttentionRow(context, new, table)])
    try:
        ms = _time_ms(lambda: tri.forward(q, k, v, cache, md, scale=HEAD_DIM**-0.5, sliding_window=None), 10)
    except Exception as e:
        return "err " + type(e).__name__[:12]
    return f"{1000 * ms:8.1f} [{_prefill_flops(context, new) / ms / 1e9:5.0f}]"


def sdpa_case(context: int, new: int, dtype: torch.dtype) -> str:
    """Dense causal SDPA over contiguous K/V (GQA expanded): what a non-paged flash kernel achieves."""
    import torch.nn.functional as F

    device = torch.device("cuda")
    total = context + new
    q = torch.randn(1, HEADS, new, HEAD_DIM, device=device, dtype=dtype)
    k = torch.randn(1, HEADS, total, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn(1, HEADS, total, HEAD_DIM, device=device, dtype=dtype)
    if context:  # queries are the last `new` positions: a bottom-right aligned causal mask
        mask = torch.ones(new, total, dtype=torch.bool, device=device).tril(diagonal=context)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ms = _time_ms(fn, 10)
    return f"{1000 * ms:8.1f} [{_prefill_flops(context, new) / ms / 1e9:5.0f}]"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: an e4m3 cache"
    )
    parser.add_argument(
        "--kv-layout",
        default="NHD",
        choices=["NHD", "HND"],
        help="how the cache is stored: NHD (a slot's heads together, the engine's) or HND (a head's slots)",
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--prefill", action="store_true", help="also time prefill attention vs torch SDPA")
    parser.add_argument(
        "--sweep", action="store_true", help="also sweep kernel meta-parameters (prefill ones with --prefill)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_bench needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    print(
        f"decode attention, qwen2.5-7b shapes: {HEADS} q heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
        f"block {BLOCK}, {args.dtype}, KV cache {args.kv_cache_dtype} in {args.kv_layout}; "
        f"{torch.cuda.get_device_name()}"
    )
    header = (
        f"{'batch':>5} {'context':>7} {'splits':>6} {'KV MB':>8} {'triton us':>10} {'TB/s':>6} "
        f"{'% 4.3':>6} {'eager us':>9} {'torch us':>10} {'speedup':>8} {'max diff':>9}"
    )
    print(header)
    print("-" * len(header))
    results = []
    for batch in args.batch:
        for context in args.context:
            r = bench_case(
                batch,
                context,
                dtype,
                with_torch=not args.no_torch,
                kv_cache_dtype=args.kv_cache_dtype,
                kv_layout=args.kv_layout,
            )
            results.append(r)
            t_us = r.get("triton_graph_us", float("nan"))
            tbps = r.get("tbps", float("nan"))
            torch_us = r.get("torch_us", float("nan"))
            print(
                f"{batch:>5} {context:>7} {r['splits']:>6} {r['kv_mb']:>8.1f} {t_us:>10.1f} {tbps:>6.2f} "
                f"{100 * tbps / PEAK_TBPS:>5.0f}% {r['triton_eager_us']:>9.1f} {torch_us:>10.1f} "
                f"{torch_us / t_us:>7.1f}x {r.get('max_abs_diff', float('nan')):>9.2e}",
                flush=True,
            )
            if "graph_error" in r:
                print("   graph capture failed:", r["graph_error"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.prefill:
        print("\nprefill attention, one row, default tiles (us; TFLOP/s in brackets)")
        for c, n in PREFILL_CASES:
            ours, dense = prefill_case(c, n, dtype, None, args.kv_layout), sdpa_case(c, n, dtype)
            print(f"  ctx {c:>5} + {n:>5} new: triton {ours}   sdpa {dense}")
    if args.sweep:
        sweep(dtype, args.kv_cache_dtype, prefill=args.prefill, kv_layout=args.kv_layout)


if __name__ == "__main__":
    main()
