"""qwen2.5-7b shapes, random weights: qwick vs transformers on the same weights, greedy 64 steps + logits.

    python benchmarks/greedy_vs_transformers.py [fp8|int8|int4]
    ALL_ROWS=1 python benchmarks/greedy_vs_transformers.py   # also with every token through the last layer

With a quantization mode, qwick quantizes the random weights while loading and transformers runs their
dequantized copy (`checkpoint_tensors` exports it) in bf16 with unquantized activations: the same function
for int4 (W4A16) and for 8-bit decode steps (W8A16); 8-bit prefill also quantizes activations (W8A8), so
its logits differ from the reference by that as well."""

import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from qwick import LLM, SamplingParams
from qwick.bench.hf_reference import transformers_on_our_weights
from qwick.bench.shapes import model_dir_for_shape

quantization = sys.argv[1] if len(sys.argv) > 1 else None
llm = LLM(
    model_dir_for_shape("qwen2.5-7b"),
    load_format="dummy",
    max_model_len=4096,
    gpu_memory_utilization=0.5,
    quantization=quantization,
    enable_prefix_caching=False,  # each run (ALL_ROWS) computes its prompts afresh
)
print(f"quantization: {quantization or 'none (bf16)'}", flush=True)
model = llm.llm_engine.core.runner.model
ref = transformers_on_our_weights(model, torch.bfloat16, "cuda")
g = torch.Generator().manual_seed(3)
prompts = [torch.randint(100, 150000, (n,), generator=g).tolist() for n in (16, 128, 700)]
settings = [True, False] if os.environ.get("ALL_ROWS") == "1" else [True]
runs = []
for rows_only in settings:  # the last layer for the sampling tokens only (the default), or for all
    llm.llm_engine.core.runner.sampled_rows_only = rows_only
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=1)
    runs += [(rows_only, p, o) for p, o in zip(prompts, llm.generate(prompts, params, use_tqdm=False))]
for rows_only, p, o in runs:
    ours = o.outputs[0].token_ids
    with torch.no_grad():
        theirs = ref.generate(
            torch.tensor([p], device="cuda"),
            max_new_tokens=64,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        logits = ref(torch.tensor([p + ours], device="cuda")).logits[0, len(p) - 1 : len(p) - 1 + 64].float()
    lp_ref = torch.log_softmax(logits, -1)
    ours_lp = torch.tensor([e[t].logprob for e, t in zip(o.outputs[0].logprobs, ours)])
    ref_lp = lp_ref[torch.arange(64), torch.tensor(ours, device="cuda")].cpu()
    div = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    print(
        f"prompt {len(p)}{'' if rows_only else ' (all rows)'}: "
        f"greedy {'equal for 64' if div is None else f'diverges at step {div}'}; "
        f"max |logprob diff| of our tokens {float((ours_lp - ref_lp).abs().max()):.4f} "
        f"(first token {float((ours_lp[0] - ref_lp[0]).abs()):.4f}); "
        f"logit std {float(logits.std()):.3f}",
        flush=True,
    )
