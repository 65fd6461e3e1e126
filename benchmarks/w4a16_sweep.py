"""W4A16 kernel vs bf16 (cuBLAS and our GEMV) at qwen2.5-7b shapes: decode M = 1..16 sweeps launch configs,
prefill M > 16 against dequantize + cuBLAS. Random int4 weights (RTN of random bf16): speed does not depend
on the values. Writes $OUT/w4a16_sweep.json (or ./w4a16_sweep.json)."""

import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.getcwd())
from qwick.kernels.gemv import GemvWorkspace, gemv  # noqa: E402
from qwick.kernels.w4a16 import QuantGemvConfig, default_config, quant_matmul  # noqa: E402
from qwick.quantization.formats import rtn  # noqa: E402
from qwick.quantization.formats.layout import dequantize  # noqa: E402

dev = torch.device("cuda")
ws = GemvWorkspace(dev, max_elems=1 << 24)
SHAPES = {"7b.qkv": (4608, 3584), "7b.o": (3584, 3584), "7b.gate_up": (37888, 3584), "7b.down": (3584, 18944)}
MS = [int(v) for v in os.environ.get("MS", "1,4,16").split(",")]
PREFILL_MS = [int(v) for v in os.environ.get("PREFILL_MS", "128,512,2048").split(",")]
SWEEP = os.environ.get("SWEEP", "1") == "1"


def bench(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


grid = [
    QuantGemvConfig(bn, bk, sk, nw, ns)
    for bn, bk, sk, nw, ns in itertools.product((32, 64, 128), (128, 256, 512), (1, 2, 4, 8), (4,), (3, 4))
    if not (bn == 128 and bk == 512)
]
prefill_grid = [
    QuantGemvConfig(128, 128, 1, 8, 3, block_m=64),
    QuantGemvConfig(64, 128, 1, 4, 3, block_m=64),
    QuantGemvConfig(128, 256, 1, 8, 3, block_m=64),
    QuantGemvConfig(128, 128, 1, 8, 3, block_m=128),
    QuantGemvConfig(256, 128, 1, 8, 3, block_m=64),
]
report = {"device": torch.cuda.get_device_name(), "decode": [], "prefill": []}
for name, (n, k) in SHAPES.items():
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    qw = rtn.quantize(w)
    qbytes = qw.nbytes
    for m in MS:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        t_cublas = bench(lambda x=x, w=w: F.linear(x, w))
        t_gemv = bench(lambda x=x, w=w: gemv(x, w, None, ws))
        cfg0 = default_config(m, n, k, 4, ws.num_sms)
        t_default = bench(lambda x=x, c=cfg0, qw=qw: quant_matmul(x, qw, None, ws, c))
        best = (t_default, cfg0)
        if SWEEP:
            for cfg in grid:
                try:
                    t = bench(lambda x=x, c=cfg, qw=qw: quant_matmul(x, qw, None, ws, c))
                except Exception as e:  # noqa: BLE001 (a config that does not compile: skip it)
                    print("skip", cfg, type(e).__name__, str(e)[:100], flush=True)
                    continue
                if t < best[0]:
                    best = (t, cfg)
        row = {
            "shape": name,
            "n": n,
            "k": k,
            "m": m,
            "cublas_bf16_us": t_cublas * 1e3,
            "gemv_bf16_us": t_gemv * 1e3,
            "w4a16_default_us": t_default * 1e3,
            "w4a16_default_cfg": cfg0.__dict__,
            "w4a16_best_us": best[0] * 1e3,
            "w4a16_best_cfg": best[1].__dict__,
            "w4a16_default_GBps": qbytes / t_default / 1e6,
            "w4a16_best_GBps": qbytes / best[0] / 1e6,
            "bf16_gemv_GBps": n * k * 2 / t_gemv / 1e6,
        }
        report["decode"].append(row)
        print(json.dumps(row), flush=True)
    for m in PREFILL_MS:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        t_cublas = bench(lambda x=x, w=w: F.linear(x, w))
        t_deq = bench(lambda x=x, qw=qw: F.linear(x, dequantize(qw, torch.bfloat16)))
        timings = {}
        for cfg in prefill_grid:
            try:
                timings[str(cfg.__dict__)] = (
                    bench(lambda x=x, c=cfg, qw=qw: quant_matmul(x, qw, None, ws, c)) * 1e3
                )
            except Exception as e:  # noqa: BLE001
                print("skip", cfg, type(e).__name__, str(e)[:100], flush=True)
        row = {
            "shape": name,
            "m": m,
            "cublas_bf16_us": t_cublas * 1e3,
            "dequant_then_cublas_us": t_deq * 1e3,
            "w4a16_us": timings,
        }
        report["prefill"].append(row)
        print(json.dumps(row), flush=True)

out = os.path.join(os.environ.get("OUT", "."), "w4a16_sweep.json")
with open(out, "w") as f:
    json.dump(report, f, indent=1)
