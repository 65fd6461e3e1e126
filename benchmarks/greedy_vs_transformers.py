"""qwen2.5-7b shapes, random weights: qwick vs transformers on the same weights, greedy 64 steps + logits.

    python benchmarks/greedy_vs_transformers.py [fp8|int8|int4]
    ALL_ROWS=1 python benchmarks/greedy_vs_transformers.py   # also with every token through the last layer
    LM_HEAD=0 python benchmarks/greedy_vs_transformers.py fp8  # the LM head in bf16 (1: quantized)

With a quantization mode, qwick quantizes the random weights while loading and transformers runs their
dequantized copy (`checkpoint_tensors` exports it) in bf16 with unquantized activations: the same function
for int4 (W4A16) and for 8-bit decode steps (W8A16); 8-bit prefill also quantizes activations (W8A8), so
its logits differ from the reference by that as well.

Beside the bf16 reference, transformers in fp32 on the same weights is the yardstick (REF32=0 skips it;
unset, it runs only on a GPU of more than 100 GiB: at 7b shapes it ran out of memory on an 80 GiB H100):
over our greedy tokens, both qwick's and transformers' own bf16 log-probabilities are compared with the
fp32 ones, so that qwick's error reads against what bf16 costs transformers itself. SHAPE=qwen2.5-0.5b
runs a smaller shape; BATCH=24 generates 24 prompts of 16-199 tokens at once (int4's tiled kernel serves
decode steps of 2-128 rows); ONE_BY_ONE=1 generates the prompts one at a time (prompts of up to 1,024
tokens then prefill through the prefill CUDA graphs). GPU only: on CPUs qwick repacks bf16 weights,
which cannot be exported."""

import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from qwick import LLM, SamplingParams
from qwick.bench.hf_reference import transformers_on_our_weights
from qwick.bench.shapes import model_dir_for_shape

quantization = sys.argv[1] if len(sys.argv) > 1 else None
device = "cuda"
llm = LLM(
    model_dir_for_shape(os.environ.get("SHAPE", "qwen2.5-7b")),
    load_format="dummy",
    max_model_len=4096,
    gpu_memory_utilization=0.3,  # room for transformers in bf16 and in fp32 beside it
    quantization=quantization,
    quantize_lm_head={"0": False, "1": True}.get(os.environ.get("LM_HEAD", "")),  # unset: the mode's default
    enable_prefix_caching=False,  # each run (ALL_ROWS) computes its prompts afresh
)
print(f"quantization: {quantization or 'none (bf16)'}", flush=True)
model = llm.llm_engine.core.runner.model
ref = transformers_on_our_weights(model, torch.bfloat16, device)
big_gpu = torch.cuda.get_device_properties(0).total_memory > 100 * 2**30
want_ref32 = os.environ.get("REF32", "1" if big_gpu else "0") == "1"
print(f"fp32 yardstick: {'on' if want_ref32 else 'off (REF32=1 asks for it)'}", flush=True)
ref32 = transformers_on_our_weights(model, torch.float32, device) if want_ref32 else None
g = torch.Generator().manual_seed(3)
lengths = (16, 128, 700)
if os.environ.get("BATCH"):  # this many prompts at once: decode steps take that many rows
    lengths = tuple(int(x) for x in torch.randint(16, 200, (int(os.environ["BATCH"]),), generator=g))
prompts = [torch.randint(100, 150000, (n,), generator=g).tolist() for n in lengths]
settings = [True, False] if os.environ.get("ALL_ROWS") == "1" else [True]
runs = []
for rows_only in settings:  # the last layer for the sampling tokens only (the default), or for all
    llm.llm_engine.core.runner.sampled_rows_only = rows_only
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=1)
    if os.environ.get("ONE_BY_ONE") == "1":  # each prompt alone: its prefill replays a prefill graph
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    runs += [(rows_only, p, o) for p, o in zip(prompts, outs)]


def token_logprobs(m, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """m's log-probabilities of `tokens` after `prompt`, teacher-forced (one forward; on the CPU), and
    the logits they came from."""
    with torch.no_grad():
        logits = m(torch.tensor([prompt + tokens], device=device)).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1)
    return lp[torch.arange(len(tokens)), torch.tensor(tokens, device=device)].cpu(), logits


for rows_only, p, o in runs:
    ours = o.outputs[0].token_ids
    with torch.no_grad():
        theirs = ref.generate(
            torch.tensor([p], device=device),
            max_new_tokens=64,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
    ref_lp, logits = token_logprobs(ref, p, ours)
    ours_lp = torch.tensor([e[t].logprob for e, t in zip(o.outputs[0].logprobs, ours)])
    div = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    line = (
        f"prompt {len(p)}{'' if rows_only else ' (all rows)'}: "
        f"greedy {'equal for 64' if div is None else f'diverges at step {div}'}; "
        f"max |logprob diff| of our tokens {float((ours_lp - ref_lp).abs().max()):.4f} "
        f"(first token {float((ours_lp[0] - ref_lp[0]).abs()):.4f}); "
        f"logit std {float(logits.std()):.3f}"
    )
    if ref32 is not None:
        lp32, _ = token_logprobs(ref32, p, ours)
        ours_err, ref_err = float((ours_lp - lp32).abs().max()), float((ref_lp - lp32).abs().max())
        line += f"; against fp32 transformers, max |logprob diff|: qwick {ours_err:.4f}, "
        line += f"bf16 transformers {ref_err:.4f}"
    print(line, flush=True)
