"""Why is prefill attention slow behind a long cached prefix? The Triton extend kernel on one row of 8192
new tokens after 0 / 8192 / 24576 cached ones (the chunks of a 32k prompt), qwen2.5-7b heads (28 / 4,
d128), with its pages:

    tight     just the row's pages in a small pool, shuffled (as `attention_bench --prefill`)
    big seq   consecutive pages of a pool as large as a serving KV cache (GB below)
    big rand  pages drawn at random from that pool

us per call and TFLOP/s, beside torch SDPA on dense K/V. argv[1]: pool GB (default 48).

    SWEEP=1 python benchmarks/extend_prefix_probe.py

times the kernel's launch shapes instead (tight pools) at 0+2048, 0+8192 and 24576+8192.
"""

import math
import os
import random
import sys
from functools import partial

import torch

sys.path.insert(0, os.getcwd())
from qwick.bench.attention_bench import _prefill_flops, _time_ms, prefill_case, sdpa_case  # noqa: E402
from qwick.layers.attention.backend import AttentionRow  # noqa: E402
from qwick.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 28, 4, 128, 16
if os.environ.get("SWEEP"):
    cases = ((0, 2048), (0, 8192), (24576, 8192))
    print(f"{'BLOCK_M, BLOCK_N, warps, stages':>32} " + " ".join(f"{f'ctx{c}+{n}':>16}" for c, n in cases))
    for bm, bn, w, st in (
        (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4),
        (128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 3), (128, 32, 8, 4),
    ):  # fmt: skip
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
        cells = [prefill_case(c, n, torch.bfloat16, cfg) for c, n in cases]
        print(f"{str((bm, bn, w, st)):>32} " + " ".join(f"{x:>16}" for x in cells), flush=True)
    print(f"{'torch sdpa':>32} " + " ".join(f"{sdpa_case(c, n, torch.bfloat16):>16}" for c, n in cases))
    sys.exit(0)
pool_gb = float(sys.argv[1]) if len(sys.argv) > 1 else 48.0
dev = torch.device("cuda")
dtype = torch.bfloat16
page_bytes = 2 * BLOCK * KV_HEADS * HEAD_DIM * 2
pool_pages = int(pool_gb * 2**30 / page_bytes)
big = torch.empty(2, pool_pages, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device=dev)
tri = TritonAttentionBackend(BLOCK, dev)
print(f"pool {pool_pages} pages ({pool_gb} GB); extend config {tri._extend_cfg(HEAD_DIM, 2, 8192)}")
for ctx, new in ((0, 8192), (8192, 8192), (24576, 8192), (8192, 512)):
    nb = math.ceil((ctx + new) / BLOCK)
    q = torch.randn(new, HEADS, HEAD_DIM, device=dev, dtype=dtype)
    k = torch.randn(new, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
    v = torch.randn(new, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
    tight = torch.randn(2, nb + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device=dev)
    shuffled = list(range(1, nb + 1))
    random.Random(0).shuffle(shuffled)
    layouts = {
        "tight": (tight, shuffled),
        "big seq": (big, list(range(1, nb + 1))),
        "big rand": (big, random.Random(1).sample(range(pool_pages), nb)),
    }
    cells = []
    for name, (cache, table) in layouts.items():
        md = tri.build_metadata([AttentionRow(ctx, new, table)])
        ms = _time_ms(partial(tri.forward, q, k, v, cache, md, scale=HEAD_DIM**-0.5, sliding_window=None), 5)
        cells.append(f"{name} {1000 * ms:9.1f} us [{_prefill_flops(ctx, new) / ms / 1e9:4.0f}]")
    sdpa = sdpa_case(ctx, new, dtype)
    print(f"ctx {ctx:>5} + {new:>4}: " + "  ".join(cells) + f"  sdpa {sdpa}", flush=True)
