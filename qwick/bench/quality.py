"""`qwick bench quality`: what a quantization mode costs in model quality, against the unquantized model.

The text set is a pinned list of CPython standard-library modules read from this interpreter's own stdlib
(`sysconfig.get_paths()["stdlib"]`): nothing to download, and code is what the demo model is for. The
files change a little between Python versions, so the report names the version and a sha256 of the text.

Per mode (None = the unquantized model; every mode runs the same engine flags otherwise):
- perplexity: the first `window` tokens of each file, scored in one forward each;
- greedy agreement with the unquantized model, `num_prompts` prompts (a file's tokens after its scored
  window) x `max_tokens` generated tokens: the share of positions with the same token, and the mean number
  of tokens before the first difference. Once two greedy runs differ their texts drift apart, so the
  position-wise share also counts later positions of a run that diverged early;
- teacher-forced top-1 agreement: both models read the unquantized model's continuation and the share of
  positions where their top token is the same (each step judged on its own, without the drift);
- weight memory: bytes of all parameters, and of the decoder's linear layers (codes and scales; the
  embeddings and the LM head stay in the model dtype).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import platform
import sysconfig
import time

import torch

# Modules present from Python 3.10 to 3.13, each longer than 1,300 tokens of Qwen's tokenizer.
STDLIB_FILES = (
    "base64.py",
    "heapq.py",
    "functools.py",
    "textwrap.py",
    "shlex.py",
    "fnmatch.py",
    "queue.py",
    "string.py",
    "contextlib.py",
    "json/decoder.py",
    "json/encoder.py",
    "statistics.py",
)


@dataclasses.dataclass
class Corpus:
    texts: list[str]
    python: str
    stdlib: str
    sha256: str


def stdlib_corpus(files: tuple[str, ...] = STDLIB_FILES) -> Corpus:
    root = sysconfig.get_paths()["stdlib"]
    texts = []
    digest = hashlib.sha256()
    for name in files:
        with open(os.path.join(root, name), encoding="utf-8") as f:
            text = f.read()
        texts.append(text)
        digest.update(text.encode())
    return Corpus(texts, platform.python_version(), root, digest.hexdigest())


def _forward_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits at every position of one sequence, in one forward through qwick's model (KV blocks
    1.. of the idle engine's pool; block 0 is the null block)."""
    from qwick.forward_context import set_forward_context
    from qwick.layers.attention.backend import AttentionRow

    runner = llm.llm_engine.core.runner
    n = len(token_ids)
    blocks = list(range(1, 1 + math.ceil(n / runner.block_size)))
    if len(blocks) >= runner.num_blocks:
        raise ValueError(f"the KV pool ({runner.num_blocks} blocks) is too small for {n} tokens")
    metadata = runner.backend.build_metadata([AttentionRow(0, n, blocks)])
    ids = torch.tensor(token_ids, dtype=torch.long, device=runner.device)
    positions = torch.arange(n, device=runner.device)
    with torch.inference_mode(), set_forward_context(metadata):
        hidden = runner.model(ids, positions)
        return torch.cat([runner.model.compute_logits(h).float() for h in hidden.split(256)]).cpu()


def _nll(logits: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    targets = torch.tensor(token_ids[1:])
    return -torch.log_softmax(logits[:-1], dim=-1).gather(1, targets[:, None]).squeeze(1)


def evaluate(
    llm,
    tokenized: list[list[int]],
    window: int,
    prompt_len: int,
    max_tokens: int,
    num_prompts: int,
    baseline: dict | None = None,
) -> dict:
    """One mode's numbers; `baseline` (the unquantized mode's result) adds the agreement figures."""
    from qwick.quantization.base import weight_bytes
    from qwick.sampling_params import SamplingParams

    runner = llm.llm_engine.core.runner
    start = time.perf_counter()
    nll = torch.cat([_nll(_forward_logits(llm, ids[:window]), ids[:window]) for ids in tokenized])
    ppl_seconds = time.perf_counter() - start
    prompts = [ids[window : window + prompt_len] for ids in tokenized[:num_prompts]]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    sizes = weight_bytes(runner.model)
    result = {
        "quantization": llm.llm_engine.config.quantization,
        "lm_head": runner.model.quant_config.lm_head_format() if runner.model.quant_config else None,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "perplexity": math.exp(nll.mean().item()),
        "scored_tokens": nll.numel(),
        "perplexity_seconds": ppl_seconds,
        "weight_bytes": sizes["total"],
        "linear_weight_bytes": sizes["linear"],
        "greedy_tokens": outputs,
        "prompts": prompts,
    }
    if baseline is not None:
        same = prefix = total = top1 = 0
        for prompt, ours, theirs in zip(prompts, outputs, baseline["greedy_tokens"]):
            same += sum(a == b for a, b in zip(ours, theirs))
            total += len(theirs)
            prefix += next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
            logits = _forward_logits(llm, prompt + theirs)[len(prompt) - 1 : -1]
            top1 += (logits.argmax(-1) == torch.tensor(theirs)).sum().item()
        result["greedy_identical"] = same / total
        result["greedy_prefix_mean"] = prefix / len(prompts)
        result["teacher_forced_top1"] = top1 / total
    return result


def run(
    make_llm, modes: list[str | None], window: int, prompt_len: int, max_tokens: int, num_prompts: int
) -> dict:
    """Evaluate every mode (the first should be None: the reference); `make_llm(quantization)` builds one."""
    corpus = stdlib_corpus()
    results = []
    baseline = None
    tokenized = None
    for mode in modes:
        llm = make_llm(mode)
        if tokenized is None:
            tokenizer = llm.get_tokenizer()
            tokenized = [tokenizer.encode(t, add_special_tokens=False) for t in corpus.texts]
            short = [f for f, ids in zip(STDLIB_FILES, tokenized) if len(ids) < window + prompt_len]
            if short:
                raise ValueError(f"stdlib files shorter than window + prompt: {short}")
        result = evaluate(llm, tokenized, window, prompt_len, max_tokens, num_prompts, baseline)
        if baseline is None and mode is None:
            baseline = result
        results.append(result)
        del llm
    for r in results:
        r.pop("greedy_tokens")
        r.pop("prompts")
    return {
        "corpus": {
            "files": list(STDLIB_FILES),
            "python": corpus.python,
            "stdlib": corpus.stdlib,
            "sha256": corpus.sha256,
            "window_tokens": window,
        },
        "greedy": {"prompts": num_prompts, "prompt_tokens": prompt_len, "max_tokens": max_tokens},
        "modes": results,
    }


def table(report: dict) -> str:
    rows = [
        "| quantization | dtype | weights (MiB) | decoder linear layers (MiB) | perplexity | "
        "greedy identical | first difference (mean tokens) | teacher-forced top-1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["modes"]:
        agree = (
            f"{100 * r['greedy_identical']:.1f}% | {r['greedy_prefix_mean']:.1f} | "
            f"{100 * r['teacher_forced_top1']:.1f}%"
            if "greedy_identical" in r
            else "(reference) | | "
        )
        name = (r["quantization"] or "none") + (f" + {r['lm_head']} LM head" if r.get("lm_head") else "")
        rows.append(
            f"| {name} | {r['dtype']} | {r['weight_bytes'] / 2**20:.0f} | "
            f"{r['linear_weight_bytes'] / 2**20:.0f} | {r['perplexity']:.3f} | {agree} |"
        )
    return "\n".join(rows)
