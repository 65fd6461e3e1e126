"""Whole-prompt SDPA at qwen2.5-7b attention shapes: key/value heads repeated to the query heads (a copy)
against `enable_gqa=True` on the unexpanded heads. Times each and checks they agree.

    python benchmarks/sdpa_gqa.py
"""

import torch
import torch.nn.functional as F

heads, kv_heads, dim = 28, 4, 128
g = heads // kv_heads


def run(n: int) -> None:
    q = torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16)

    def repeat():
        kk = k.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
        vv = v.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
        return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kk, vv, is_causal=True)

    def gqa():
        return F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            enable_gqa=True,
        )

    for name, fn in (("repeat", repeat), ("enable_gqa", gqa)):
        for _ in range(3):
            fn()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            fn()
        e.record()
        torch.cuda.synchronize()
        print(f"n={n} {name}: {s.elapsed_time(e) / 20 * 1e3:.1f} us", flush=True)
    print(f"n={n} max |diff| {(repeat() - gqa()).abs().max().item():.4f}", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        gqa()
    print([e.key[:60] for e in prof.key_averages()], flush=True)


for n in (512, 2048, 8192):
    run(n)
