"""One decode row's W8A8 MLP in one launch: gate/up, SiLU-and-mul and down, each program owning a slice of
the intermediate channels.

The unfused batch-1 MLP is three launches (the gate/up GEMV, SiLU-and-mul writing the down projection's
codes, the down GEMV), and the down GEMV cannot start its sums before every gate/up program has ended:
on an H100 the 42nd session's critical path put down ~4 us and SiLU-and-mul ~1.8 us a layer past what
their bytes take. Here a program streams the C gate rows and C up rows of its channels against the
activation codes (tensor cores, the row padded to 16 as `qwick.kernels.gemv` does), forms h = silu(gate)
* up for those C channels in registers, quantizes them at one scale (C = 128: finer than the unfused
path's 512-column groups), and streams down's C columns of them, adding its share of every output to an
accumulator with atomics. No program waits for another. The RMSNorm after reads the accumulator,
rounds it to the model dtype (as the down GEMV rounds its output) and zeroes it (`rms_norm(clear_x=True)`),
so it is zero whenever no layer holds its sum.

The accumulator holds fixed-point integers (int64, units of 2^-24, `SUM_UNIT`): each program's fp32 share
is truncated to a multiple of the unit and added exactly, so the sums do not depend on which program's
atomics land first and every run gives the same bits (fp32 atomics would not). The unit is far below what
the model dtype resolves, and 2^63 units leave room for outputs up to 5e11.

Off by default (`W8A8LinearMethod.fused_mlp_row`): it does not pay end to end. On an H100 at qwen2.5-7b
shapes (BENCHMARKS.md, 50th session), in isolation (benchmarks/fused_mlp_w8.py: CUDA graphs over four
L2-overflowing layer copies, the norm before included on both sides, fp32 atomics) the MLP took 73.7 us
against the three launches' 76.5 (fp8) and 73.4 against 76.6 (int8), the best of 48 launch shapes: C = 128
(148 programs), 128-code gate/up tiles, 256-output down tiles, 4 warps, 3 stages. In the engine, batch 1,
that version gained int8 1.3-1.4% and fp8 0.1-0.2% (one run each, two calls): the step's profile put the
MLP 2.9 us a layer under the three launches, and the norm after it (reading the sums) and decode
attention ~1.8 us over. The fp32 atomics also made the sums' last bits depend on the order they land in.
With the fixed-point sums (the same bits every run) it lost 3.1% (int8) and 2.2% (fp8), one run each:
twice the atomic operations of the fp32 version's paired ones, each 64-bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qwick.kernels.half2 import _EMULATE
from qwick.kernels.pdl import pdl_supported, pdl_trigger, pdl_wait
from qwick.kernels.swiglu import silu_times
from qwick.kernels.w8a8 import codes_of


@dataclass(frozen=True)
class MlpRowConfig:
    channels: int = 128  # intermediate channels per program (C)
    block_k: int = 128  # gate/up tile depth
    block_h: int = 256  # down outputs per tile
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_CONFIG = MlpRowConfig()
SUM_UNIT = 2.0**-24  # the accumulator's integers count this much each


@triton.jit
def _mlp_row_w8_kernel(
    xq_ptr,
    xs_ptr,
    wgu_ptr,
    sgu_ptr,
    wd_ptr,
    sd_ptr,
    sums_ptr,
    K,
    N_INTER,
    H,
    stride_gu,
    stride_d,
    QMAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    PER_UNIT: tl.constexpr,
    INT_DOT: tl.constexpr,
    Y_FP16: tl.constexpr,
    C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PRELOAD: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    """Program p: channels [p C, (p + 1) C). K is a multiple of BLOCK_K, H of BLOCK_H, N_INTER of C.
    PRELOAD (launched early): the first gate/up tile is loaded before `pdl_wait`; TRIGGER: the next
    kernel may launch once the program is past its loops."""
    pid = tl.program_id(0)
    c0 = pid * C
    r = tl.arange(0, 2 * C)
    rows = (r // C) * N_INTER + c0 + r % C  # C gate rows, then the up rows of the same channels
    rm = tl.arange(0, 16)
    m_ok = rm < 1  # the one real row of the 16 the dot takes
    rk = tl.arange(0, BLOCK_K)
    w_rows = wgu_ptr + rows.to(tl.int64)[:, None] * stride_gu
    x_rows = xq_ptr + rm[:, None] * 0
    acc = tl.zeros((16, 2 * C), dtype=tl.int32 if INT_DOT else tl.float32)
    k0 = 0
    if PRELOAD:
        w = tl.load(w_rows + rk[None, :])
        if not _EMULATE:
            pdl_wait()
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, out_dtype=acc.dtype)
        k0 = BLOCK_K
    for k in range(k0, K, BLOCK_K):
        w = tl.load(w_rows + (k + rk)[None, :])
        x = tl.load(x_rows + (k + rk)[None, :], mask=m_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, out_dtype=acc.dtype)
    # gate and up as the unfused GEMV stores them (model dtype), then silu(gate) * up as it computes it
    y = tl.sum(acc.to(tl.float32), axis=0) * tl.load(sgu_ptr + rows) * tl.load(xs_ptr)
    y = y.to(tl.float16) if Y_FP16 else y.to(tl.bfloat16)
    gate, up = tl.split(tl.permute(tl.reshape(y, (2, C)), (1, 0)))
    h = silu_times(gate, up).to(tl.float32)
    h_scale = tl.maximum(tl.max(tl.abs(h), axis=0), MIN_AMAX) / QMAX
    h_codes = codes_of(h, h_scale, QMAX, INT_DOT)
    h_rows = tl.where(m_ok[:, None], h_codes[None, :], 0.0).to(wd_ptr.dtype.element_ty)
    cols = c0 + tl.arange(0, C)
    rh = tl.arange(0, BLOCK_H)
    for j in range(0, H, BLOCK_H):
        t = tl.load(wd_ptr + (j + rh).to(tl.int64)[:, None] * stride_d + cols[None, :])  # [BLOCK_H, C]
        d = tl.dot(h_rows, tl.trans(t), out_dtype=tl.int32 if INT_DOT else tl.float32).to(tl.float32)
        part = tl.sum(d, axis=0) * tl.load(sd_ptr + j + rh) * h_scale
        tl.atomic_add(sums_ptr + j + rh, (part * PER_UNIT).to(tl.int64), sem="relaxed")  # exact, any order
    if TRIGGER and not _EMULATE:
        pdl_trigger()


def mlp_row_fits(inter: int, hidden: int, k: int, config: MlpRowConfig = DEFAULT_CONFIG) -> bool:
    """Whether the launch's tiles divide the shapes (every Qwen2.5 / Qwen3 size from 1.5b up does)."""
    return inter % config.channels == 0 and k % config.block_k == 0 and hidden % config.block_h == 0


def mlp_row_w8(
    xq: torch.Tensor,
    xs: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    sums: torch.Tensor,
    dtype: torch.dtype,
    qmax: float,
    min_amax: float,
    preload: bool = False,
    config: MlpRowConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Add down(silu(gate) * up) of one row to `sums` (int64 [1, H] in units of `SUM_UNIT`, zero before the
    call) and return it.

    xq [1, K]: the row's per-token codes (fp8 e4m3 or int8, the weights' type) at scale xs (fp32 [1, 1]);
    gate_up [2 I, K]: the [gate | up] codes, gate_up_scale fp32 [2 I]; down [H, I] and down_scale [H]
    (per output channel). `dtype`: the model's (bf16 or fp16), which gate and up are rounded to before
    SiLU as the unfused GEMV stores them; `qmax` and `min_amax`: h's codes, as `RowQuant`'s. `preload`:
    launched early (`qwick.kernels.pdl`) with the first gate/up tile loaded before the wait, and letting
    the next kernel in once past the loops."""
    k = xq.shape[1]
    inter, hidden = gate_up.shape[0] // 2, down.shape[0]
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the model dtype must be bf16 or fp16, not {dtype}")
    if xq.shape != (1, k) or xq.dtype != gate_up.dtype or down.dtype != gate_up.dtype:
        raise ValueError("mlp_row_w8 takes one row of codes of the weights' 8-bit type")
    if (
        gate_up.shape[1] != k
        or down.shape[1] != inter
        or sums.shape != (1, hidden)
        or not sums.is_contiguous()
        or sums.dtype != torch.int64
    ):
        raise ValueError(
            f"shapes do not chain: x {xq.shape}, gate_up {gate_up.shape}, down {down.shape}, "
            f"sums {sums.shape} {sums.dtype} (int64, contiguous)"
        )
    if not mlp_row_fits(inter, hidden, k, config):
        raise ValueError(f"{config} does not tile I={inter}, H={hidden}, K={k}")
    if gate_up.stride(1) != 1 or down.stride(1) != 1:
        raise ValueError("weights need contiguous rows")
    pdl = preload and pdl_supported(xq.device)
    _mlp_row_w8_kernel[(inter // config.channels,)](
        xq, xs, gate_up, gate_up_scale, down, down_scale, sums, k, inter, hidden, gate_up.stride(0),
        down.stride(0), QMAX=qmax, MIN_AMAX=min_amax, PER_UNIT=1 / SUM_UNIT,
        INT_DOT=gate_up.dtype == torch.int8, Y_FP16=dtype == torch.float16, C=config.channels,
        BLOCK_K=config.block_k, BLOCK_H=config.block_h, PRELOAD=pdl, TRIGGER=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return sums
