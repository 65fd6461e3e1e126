"""Where Triton and the PyTorch reference part ways on a tiny random model with an fp8 (or bf16) KV cache:
greedy tokens of the fp8 graph test's prompts, eager, in several settings; per request, the first position
where the two backends' tokens differ. Run on the GPU machine: python benchmarks/fp8_agreement_diag.py"""

import random
import sys
import tempfile

import torch

import qwick.layers.attention.triton_backend as T
from qwick import LLM, SamplingParams
from tests.utils import make_tiny_model


def generate(path: str, backend: str, kv: str, prompts, **kw) -> list[list[int]]:
    llm = LLM(
        path,
        dtype="bfloat16",
        kv_cache_dtype=kv,
        attention_backend=backend,
        enforce_eager=True,
        num_gpu_blocks_override=256,
        block_size=16,
        max_model_len=256,
        max_num_seqs=8,
        **kw,
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    out = llm.generate(prompts, params, use_tqdm=False)
    out += llm.generate(prompts[::-1], params, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in out]


def first_diffs(a, b) -> list[int]:
    return [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), -1) for ra, rb in zip(a, b)]


def main() -> None:
    arch = sys.argv[1] if len(sys.argv) > 1 else "qwen2"
    path = tempfile.mkdtemp()
    make_tiny_model(
        arch,
        path,
        **(dict(hidden_size=256) if arch == "qwen2" else dict(head_dim=128, num_attention_heads=8)),
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 300) for _ in range(n)] for n in (3, 17, 40, 100, 5, 64)]
    settings = {
        "fp8": dict(kv="fp8", max_num_batched_tokens=48),
        "fp8 no-prefix-cache": dict(kv="fp8", max_num_batched_tokens=48, enable_prefix_caching=False),
        "fp8 unchunked": dict(kv="fp8", max_num_batched_tokens=512),
        "bf16": dict(kv="auto", max_num_batched_tokens=48),
    }
    for name, kw in settings.items():
        kv = kw.pop("kv")
        ref = generate(path, "torch", kv, prompts, **kw)
        for fuse in (True, False):
            T.FUSE_ROPE = fuse
            tri = generate(path, "triton", kv, prompts, **kw)
            same = sum(x == y for ra, rb in zip(ref, tri) for x, y in zip(ra, rb)) / sum(map(len, ref))
            print(f"{name:20s} rope fused {fuse!s:5s} agreement {same:.3f}, diffs at {first_diffs(ref, tri)}")
        T.FUSE_ROPE = True


main()
