"""int4 weights at 2 <= M <= 512 rows (decode batches, short prefills), qwen2.5-7b (or 14b) shapes, RTN int4
group 128 with zero points, us per call on the GPU (20 calls in one CUDA graph, replayed three times):

- dequantize-then-cuBLAS (one Triton kernel writing the layer in bf16, then cuBLAS);
- "default": what `PackedLinearMethod` runs for these rows (`production`);
- with OLD=1, the decode kernel `quant_matmul` at its M > 16 shapes (2-20x slower in the fifteenth
  session); with DTYPE=float16 (fp16 activations), the tiled kernel's default launch with the codes
  decoded in packed fp16 math (`half_decode`), and whether its output equals the fp32 decode's;
- "tiled": the tiled W4A16 kernel (`w4_tiled_matmul`) at its default launch shape (`tiled_w4_config`),
  then at the best of the reshape-into-K-order shapes and at the best of a sweep of nibble-pair-dot
  shapes (BLOCK_M x BLOCK_N, splits, stages; 16-row tiles only up to 16 rows), with the best nibble
  shape printed per row.

    [OLD=1] [DTYPE=float16] [SHAPE=qwen2.5-14b] [MS="2 4 8 16"] python benchmarks/w4a16_mid_m.py
    # MS by default: "32 64 128 256 512"
"""

import os
import sys

sys.path.insert(0, os.getcwd())  # run from the repository root
import torch
import torch.nn.functional as F

from qwick.bench.gpu_timing import graph_us
from qwick.kernels.gemv import GemvWorkspace
from qwick.kernels.w4a16 import QuantGemvConfig, TiledW4Config, dequantize_int4, quant_matmul, w4_tiled_matmul
from qwick.quantization.formats import rtn
from qwick.quantization.int4 import PackedLinearMethod

SHAPES = {  # SHAPE=qwen2.5-14b: that model's layers
    "qwen2.5-7b": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)},
    "qwen2.5-14b": {"qkv": (7168, 5120), "o": (5120, 5120), "gate_up": (27648, 5120), "down": (5120, 13824)},
}[os.environ.get("SHAPE", "qwen2.5-7b")]
MS = [int(m) for m in os.environ.get("MS", "32 64 128 256 512").split()]
DTYPE = getattr(torch, os.environ.get("DTYPE", "bfloat16"))  # float16: also the packed fp16 decode
OLD = {  # the decode kernel's launch shapes for M > 16
    "old bm64": QuantGemvConfig(128, 128, 1, num_warps=8, num_stages=3, block_m=64),
    "old bm32": QuantGemvConfig(128, 128, 1, num_warps=4, num_stages=3, block_m=32),
}
RESHAPE = [TiledW4Config(64, 128, 16, split) for split in (1, 2, 4)]  # the 15th session's sweep's best
NIBBLE = [
    TiledW4Config(bm, bn, 16, split, 4, stages, nibble_dots=True)
    for bm in (16, 32, 64)
    for bn in (64, 128)
    for split in (2, 4)
    for stages in (3, 4)
] + [  # one 128-row tile: the codes decoded once for up to 128 rows (8 warps: 4 spill)
    TiledW4Config(128, 128, 16, split, 8, stages, nibble_dots=True) for split in (1, 2) for stages in (2, 3)
]


def production(x: torch.Tensor, w) -> torch.Tensor:
    """What `PackedLinearMethod` runs for these rows (groups of 128 codes, M >= 2), on the sweep's 16M-float
    workspace: serving's 8M one runs gate/up at 65-128 rows unsplit (133 against 136 us split in two,
    `benchmarks/int4_eager_host.py`)."""
    m, p = x.shape[0], PackedLinearMethod
    large = w.shape[0] * w.shape[1] >= p.tiled_min_codes_above_64
    if p.tiled_min_m <= m <= p.tiled_max_m and (m <= 64 or large):
        return w4_tiled_matmul(x, w, None, ws, half_decode=p.tiled_half_decode)
    if m <= 16:
        return quant_matmul(x, w, None, ws)
    return F.linear(x, dequantize_int4(w, x.dtype))


ws = GemvWorkspace(torch.device("cuda"), max_elems=1 << 24)
torch.manual_seed(0)
old = OLD if os.environ.get("OLD") == "1" else {}
print(
    f"{'layer':>8} {'M':>5} {'dequant+cuBLAS':>15} {'default':>8} "
    + " ".join(f"{n:>9}" for n in [*old, *(["fp16 math"] if DTYPE is torch.float16 else [])]),
    end="",
)
print(
    f" {'tiled':>8} {'reshape':>8} {'nibble':>8}  best nibble shape, rel. diff",
    flush=True,
)


def _short(cfg: TiledW4Config | None) -> str:
    if cfg is None:
        return "-"
    return f"{cfg.block_m}x{cfg.block_n} split {cfg.split_k} w{cfg.num_warps} s{cfg.num_stages}"


def _best(configs, m, x, weight):
    best = (float("inf"), None)
    for cfg in configs:
        if cfg.block_m > max(16, 2 * m) or (cfg.block_m == 16 and m > 16):
            continue
        try:
            us = graph_us(lambda c=cfg, x=x, w=weight: w4_tiled_matmul(x, w, None, ws, c))
        except Exception:  # a launch shape the GPU cannot take (shared memory, workspace)
            continue
        if us < best[0]:
            best = (us, cfg)
    return best


for name, (n, k) in SHAPES.items():
    weight = rtn.quantize(torch.randn(n, k, device="cuda", dtype=DTYPE) * 0.02, 128, 4)
    for m in MS:
        x = torch.randn(m, k, device="cuda", dtype=DTYPE)
        ref = F.linear(x, dequantize_int4(weight, x.dtype))
        dq = graph_us(lambda x=x, w=weight: F.linear(x, dequantize_int4(w, x.dtype)))
        default = graph_us(lambda x=x, w=weight: production(x, w))
        cells = []
        for cfg in old.values():
            cells.append(f"{graph_us(lambda c=cfg, x=x, w=weight: quant_matmul(x, w, None, ws, c)):9.1f}")
        tiled = graph_us(lambda x=x, w=weight: w4_tiled_matmul(x, w, None, ws))
        if DTYPE is torch.float16:  # the same launch shape, the codes decoded in packed fp16 math
            half = graph_us(lambda x=x, w=weight: w4_tiled_matmul(x, w, None, ws, half_decode=True))
            y = w4_tiled_matmul(x, weight, None, ws, half_decode=True)
            same = torch.equal(y, w4_tiled_matmul(x, weight, None, ws))
            cells.append(f"{half:9.1f} ({'equal' if same else 'DIFFERENT'})")
        reshape, nibble = _best(RESHAPE, m, x, weight), _best(NIBBLE, m, x, weight)
        y = w4_tiled_matmul(x, weight, None, ws, nibble[1])
        diff = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        print(
            f"{name:>8} {m:>5} {dq:15.1f} {default:8.1f} "
            + " ".join(cells)
            + f" {tiled:8.1f} {reshape[0]:8.1f} {nibble[0]:8.1f}  {_short(nibble[1])}, {diff:.1e}",
            flush=True,
        )
