"""Batch-1 GEMVs with their input kernel fused in (`qwick.kernels.fused_gemv`) against the two launches
they replace, timed as decode runs them: in a CUDA graph, cycling over weight copies that together
overflow the L2. qwen2.5-7b shapes:

- qkv / gate_up: RMSNorm with the residual add (and the per-token codes in the 8-bit modes), then the
  GEMV, against `norm_gemv`;
- down: SiLU-and-mul (grouped codes in the 8-bit modes), then the GEMV, against `silu_gemv`.

Also the GEMV alone on ready inputs, the floor a fused launch would reach if its input cost nothing.
Prints us per call; writes JSON to argv[1].

    python benchmarks/fused_gemv_graph.py out.json [bf16 fp8 int8]

CONFIGS="bn,bk,split,warps,stages;..." also times the fused kernels at those launch shapes.
"""

import functools
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from qwick.bench.gpu_timing import graph_us  # noqa: E402
from qwick.kernels.elementwise import rms_norm, silu_and_mul  # noqa: E402
from qwick.kernels.fused_gemv import norm_gemv, silu_gemv  # noqa: E402
from qwick.kernels.gemv import GemvConfig, gemv, shared_workspace  # noqa: E402
from qwick.layers.linear import RowQuant  # noqa: E402
from qwick.quantization.w8a8 import FP8_DTYPE, qmax, quantize_weight_per_channel  # noqa: E402

LAYERS = {"qkv": (4608, 3584, "norm"), "gate_up": (37888, 3584, "norm"), "down": (3584, 18944, "silu")}
L2_BYTES = 120 << 20
EPS = 1e-6


def weights(mode: str, n: int, k: int, dev: torch.device):
    copies = max(2, -(-L2_BYTES // (n * k * (2 if mode == "bf16" else 1))))
    if mode == "bf16":
        return [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)], None, None
    qdtype = FP8_DTYPE if mode == "fp8" else torch.int8
    wq, ws = quantize_weight_per_channel(torch.randn(n, k, device=dev) * 0.02, qdtype)
    return [wq.clone() for _ in range(copies)], ws.view(-1), RowQuant(qdtype, qmax(qdtype), 1e-10)


def case(mode: str, name: str, ws, extra: list[GemvConfig]) -> dict:
    """us per call of one layer's unfused pair, its GEMV alone and the fused launch (at `extra` too)."""
    n, k, form = LAYERS[name]
    dev = ws.partials.device
    ws_list, wscale, quant = weights(mode, n, k, dev)
    g = (torch.rand(k, device=dev) + 0.5).to(torch.bfloat16)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    res = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(1, 2 * k, device=dev, dtype=torch.bfloat16)
    codes = quant is not None
    group_quant = RowQuant(quant.dtype, quant.qmax, quant.min_amax, 512) if codes else None
    kw = dict(weight_scale=wscale)
    if codes:
        kw["out_dtype"] = torch.bfloat16
    per_graph = max(len(ws_list), 8)

    def unfused(w):
        if form == "norm":
            h = rms_norm(x, g, EPS, residual=res, quant=quant)
        else:
            h = silu_and_mul(gu, quant=group_quant)
        if not codes:
            return gemv(h, w, None, ws, **kw)
        extra_kw = {"x_group": 512} if form == "silu" else {}
        return gemv(h.codes, w, None, ws, x_scale=h.scales, **kw, **extra_kw)

    unfused(ws_list[0])  # compiles
    if form == "norm":
        h = rms_norm(x, g, EPS, residual=res.clone(), quant=quant)
    else:
        h = silu_and_mul(gu, quant=group_quant)

    def alone(w):
        if not codes:
            return gemv(h, w, None, ws, **kw)
        extra_kw = {"x_group": 512} if form == "silu" else {}
        return gemv(h.codes, w, None, ws, x_scale=h.scales, **kw, **extra_kw)

    def fused(w, cfg=None):
        if form == "norm":
            return norm_gemv(x, res, g, EPS, w, ws, wscale, None, quant, cfg)
        return silu_gemv(gu, w, ws, wscale, None, quant, cfg)

    def timed(fn):
        cycle = itertools.cycle(ws_list)
        return graph_us(lambda: fn(next(cycle)), calls=per_graph, replays=20)

    row = {"mode": mode, "layer": name, "unfused": timed(unfused), "gemv_alone": timed(alone)}
    row["fused"] = timed(fused)
    for cfg in extra:
        try:
            row[f"fused {cfg}"] = timed(functools.partial(fused, cfg=cfg))
        except Exception as e:  # a shape this Triton cannot build
            print(f"  {mode} {name} {cfg}: {type(e).__name__}: {e}"[:200], flush=True)
    return row


def main() -> None:
    out_path = sys.argv[1]
    modes = sys.argv[2:] or ["fp8", "bf16", "int8"]
    dev = torch.device("cuda")
    ws = shared_workspace(dev)
    extra = [GemvConfig(*map(int, c.split(","))) for c in os.environ.get("CONFIGS", "").split(";") if c]
    results = []
    for mode, name in itertools.product(modes, LAYERS):
        row = case(mode, name, ws, extra)
        results.append(row)
        print(
            f"{mode:5s} {name:8s} unfused {row['unfused']:7.2f}  alone {row['gemv_alone']:7.2f}  "
            f"fused {row['fused']:7.2f} us  "
            + "  ".join(f"{key[6:]} {v:.2f}" for key, v in row.items() if key.startswith("fused ")),
            flush=True,
        )
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
