"""The `qwick` command line. Engine flags use vLLM's names in kebab-case."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from qwick.config import KV_CACHE_DTYPES, EngineConfig
from qwick.quantization import quantization_names


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags for every `EngineConfig` field, shared by all subcommands that build an engine."""
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a Hugging Face model directory, a .gguf file, or a Hub id (org/name); "
        "omit for the built-in demo model (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF)",
    )
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weight and activation dtype; auto: bfloat16 on CPUs with native bf16 math (else float32), "
        "the checkpoint's dtype on GPUs",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output, in tokens (default: the model's context length)",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one engine step (default 8192)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks across requests that share a prompt prefix",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts into budget-sized chunks that share steps with decodes",
    )
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV-cache size in blocks")
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory for weights, activations and KV cache",
    )
    g.add_argument(
        "--cpu-kv-cache-gib", type=float, default=4.0, help="KV-cache size when running on the CPU"
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never capture CUDA graphs (by default, on a GPU, decode steps and steps of up to 4 rows and "
        "1,024 tokens, such as a new prompt beside a few decoders, replay them; a prompt chunk of up to 512 "
        "tokens beside more decoders replays both kinds)",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and launch each step before the previous step's tokens are back on the host, "
        "hiding the host's per-step work behind the GPU (requests with a grammar or penalties wait for "
        "their previous token, as without it). Default: on with a GPU, off on the CPU",
    )
    g.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling and dummy weights")
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "gguf", "dummy"],
        help="dummy: random weights at the model's shapes (for benchmarks)",
    )
    g.add_argument(
        "--quantization",
        default=None,
        choices=quantization_names(),
        help="quantize the linear layers' weights while loading an unquantized checkpoint (fp8, int8: 8-bit "
        "weights, activations quantized per token in prefill; int4: 4-bit weights, group 128, round to "
        "nearest); gguf: keep a .gguf model's Q4_K/Q5_0/Q6_K/Q8_0 weights packed instead of dequantizing "
        "them; a quantized checkpoint's format (AWQ, GPTQ, FP8, compressed-tensors) is detected without it",
    )
    g.add_argument(
        "--quantize-lm-head",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="quantize the LM head (the vocabulary projection) in the body's format too. Unset, fp8 and "
        "int8 quantize it (+0.1%% perplexity on the demo model, 2-3%% faster batch-1 decode on an H200) "
        "and int4 makes it int8 (a 4-bit head costs +1.8%% perplexity: --quantize-lm-head asks for one); "
        "gguf keeps it unquantized unless asked (then it keeps the file's head blocks, or a tied model's "
        "token-embedding blocks, packed). --no-quantize-lm-head keeps it in the model dtype. It is the "
        "largest single matrix a decode step reads (1.1 GB at 7B in bf16); quantized checkpoints keep it "
        "as they ship (see BENCHMARKS.md)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="KV-cache storage type; auto: the model's dtype. fp8 (= fp8_e4m3): float8 e4m3 with per-layer "
        "scales (the checkpoint's k_scale/v_scale if it has them, else 1.0): roughly doubles the KV "
        "capacity in tokens for the same memory, at a small quality cost",
    )
    g.add_argument("--device", default="auto", help="auto, cuda or cpu")
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="auto: Triton kernels on CUDA GPUs, the PyTorch reference elsewhere",
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer directory, if not the model's")
    g.add_argument("--revision", default=None, help="Hub revision when MODEL is a Hub id")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def cmd_generate(args: argparse.Namespace) -> int:
    from qwick import LLM, RequestOutputKind, SamplingParams

    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        output_kind=RequestOutputKind.DELTA,
    )
    prompt = args.prompt
    if args.chat:
        ids = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        prompt = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    start = time.perf_counter()
    first = None
    tokens = 0
    for out in llm.stream(prompt, params):
        if first is None:
            first = time.perf_counter() - start
        tokens += len(out.outputs[0].token_ids)
        sys.stdout.write(out.outputs[0].text)
        sys.stdout.flush()
    total = time.perf_counter() - start
    sys.stdout.write("\n")
    decode = (tokens - 1) / (total - first) if tokens > 1 and first is not None else 0.0
    print(
        f"[{tokens} tokens, first token {1000 * (first or 0):.0f} ms, {decode:.1f} tok/s after]",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwick", description="Fast inference for Qwen-family models.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt, streamed to stdout")
    add_engine_args(gen)
    gen.add_argument(
        "--prompt",
        default="Write a Python function that checks whether a number is prime.",
        help="the prompt text",
    )
    gen.add_argument(
        "--no-chat",
        dest="chat",
        action="store_false",
        help="send the prompt as raw text instead of through the chat template",
    )
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)

    from qwick.bench.cli import add_bench_parser
    from qwick.server.cli import add_chat_parser, add_serve_parser

    add_serve_parser(sub, add_engine_args)
    add_chat_parser(sub, add_engine_args)
    add_bench_parser(sub, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as exc:
        print(f"qwick: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
