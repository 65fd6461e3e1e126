"""One-row GEMV on 8-bit codes (fp8 e4m3 or int8) against 16-bit activations, on the CUDA cores.

The fp8 o projection at batch 1 is a small layer (12.8 MB at qwen2.5-7b) whose time is mostly fixed
costs. The tensor-core GEMV (`qwick.kernels.gemv`, W8A16) converts each code to bf16 and stages tiles
through shared memory for `tl.dot`; here a program streams [BLOCK_N, BLOCK_K] codes into registers, turns
them into fp32 and multiplies by x with FMAs. fp8 codes go through Triton's conversion (e4m3 pairs to f16
pairs); int8 codes through their float bits (`_int8_f32_asm`), where Triton's `I2F` runs at a quarter of
the FMA rate: 5.80 against 6.92 us a layer at the 7b o projection and int8 batch 1 +1.0% on an H100 (53rd
session). Timed as decode runs it (CUDA-graph replays over
L2-overflowing weight copies, H200, 31st session in BENCHMARKS.md), the 7b o projection takes 7.6 us in
16 x 256 tiles split 4 against the tensor-core kernel's 8.8 in fp8 (int8: 8.4 against 8.2, so int8 keeps
the tensor cores). On qkv and the wide layers the tensor-core kernels stay faster (W8A8 qkv 8.2 us against
9.2 here), and earlier per-launch timings, which include the host's launch gaps, showed no difference.

Split-K and its reduction are `qwick.kernels.gemv`'s epilogue (through `row_gemv`'s), so the kernel
replays in CUDA graphs the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qwick.kernels.gemv import GemvWorkspace, split_k_for
from qwick.kernels.half2 import _EMULATE
from qwick.kernels.pdl import pdl_supported, pdl_wait
from qwick.kernels.row_gemv import RowGemvConfig, _check_workspace, _row_epilogue

CODE_DTYPES = (torch.float8_e4m3fn, torch.int8)


def _int8_f32_asm() -> str:
    """PTX: four int8 codes packed in $4 -> their fp32 values ($0-$3). Code b + 128 (the word xor 0x80808080)
    becomes the low byte of the float bits 0x4B0000xx, which is 2^23 + 128 + b; less 2^23 + 128, b exactly.
    One `prmt` and one `sub.f32` a code, where `cvt.rn.f32.s8` runs at a quarter of their rate."""
    lines = ["{", ".reg .b32 u;", "xor.b32 u, $4, 0x80808080;"]
    for j in range(4):
        lines.append(f"prmt.b32 ${j}, u, 0x4B000000, 0x744{j};")  # bytes: u.b{j}, 0, 0, 0x4B
        lines.append(f"sub.f32 ${j}, ${j}, 0f4B000080;")
    lines.append("}")
    return "\n".join(lines)


_INT8_F32_ASM = tl.constexpr(_int8_f32_asm())
# int8 codes converted through their float bits (`_int8_f32_asm`); False: Triton's conversion (`I2F`). A
# constant read when the kernel compiles, for A/B runs (`gpu_session.sh int8bits`).
_INT8_BITS = tl.constexpr(True)


@triton.jit
def _codes_f32(w):
    """8-bit codes as fp32: int8 through `_int8_f32_asm` (plain Triton under the interpreter), fp8 by
    Triton's conversion (e4m3 pairs to f16 pairs, then each to fp32)."""
    if w.dtype == tl.int8 and _INT8_BITS and not _EMULATE:
        return tl.inline_asm_elementwise(
            _INT8_F32_ASM, "=r,=r,=r,=r,r", [w], dtype=tl.float32, is_pure=True, pack=4
        )
    return w.to(tl.float32)


@triton.jit
def _w8_row_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRELOAD: tl.constexpr,
):
    """y[0, n] = s[n] * sum_k w[n, k] * x[0, k] (+ b[n]); K is a multiple of BLOCK_K, so only rows are
    masked. PRELOAD (launched early, `qwick.kernels.pdl`; not with PREFETCH): the split's first two tiles
    are loaded before `pdl_wait`, the loop does the rest, in the same order."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_loop = k_start
    if PRELOAD:  # codes past the split's end are zeros, against x clamped into the row
        t0 = k_start + rk
        t1 = k_start + BLOCK_K + rk
        w0 = tl.load(w_rows + t0[None, :], mask=n_ok[:, None] & (t0 < k_end)[None, :], other=0.0)
        w1 = tl.load(w_rows + t1[None, :], mask=n_ok[:, None] & (t1 < k_end)[None, :], other=0.0)
    if PRELOAD:
        if not _EMULATE:
            pdl_wait()
        x0 = tl.load(x_ptr + tl.minimum(k_start, K - BLOCK_K) + rk).to(tl.float32)
        acc += _codes_f32(w0) * x0[None, :]
        x1 = tl.load(x_ptr + tl.minimum(k_start + BLOCK_K, K - BLOCK_K) + rk).to(tl.float32)
        acc += _codes_f32(w1) * x1[None, :]
        k_loop = k_start + 2 * BLOCK_K
    if PREFETCH:  # the next tile's load is issued before this tile's arithmetic: twice the bytes in flight
        first = k_start + rk
        w = tl.load(w_rows + first[None, :], mask=n_ok[:, None] & (first < k_end)[None, :], other=0.0)
    for k in range(k_loop, k_end, BLOCK_K):
        x = tl.load(x_ptr + k + rk).to(tl.float32)
        if PREFETCH:
            nxt = k + BLOCK_K + rk
            w_next = tl.load(w_rows + nxt[None, :], mask=n_ok[:, None] & (nxt < k_end)[None, :], other=0.0)
        else:
            w = tl.load(w_rows + (k + rk)[None, :], mask=n_ok[:, None], other=0.0)
        acc += _codes_f32(w) * x[None, :]
        if PREFETCH:
            w = w_next
    acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[:, None]
    _row_epilogue(
        acc, b_ptr, y_ptr, ws_ptr, counter_ptr, rn, n_ok, pid_n, pid_k, N, HAS_BIAS, SPLIT_K, BLOCK_N
    )


def w8_row_block_k(k: int) -> int | None:
    """The tile depth (256 or 128 codes) that divides K, or None: then the kernel does not take it."""
    return next((b for b in (256, 128) if k % b == 0), None)


def default_w8_row_config(n: int, k: int, num_sms: int) -> RowGemvConfig:
    """16 rows x 256 codes per tile (128 where K needs it), K split until about four programs per SM are
    streaming: split 4 at the 7b o projection, the fastest of 24 launch shapes there
    (`GRAPHS=1 MODES=fp8 ONLY=7b.o python benchmarks/row_gemv_sweep.py`)."""
    block_n, block_k = 16, w8_row_block_k(k)
    if block_k is None:
        raise ValueError(f"the 8-bit row GEMV needs K a multiple of 128, got {k}")
    return RowGemvConfig(block_n, block_k, split_k_for(triton.cdiv(n, block_n), k // block_k, num_sms))


def w8_row_gemv(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    ws: GemvWorkspace,
    config: RowGemvConfig | None = None,
    preload: bool = False,
) -> torch.Tensor:
    """`(x @ codes.T) * scale + bias` for one row x [1, K] (bf16/fp16/fp32) and 8-bit codes [N, K] (fp8 e4m3
    or int8, rows contiguous), `scale` fp32 with one value per output channel ([N] or [N, 1]). `preload`
    (a launch without the prefetch): each split's first two tiles are loaded before the kernel waits for
    the one before it, launched early where the device has programmatic dependent launch
    (`qwick.kernels.pdl`); the same sums."""
    n, k = codes.shape
    if x.shape != (1, k) or codes.stride(1) != 1:
        raise ValueError(f"w8_row_gemv needs x [1, {k}] and rows of contiguous codes, got x {tuple(x.shape)}")
    if codes.dtype not in CODE_DTYPES:
        raise ValueError(f"8-bit codes must be float8_e4m3fn or int8, got {codes.dtype}")
    if scale.numel() != n or scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32 with {n} values (one per output channel)")
    cfg = config or default_w8_row_config(n, k, ws.num_sms)
    if k % cfg.block_k:
        raise ValueError(f"K={k} is not a multiple of the tile depth {cfg.block_k}")
    tiles = _check_workspace(ws, n, cfg)
    x = x.contiguous()
    scale = scale.reshape(n)
    preload = preload and not cfg.prefetch
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _w8_row_kernel[(tiles, cfg.split_k)](
        x,
        codes,
        scale,
        bias if bias is not None else scale,
        y,
        ws.partials,
        ws.counters,
        n,
        k,
        codes.stride(0),
        HAS_BIAS=bias is not None,
        SPLIT_K=cfg.split_k,
        PREFETCH=cfg.prefetch,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PRELOAD=preload,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"launch_pdl": True} if preload and pdl_supported(x.device) else {}),
    )
    return y
