"""The PTX of the f16x2 code (the int4 GEMV of `qwick.kernels.row_gemv_half2`, the conversions of
`qwick.kernels.half2`), run by small emulators of the instructions it uses: Triton's interpreter runs no
PTX, so without them the CPU suite would not check the decoding, the packing or the rounding order."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from qwick.kernels.row_gemv_half2 import _dot4_asm


def _f16x2(bits: int) -> np.ndarray:
    return np.array([bits & 0xFFFF, bits >> 16], dtype=np.uint16).view(np.float16)


def _bits(pair: np.ndarray) -> int:
    lo, hi = pair.astype(np.float16).view(np.uint16)
    return int(lo) | (int(hi) << 16)


def run_ptx(asm: str, inputs: dict[int, int]) -> float:
    """Execute the asm block's instructions on 32-bit registers; returns $0 (an fp32 value)."""
    regs: dict[str, object] = {f"${i}": v for i, v in inputs.items()}

    def val(op: str):
        if op.startswith("0x"):
            return int(op, 16)
        return int(op) if op.isdigit() else regs[op]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith("//"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32" and args.startswith("{"):  # split a register into two halves
            lo, hi, src = re.match(r"\{(\w+), (\w+)\}, (\S+)", args).groups()
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        a = [x.strip() for x in args.split(",")]
        if op == "mov.b32":
            regs[a[0]] = val(a[1])
        elif op == "shr.u32":
            regs[a[0]] = val(a[1]) >> int(a[2])
        elif op == "lop3.b32":
            assert a[4] == "0xEA"  # (a & b) | c
            regs[a[0]] = (val(a[1]) & val(a[2])) | val(a[3])
        elif op == "sub.f16x2":
            regs[a[0]] = _bits(_f16x2(val(a[1])).astype(np.float32) - _f16x2(val(a[2])).astype(np.float32))
        elif op == "fma.rn.f16x2":  # one rounding: exact in fp64 for these operands, then to fp16
            x, y, z = (_f16x2(val(r)).astype(np.float64) for r in a[1:])
            regs[a[0]] = _bits(x * y + z)
        elif op == "cvt.f32.f16":
            regs[a[0]] = np.float32(np.array([val(a[1])], dtype=np.uint16).view(np.float16)[0])
        elif op == "add.f32":
            regs[a[0]] = np.float32(val(a[1]) + val(a[2]))
        else:
            raise AssertionError(f"no emulation of {op}")
    return float(regs["$0"])


def test_dot4_sums_the_decoded_products():
    """Four words of eight codes, their sixteen (x_p, x_{p+4}) pairs and a zero point: the asm's sum is
    the sum of (q - z) * x, with one shift per word."""
    asm = _dot4_asm()
    assert asm.count("shr.u32") == 4
    rng = np.random.default_rng(0)
    for _ in range(20):
        codes = rng.integers(0, 16, size=(4, 8))
        z = int(rng.integers(0, 16))
        x = (rng.integers(-64, 64, size=(4, 8)) / 64).astype(np.float16)  # exact in fp16, small sums
        inputs = {1 + k: sum(int(codes[k, p]) << (4 * p) for p in range(8)) for k in range(4)}
        for k in range(4):
            for p in range(4):
                inputs[5 + 4 * k + p] = _bits(np.array([x[k, p], x[k, p + 4]]))
        inputs[21] = _bits(np.array([1024 + z, 1024 + z]))
        inputs[22] = _bits(np.array([-(64 + z), -(64 + z)]))
        expected = float(((codes - z) * x.astype(np.float64)).sum())
        assert run_ptx(asm, inputs) == pytest.approx(expected, abs=1e-2)


def _run_conversion_ptx(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """Execute the conversion PTX of `qwick.kernels.half2` on 32-bit registers; returns every register.
    16-bit halves are split little-endian (`mov.b32 {lo, hi}`, as PTX packs them)."""
    regs: dict[str, object] = dict(inputs)

    def h16(bits: int, dtype: torch.dtype) -> float:
        return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(dtype).float().item()

    for line in asm.strip("{} ").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        if op == "mov.b32" and args.startswith("{"):
            lo, hi, src = re.match(r"\{(\w+), (\w+)\}, (\S+)", args).groups()
            regs[lo], regs[hi] = regs[src] & 0xFFFF, regs[src] >> 16
        elif op in ("cvt.f32.bf16", "cvt.f32.f16"):
            regs[a[0]] = np.float32(h16(regs[a[1]], torch.bfloat16 if op.endswith("bf16") else torch.float16))
        elif op == "mul.rn.f32":
            factor = np.array([int(a[2][2:], 16)], dtype=np.uint32).view(np.float32)[0]
            regs[a[0]] = np.float32(regs[a[1]] * factor)
        elif op == "cvt.rn.f16x2.f32":  # d.hi from the first source, d.lo from the second
            regs[a[0]] = _bits(np.array([regs[a[2]], regs[a[1]]], dtype=np.float32))
        else:
            raise AssertionError(f"no emulation of {op}")
    return regs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quarter_byte_divides_in_fp32_first(dtype):
    """x / 256 to fp16 for a pair of 16-bit floats ($1: element 0 in the low half): the division comes
    before the narrowing, so bf16 values past fp16's 65504 stay finite; small values round as fp16 does."""
    from qwick.kernels.half2 import quarter_byte_asm

    asm = quarter_byte_asm("cvt.f32.bf16" if dtype == torch.bfloat16 else "cvt.f32.f16")
    values = [1.0, -3.5, 1e-3, 300.0, 6e4]
    if dtype == torch.bfloat16:
        values += [7e4, -1.3e5, 3e6, 1.6e7]
    x = torch.tensor(values, dtype=dtype)
    bits = x.view(torch.int16).to(torch.int32) & 0xFFFF
    for i in range(0, len(values) - 1):
        regs = _run_conversion_ptx(asm, {"$1": int(bits[i]) | (int(bits[i + 1]) << 16)})
        got = _f16x2(regs["$0"])
        want = (x[i : i + 2].float() / 256).to(torch.float16).numpy()
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got, want)
