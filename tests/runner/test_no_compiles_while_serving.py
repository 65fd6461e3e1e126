"""After startup, serving compiles no Triton kernel: a compile on a user's request costs 0.3-1 s of time to
first token (seen on the H200: a 128-token prompt took 971 ms instead of 10 ms on the second request)."""

from __future__ import annotations

import pytest
import torch
import triton

from qwick import LLM, SamplingParams
from tests.utils import make_tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "dtype,quantization",
    [("bfloat16", None), ("float16", None), ("bfloat16", "fp8"), ("bfloat16", "int8"), ("bfloat16", "int4")],
)
def test_requests_after_startup_compile_nothing(tmp_path, dtype, quantization):
    """Every mode's kernels too: int4's four row-count paths (1, 2-16, the tiled kernel's 17-64, more),
    the W8A8 GEMVs, split-K GEMMs and the LM head's."""
    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    path = str(tmp_path / "model")
    # head_dim 128 with GQA 4:1, so both prefill-attention tile shapes are reachable.
    make_tiny_model(
        "qwen2",
        path,
        hidden_size=512,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=8192,
    )
    compiled: list[str] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        compiled.append(repr.split("[")[0])

    old = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        llm = LLM(
            path, dtype=dtype, device="cuda", max_model_len=8192, max_num_seqs=32, quantization=quantization
        )
        assert compiled, "startup compiled nothing: the hook is not seeing compiles"
        compiled.clear()
        g = torch.Generator().manual_seed(0)
        # Lengths chosen to vary every per-step integer: block-table widths (1..70 blocks), query
        # lengths below and above the tile switch, decode batch sizes 1..32, seeded sampling.
        for batch, length, out_len in [
            (1, 128, 8),
            (1, 131, 8),
            (1, 37, 20),
            (3, 200, 12),
            (13, 77, 9),
            (32, 17, 5),
            (1, 1100, 3),
            (1, 2000, 3),  # its last token's decode attention: 16 splits, a count no graph bucket has
            (1, 5000, 3),  # a prefill long enough for the deeper-pipelined attention launch
            (2, 5, 40),
        ]:
            prompts = [torch.randint(2, 300, (length,), generator=g).tolist() for _ in range(batch)]
            params = [
                SamplingParams(
                    max_tokens=out_len,
                    ignore_eos=True,
                    temperature=0.0 if i % 2 else 0.8,
                    seed=i if i % 3 == 0 else None,
                )
                for i in range(batch)
            ]
            llm.generate(prompts, params, use_tqdm=False)
            assert not compiled, f"batch {batch} x {length} tokens compiled {compiled} while serving"
    finally:
        triton.knobs.runtime.jit_post_compile_hook = old
