"""Instruction counts in the sm_90 PTX and SASS of qwick's attention and GEMV kernels, compiled without
a GPU.

Triton compiles for a target without a device (ptxas and nvdisasm ship with it). The 16-divisibility a
launch would give pointers and strides is passed as it would be, so the loads vectorize as on the H200.
Counting what the kernels do (byte-wide shared-memory loads, conversions, ldmatrix, mma) finds waste
before device time is spent on it: this is how the fp8 pages' `ld.shared.b8` and the fp16 query overflow
were found. The SASS line counts static instructions (the whole kernel, each loop body once).

    python benchmarks/ptx_counts.py            # every variant below
    python benchmarks/ptx_counts.py decode     # the variants whose name starts with this

Use the device's Triton (3.6) for figures that mean something there: a venv with `pip install
triton==3.6.0 torch==2.13.0` runs this as well.
"""

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.getcwd())
from qwick.kernels.gemv import _gemv_kernel  # noqa: E402
from qwick.kernels.row_gemv_half2 import DOT4_ASM, PAIRED, _w4_half2_kernel  # noqa: E402
from qwick.kernels.row_gemv_w8 import _w8_row_kernel  # noqa: E402
from qwick.kernels.w4a16 import _w4_tiles_kernel  # noqa: E402
from qwick.layers.attention.triton_kernels import decode_kernel, extend_kernel  # noqa: E402

COUNTED = [
    "ld.shared.b8",
    "ld.shared.v2",
    "ld.shared.v4",
    "st.shared.v4",
    "ldmatrix",
    "cp.async.cg",
    "cvt.rn.f16x2.e4m3x2",
    "cvt.bf16.f16",
    "cvt.f32.bf16",
    "mul.f16x2",
    "mma.sync",
    "wgmma.mma_async",
    "wgmma.wait_group",
]
SASS_COUNTED = [
    "LDG",
    "LDS",
    "LDSM",
    "STS",
    "LDGSTS",
    "BAR",
    "F2F",
    "F2FP",
    "I2F",
    "PRMT",
    "HMMA",
    "HGMMA",
    "MUFU",
]
_STRIDES = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_cs", "stride_ch")


def compile_ptx(fn, sig: dict, const: dict, divisible: list[str], num_warps: int, num_stages: int):
    sig = dict(sig) | {k: "constexpr" for k in const}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    opts = dict(num_warps=num_warps, num_stages=num_stages)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def decode(
    fp8: bool,
    block_n: int,
    warps: int,
    stages: int,
    fused: bool = False,
    preload: bool = False,
    apart: bool = False,
):
    kv = "*fp8e4nv" if fp8 else "*bf16"
    sig = {"q_ptr": "*bf16", "k_cache_ptr": kv, "v_cache_ptr": kv, "out_ptr": "*bf16", "mid_o_ptr": "*fp32"}
    sig |= {"mid_lse_ptr": "*fp32", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32"}
    sig |= {"query_start_ptr": "*i32", "rows_ptr": "*i32", "scale_log2": "fp32", "v_scale": "fp32"}
    sig |= {n: "i32" for n in ("num_splits", "window", "group", "stride_qt", "stride_qh", "stride_ot")}
    sig |= {n: "i32" for n in ("stride_oh", "stride_bt", "stride_cb", "stride_cs", "stride_ch")}
    sig |= {n: "i32" for n in ("stride_mo_r", "stride_mo_h", "stride_mo_s", "stride_ml_r", "stride_ml_h")}
    # The step's new keys and values (`FUSED_WRITE`): k, v, slots, the rotary tables, the inverse scales.
    sig |= {"k_ptr": "*bf16", "v_ptr": "*bf16", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    sig |= {"k_inv_scale": "fp32", "v_inv_scale": "fp32", "stride_kt": "i32", "stride_vt": "i32"}
    sig |= {"stride_vh": "i32"}
    const = dict(G_PAD=16, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_N=block_n, DOT_PREC="tf32")
    const |= dict(KV_FP8=fp8, F16_DOT=fp8, HEADS_FIRST=True, FUSED_WRITE=fused)
    # a lone row launched early: reads its first key tile before the wait, lets o in after it
    const |= dict(PDL_TRIGGER=preload, PDL_WAIT=preload, PRELOAD=preload, TRIGGER_LATE=preload)
    const |= dict(NEW_KEY_APART=apart)  # the new key scored apart from the preloaded tile
    div = (
        [n for n in sig if n.endswith("_ptr")]
        + list(_STRIDES)
        + ["stride_mo_r", "stride_mo_h", "stride_mo_s", "stride_kt", "stride_vt", "stride_vh"]
    )
    return compile_ptx(decode_kernel, sig, const, div, warps, stages)


def extend(fp8: bool, stages: int, spare: bool = False):
    kv = "*fp8e4nv" if fp8 else "*bf16"
    sig = {"q_ptr": "*bf16", "k_cache_ptr": kv, "v_cache_ptr": kv, "out_ptr": "*bf16"}
    sig |= {
        "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "query_start_ptr": "*i32",
        "tiles_ptr": "*i32",
    }
    sig |= {"scale_log2": "fp32", "v_scale": "fp32", "window": "i32", "group": "i32"}
    sig |= {n: "i32" for n in ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_bt")}
    sig |= {n: "i32" for n in ("stride_cb", "stride_cs", "stride_ch")}
    const = dict(HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_M=128, BLOCK_N=128, DOT_PREC="tf32")
    const |= dict(KV_FP8=fp8, F16_DOT=fp8, SPARE_TILES=spare)
    div = [n for n in sig if n.endswith("_ptr")] + list(_STRIDES)
    return compile_ptx(extend_kernel, sig, const, div, 8, stages)


def gemv(
    weight: str,
    block_n: int,
    block_k: int,
    split: int,
    stages: int,
    codes: bool = False,
    x_group: int = 0,
    even_k: bool = True,
    codes_group: int = 0,
):
    """W8A16 (bf16 activations), or with `codes` W8A8 as one early-launched decode row runs it (activation
    codes of the weight's type, the first tile preloaded, the trigger past the loop; `x_group`: a scale
    per that many columns, as the down projection's SiLU-and-mul codes). `codes_group`: a gated gate/up
    GEMV writing the down projection's codes in groups of that many outputs
    (`W8A8LinearMethod.gated_decode`)."""
    from qwick.kernels.codes import inv_qmax
    from qwick.quantization.w8a8 import _MIN_AMAX, _QMAX

    w = {"fp8": "*fp8e4nv", "int8": "*i8"}[weight]
    sig = {"x_ptr": w if codes else "*bf16", "w_ptr": w, "s_ptr": "*fp32", "xs_ptr": "*fp32"}
    sig |= {"b_ptr": "*bf16"}
    sig |= {"y_ptr": "*bf16", "ws_ptr": "*fp32", "counter_ptr": "*i32", "amax_ptr": "*fp32"}
    sig |= {"q_ptr": w, "qs_ptr": "*fp32"}
    names = ("M", "N", "K", "stride_xm", "stride_wn", "stride_ym", "stride_xs", "stride_am", "stride_q")
    names += ("stride_qs",)
    sig |= {n: "i32" for n in names}
    int_dot = codes and weight == "int8"  # as `gemv` launches int8 codes, with groups too
    const = dict(HAS_SCALE=True, X_CODES=codes, X_GROUP=x_group, INT_DOT=int_dot, HAS_BIAS=False)
    const |= dict(SPLIT_K=split, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=even_k)
    const |= dict(PRELOAD=codes, TRIGGER=codes)  # as `gemv` launches it
    if codes_group:
        qmax = _QMAX[{"fp8": torch.float8_e4m3fn, "int8": torch.int8}[weight]]
        const |= dict(GATED=True, CODES_GROUP=codes_group, QMAX=qmax, INV_QMAX=inv_qmax(qmax))
        const |= dict(MIN_AMAX=_MIN_AMAX, IS_INT=weight == "int8")
    div = [n for n in sig if n.endswith("_ptr")] + ["N", "K", "stride_xm", "stride_wn", "stride_ym"]
    return compile_ptx(_gemv_kernel, sig, const, div, 4, stages)


def w8row(weight: str = "fp8"):
    """The one-row GEMV on 8-bit codes (CUDA cores) as the 7b o projection runs it: 16 x 256 tiles, split 4,
    launched early (its first two tiles preloaded)."""
    w = {"fp8": "*fp8e4nv", "int8": "*i8"}[weight]
    sig = {"x_ptr": "*bf16", "w_ptr": w, "s_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16"}
    sig |= {"ws_ptr": "*fp32", "counter_ptr": "*i32", "N": "i32", "K": "i32", "stride_wn": "i32"}
    const = dict(HAS_BIAS=False, SPLIT_K=4, PREFETCH=False, BLOCK_N=16, BLOCK_K=256, PRELOAD=True)
    div = [n for n in sig if n.endswith("_ptr")] + ["N", "K", "stride_wn"]
    return compile_ptx(_w8_row_kernel, sig, const, div, 4, 1)


def tiles(block_m: int, nibble: bool, half: bool = False):
    """The tiled W4A16 kernel, 128 outputs by 16-word tiles, zero points per group, K split in four; `half`:
    fp16 activations and scales, decoded in packed fp16 math (else bf16 activations, fp32 math)."""
    act = "*fp16" if half else "*bf16"
    sig = {"x_ptr": act, "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "b_ptr": act}
    sig |= {"y_ptr": act, "ws_ptr": "*fp32", "counter_ptr": "*i32"}
    sig |= {n: "i32" for n in ("M", "N", "KW", "stride_xm", "stride_qn", "stride_sn", "stride_ym")}
    const = dict(ZERO_POINT=8, ZERO_MODE=1, HAS_BIAS=False, GROUP_W=16, SPLIT_K=4, BLOCK_M=block_m)
    const |= dict(BLOCK_N=128, BLOCK_W=16, NIBBLE_DOTS=nibble, HALF_DECODE=half)
    div = [n for n in sig if n.endswith("_ptr") or n in ("N", "KW") or n.startswith("stride")]
    return compile_ptx(_w4_tiles_kernel, sig, const, div, 4, 3)


def half2(
    gated: bool, block_n: int = 32, warps: int = 4, split: int = 1, norm: bool = False, block_w: int = 32
):
    """The batch-1 int4 f16x2 GEMV, reading the producer's pairs: by default at the 7b gate/up launch shape
    (32 x 32 words, one split); `gated`: with SiLU-and-mul and the down projection's pairs in its
    epilogue; `norm`: with the residual add + RMSNorm (and pairs) in its tail, as the o projection runs it;
    `block_w`: words a tile (`benchmarks/int4_wide_tiles.py`)."""
    sig = {"x_ptr": "*i32", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "b_ptr": "*bf16"}
    sig |= {"y_ptr": "*bf16", "ws_ptr": "*fp32", "counter_ptr": "*i32"}
    sig |= {n: "i32" for n in ("N", "KW", "stride_qn", "stride_sn")} | {"p_ptr": "*i32"}
    sig |= {"res_ptr": "*bf16", "nw_ptr": "*bf16", "nout_ptr": "*bf16", "tail_ptr": "*i32", "eps": "fp32"}
    const = dict(ZERO_POINT=0, ZERO_MODE=1, HAS_BIAS=False, SPLIT_K=split, GROUP_W=16, BLOCK_N=block_n)
    const |= dict(BLOCK_W=block_w, XPAIRS=PAIRED.value, DOT4=DOT4_ASM, EMULATE=False, PREFETCH=False)
    const |= dict(GATED=gated, OUT_PAIRS=gated or norm, OUT_INV_DIV=1 / 64, NORM_TAIL=norm)
    const |= dict(NORM_BLOCK=4096 if norm else 1)
    div = [n for n in sig if n.endswith("_ptr") or n in ("N", "KW") or n.startswith("stride")]
    return compile_ptx(_w4_half2_kernel, sig, const, div, warps, 1)


VARIANTS = {
    "decode bf16 (64 keys, 4 warps, 2 stages)": lambda: decode(False, 64, 4, 2),
    "decode fp8 (128 keys, 4 warps, 2 stages)": lambda: decode(True, 128, 4, 2),
    "decode bf16 (128 keys, 8 warps, 3 stages)": lambda: decode(False, 128, 8, 3),
    "decode bf16 writing the new keys (128 keys, 8 warps, 3 stages)": lambda: decode(False, 128, 8, 3, True),
    "decode fp8 writing the new keys (128 keys, 4 warps, 2 stages)": lambda: decode(True, 128, 4, 2, True),
    "decode bf16, a lone row reading early (128 keys, 8 warps, 3 stages)": lambda: decode(
        False, 128, 8, 3, True, True
    ),
    # `DECODE_PRELOAD_TILE`: a short context's keys all read before the wait
    "decode bf16, a lone row reading early (256 keys, 8 warps, 1 stage)": lambda: decode(
        False, 256, 8, 1, True, True
    ),
    # `DECODE_NEW_KEY_APART`: the preloaded tile left as read (staged for the dots before the wait)
    "decode bf16, a lone row reading early, the new key apart (256 keys)": lambda: decode(
        False, 256, 8, 1, True, True, True
    ),
    # the same on 4 warps: half the threads' registers, so that it fits an SM beside a GEMV's programs
    "decode bf16, a lone row reading early, the new key apart (256 keys, 4 warps)": lambda: decode(
        False, 256, 4, 1, True, True, True
    ),
    "decode bf16, a lone row reading early, the new key apart (256 keys, 16 warps)": lambda: decode(
        False, 256, 16, 1, True, True, True
    ),
    "extend bf16 (128 x 128, 2 stages)": lambda: extend(False, 2),
    "extend fp8 (128 x 128, 2 stages)": lambda: extend(True, 2),
    "extend bf16 with spare tiles (a graph's)": lambda: extend(False, 2, spare=True),
    "gemv fp8 W8A16 (32 x 256)": lambda: gemv("fp8", 32, 256, 4, 3),
    "gemv int8 W8A16 (32 x 256)": lambda: gemv("int8", 32, 256, 4, 3),
    # the batch-1 W8A8 launches at 7b shapes (`default_config`): gate/up on 3 stages and on 4, down
    "gemv W8A8 fp8 gate/up (64 x 256, 3 stages)": lambda: gemv("fp8", 64, 256, 1, 3, codes=True),
    "gemv W8A8 fp8 gate/up (64 x 256, 4 stages)": lambda: gemv("fp8", 64, 256, 1, 4, codes=True),
    "gemv W8A8 int8 gate/up (64 x 256, 3 stages)": lambda: gemv("int8", 64, 256, 1, 3, codes=True),
    "gemv W8A8 fp8 down (64 x 256, split 8)": lambda: gemv("fp8", 64, 256, 8, 3, True, 512, False),
    "gemv W8A8 int8 down (64 x 256, split 8)": lambda: gemv("int8", 64, 256, 8, 3, True, 512, False),
    "gemv W8A8 fp8 gate/up, SiLU, group codes": lambda: gemv("fp8", 64, 256, 1, 3, True, codes_group=512),
    "gemv W8A8 int8 gate/up, SiLU, group codes": lambda: gemv("int8", 64, 256, 1, 3, True, codes_group=512),
    "w8 row GEMV fp8 (o, 16 x 256, split 4)": lambda: w8row(),
    "w8 row GEMV int8 (o, 16 x 256, split 4)": lambda: w8row("int8"),
    "half2 int4 GEMV (gate/up, 32 rows)": lambda: half2(False),
    "half2 int4 GEMV with SiLU-and-mul (gate/up, 32 rows)": lambda: half2(True),
    "half2 int4 GEMV (gate/up, 32 rows, 64-word tiles)": lambda: half2(False, block_w=64),
    "half2 int4 GEMV (gate/up, 16 rows, 64-word tiles)": lambda: half2(False, 16, block_w=64),
    "half2 int4 GEMV with SiLU-and-mul (gate/up, 32 rows, 64-word tiles)": lambda: half2(True, block_w=64),
    "half2 int4 GEMV (o, 64 rows, 8 warps, split 8)": lambda: half2(False, 64, 8, 8),
    "half2 int4 GEMV with the norm tail (o, 64 rows, 8 warps, split 8)": lambda: half2(False, 64, 8, 8, True),
    "tiles int4 reshape (64 rows)": lambda: tiles(64, False),
    "tiles int4 nibble-pair dots (32 rows)": lambda: tiles(32, True),
    "tiles int4 nibble-pair dots (16 rows)": lambda: tiles(16, True),
    "tiles int4 nibble-pair dots, fp16 decode (16 rows)": lambda: tiles(16, True, half=True),
}


def _cubin_tool(kernel, tool: str, *args: str) -> str:
    """The output of one of the CUDA binary tools Triton ships on the kernel's cubin."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([path, *args, f.name], capture_output=True, text=True, check=True).stdout


def registers(kernel) -> int:
    """Registers a thread (what, with shared memory, bounds the programs resident on an SM)."""
    return int(re.search(r"REG:(\d+)", _cubin_tool(kernel, "cuobjdump", "--dump-resource-usage")).group(1))


def sass_counts(kernel) -> tuple[int, Counter]:
    """Static SASS instructions of a compiled kernel, in all and by opcode (without modifiers)."""
    sass = _cubin_tool(kernel, "nvdisasm", "-c")
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    return len(ops), Counter(op.split(".")[0] for op in ops)


def main() -> None:
    prefix = sys.argv[1] if len(sys.argv) > 1 else ""
    print(
        f"Triton {triton.__version__}, sm_90 PTX; counts of: {', '.join(COUNTED)}, then shared memory and "
        "registers a thread"
    )
    for name, build in VARIANTS.items():
        if not name.startswith(prefix):
            continue
        kernel = build()
        ptx = kernel.asm["ptx"]
        counts = " ".join(f"{len(re.findall(re.escape(op), ptx)):4d}" for op in COUNTED)
        resources = f"{kernel.metadata.shared // 1024} KB, {registers(kernel)} regs"
        print(f"{name:42s} {counts}  {resources}", flush=True)
        if "griddepcontrol.wait" in ptx:  # what a kernel launched early does once the one before has ended
            after = ptx[ptx.index("griddepcontrol.wait") :]
            counts = " ".join(f"{op} {after.count(op)}" for op in ("st.shared", "ldmatrix", "bar.sync"))
            print(f"{'  after the wait':42s} {counts}")
        total, ops = sass_counts(kernel)
        print(f"{'  SASS':42s} {total} in all; " + " ".join(f"{op} {ops.get(op, 0)}" for op in SASS_COUNTED))


if __name__ == "__main__":
    main()
