"""Batch-1 int4 f16x2 GEMV (`qwick.kernels.row_gemv_half2`) with tiles 64 words (512 codes) wide, beside
the default 32-word tiles, at the qwen2.5-7b layer shapes: the 49th session's Nsight Compute sampling of
the gate/up launch (BENCHMARKS.md) put a third of its stalls at the two `bar.sync` of each tile, where the
activation pairs are handed out through shared memory, and another 42% on the code words' loads; a tile
twice as wide pays that exchange once per 1,024 code bytes a program instead of 512, with twice the
bytes in flight a thread. (The sweep of `benchmarks/int4_half2_sweep.py` stopped at 32 words.)
Result on an H100 (49th session): 64-word tiles lose at every shape (gate/up 28.0 us at best against
26.8, down 20.3 against 16.0): 96 registers at 32 rows, so fewer programs resident; 32 words stay.

Each candidate is checked against float64, then timed as decode runs it: CUDA-graph replays over weight
copies that together overflow the L2, reading the `HalfPairs` operand the producer writes. Env SHAPES
(default "qkv o gate_up down") picks the layers. argv[1]: JSON out. With TRITON_INTERPRET=1 on the CPU: a
tiny shape, a smoke test without timings.
"""

import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from int4_half2_sweep import graph_us, layer_inputs, workspace  # noqa: E402  (beside this script)

from qwick.kernels.row_gemv_half2 import default_half2_config, half_pairs, w4_half2_gemv  # noqa: E402

CUDA = torch.cuda.is_available()
ALL_SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
SHAPES = {s: ALL_SHAPES[s] for s in os.environ.get("SHAPES", " ".join(ALL_SHAPES)).split()}
if not CUDA:
    SHAPES = {"tiny": (64, 1024)}
L2_OVERFLOW = 200 << 20


def candidates(n: int, kw: int, num_sms: int) -> list[tuple[str, object]]:
    """The default launch, then 64-word tiles at its rows, warps and prefetch, at half its split (the same
    tiles of K a split), at its split, and at 16 and 64 rows."""
    base = default_half2_config(n, kw, num_sms)
    out = [("default", base)]
    if kw % 64:
        return out
    half = max(1, base.split_k // 2)
    for label, cfg in (
        ("64 words, half the split", replace(base, block_k=64, split_k=half)),
        ("64 words, the same split", replace(base, block_k=64)),
        ("64 words, 16 rows, the same split", replace(base, block_k=64, block_n=16)),
        ("64 words, 16 rows, 2 warps", replace(base, block_k=64, block_n=16, num_warps=2)),
        ("64 words, prefetch off", replace(base, block_k=64, split_k=half, prefetch=False)),
        ("64 words, 8 warps", replace(base, block_k=64, split_k=half, num_warps=8)),
    ):
        if kw // cfg.block_k >= cfg.split_k and all(cfg != c for _, c in out):
            out.append((label, cfg))
    return out


def main() -> None:
    dev = torch.device("cuda" if CUDA else "cpu")
    ws = workspace(dev)
    report = {}
    for name, (n, k) in SHAPES.items():
        qw, x, ref, copies = layer_inputs(n, k, dev)
        pairs = half_pairs(x)
        rows = []
        for label, cfg in candidates(n, k // 8, ws.num_sms):
            out = w4_half2_gemv(x, qw, None, ws, cfg, pairs=pairs).double()
            err = ((out - ref).norm() / ref.norm()).item()
            if err > 4e-3:
                print(f"{name} {label}: relative error {err:.3g}, skipped", flush=True)
                continue

            def calls(cfg=cfg, copies=copies, x=x, pairs=pairs) -> None:
                for c in copies:
                    w4_half2_gemv(x, c, None, ws, cfg, pairs=pairs)

            t = graph_us(calls, len(copies))
            tb_s = qw.nbytes / t / 1e6
            rows.append({"candidate": label, "config": repr(cfg), "us": t, "tb_s": tb_s, "err": err})
            print(f"{name:8s} {label:36s} {t:7.2f} us {tb_s:5.2f} TB/s  {cfg}", flush=True)
        report[name] = rows
    with open(sys.argv[1] if len(sys.argv) > 1 else "int4_wide_tiles.json", "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
