"""Exhaustive check of `qwick.kernels.codes.codes_of`'s division: x times the rounded reciprocal of the
scale, corrected once with two fmas (Markstein), against IEEE division, on the CPU in numpy.

The kernels quantize bf16 or fp16 values at scales absmax * fp32(1 / qmax) with absmax one of those values
(at least 1e-10), so the domain is finite: every value x of either sign up to every absmax, for int8
(qmax 127) and fp8 (448) scales, ~3.8e9 pairs, plus 4.2e8 random fp32 values at each scale. It
counts the quotients that differ from IEEE division and the codes that differ (int8 rounded half to even,
fp8 e4m3 through torch), and prints the largest differing quotient. The 57th session's run: no code
differs; the quotients differ only in bf16 and only below 4.2e-22, where the remainder underflows.

The fp32 fma is Triton's interpreter's (`triton._C.libtriton.interpreter.fma_fp32`, one rounding), as the
GPU's FFMA rounds. About a minute:

    python benchmarks/codes_reciprocal_check.py
"""

import time

import numpy as np
import torch
from triton._C.libtriton import interpreter

MIN_AMAX = np.float32(1e-10)  # qwick.quantization.w8a8._MIN_AMAX


def fma(a: np.ndarray, b: np.ndarray | np.float32, c: np.ndarray) -> np.ndarray:
    return interpreter.fma_fp32(a, np.broadcast_to(np.float32(b), a.shape).copy(), c)


def by_reciprocal(x: np.ndarray, scale: np.float32) -> np.ndarray:
    """`codes_of`'s quotient. Triton's unary minus is 0 - v (+0 for -0 and +0 alike), written so here."""
    inv = np.float32(1.0) / scale
    q0 = x * inv
    return fma(fma(q0, scale, np.float32(0.0) - x), np.float32(0.0) - inv, q0)


def codes(q: np.ndarray, qmax: float) -> np.ndarray:
    q = np.clip(q, -qmax, qmax)
    if qmax == 127.0:
        return np.round(q)  # half to even
    return torch.from_numpy(q).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def positive_values(kind: str) -> np.ndarray:
    """Every finite non-negative bf16 or fp16 value, as fp32."""
    if kind == "fp16":
        return np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    return (np.arange(0, 0x7F80, dtype=np.uint32) << 16).view(np.float32)


def signed(values: np.ndarray) -> np.ndarray:
    """The values and their negatives, -0.0 included (its fp8 code, 0x80, is not +0's)."""
    return np.concatenate([values, -values])


def check_all(kind: str, qmax: float) -> None:
    inv_qmax = np.float32(1.0) / np.float32(qmax)
    values = positive_values(kind)
    pairs = quotients = bad_codes = 0
    largest = 0.0
    start = time.time()
    for amax in values[values >= MIN_AMAX]:
        scale = np.float32(amax * inv_qmax)
        x = signed(values[values <= amax])
        ref, q = x / scale, by_reciprocal(x, scale)
        differ = q.view(np.uint32) != ref.view(np.uint32)
        pairs += x.size
        if differ.any():
            quotients += int(differ.sum())
            largest = max(largest, float(np.abs(ref[differ]).max()))
            bad_codes += int((codes(q, qmax) != codes(ref, qmax)).sum())
    print(
        f"{kind} qmax {qmax:g}: {pairs} pairs, {quotients} quotients differ (largest {largest:.3g}), "
        f"{bad_codes} codes differ ({time.time() - start:.0f} s)",
        flush=True,
    )


def check_random(qmax: float, rows: int = 400) -> None:
    rng = np.random.default_rng(0)
    pairs = quotients = bad_codes = 0
    for _ in range(rows):
        x = (rng.standard_normal(1 << 20) * np.exp(rng.uniform(-30, 30))).astype(np.float32)
        x[:2] = (0.0, -0.0)
        scale = np.float32(max(np.abs(x).max(), MIN_AMAX) * (np.float32(1.0) / np.float32(qmax)))
        ref, q = x / scale, by_reciprocal(x, scale)
        pairs += x.size
        quotients += int((q.view(np.uint32) != ref.view(np.uint32)).sum())
        bad_codes += int((codes(q, qmax) != codes(ref, qmax)).sum())
    print(
        f"random fp32 qmax {qmax:g}: {pairs} values, {quotients} quotients differ, {bad_codes} codes differ"
    )


def main() -> None:
    for kind in ("bf16", "fp16"):
        for qmax in (127.0, 448.0):
            check_all(kind, qmax)
    for qmax in (127.0, 448.0):
        check_random(qmax)


if __name__ == "__main__":
    main()
