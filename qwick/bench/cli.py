"""`qwick bench latency | throughput | load | serve | quality`: print a table, optionally write JSON."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import subprocess

import torch

from qwick.bench.shapes import SHAPES


def _commit() -> str:
    """HEAD's short hash, with "+modified" when tracked files differ from it (a report from a working tree
    that is not that commit must not claim to be it)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+modified" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def _build_llm(args: argparse.Namespace):
    from qwick.entrypoints.cli import engine_config_from_args
    from qwick.entrypoints.llm import LLM

    if getattr(args, "shape", None):
        from qwick.bench.shapes import model_dir_for_shape

        if args.model is not None:
            raise ValueError("give either a MODEL or --shape, not both")
        args.model = model_dir_for_shape(args.shape)
        args.load_format = "dummy"
    return LLM(**dataclasses.asdict(engine_config_from_args(args)))


def _reference(llm, args) -> object | None:
    if not args.compare_transformers:
        return None
    from qwick.bench.hf_reference import load_transformers, transformers_on_our_weights

    runner = llm.llm_engine.core.runner
    dtype = runner.dtype if args.reference_dtype == "same" else getattr(torch, args.reference_dtype)
    if args.load_format == "dummy":  # no checkpoint to load: give transformers our random weights
        return transformers_on_our_weights(runner.model, dtype, runner.device)
    return load_transformers(llm.llm_engine.model_path, dtype, str(runner.device))


def _structured(args: argparse.Namespace):
    """`--structured [SCHEMA.json]`: the constraint of the structured runs (None: no structured runs)."""
    if args.structured is None:
        return None
    from qwick.bench.engine_bench import BENCH_SCHEMA
    from qwick.sampling_params import StructuredOutputsParams

    if args.structured == "builtin":
        return StructuredOutputsParams(json=BENCH_SCHEMA)
    with open(args.structured) as f:
        return StructuredOutputsParams(json=json.load(f))


def _forget_prefixes(llm, structured) -> None:
    """With `--structured` both passes run the same prompts: empty the prefix cache before each run, so
    the second pass is not served prompts the first one computed."""
    if structured is not None:
        llm.llm_engine.core.scheduler.kv_cache.reset_prefix_cache()


def _medians(runs: list[dict]) -> dict:
    """Each figure's median over the runs, not one run's figures: the run with the median decode step may
    carry an outlying TTFT (2048-token prompts on the H200 spread over 43-55 ms). For an even count, the
    better of the two middle values of a time and the worse of a rate would disagree (4.50 ms per step
    beside 220.8 tok/s), so times take the lower and rates (`*_per_s`) the higher middle value: the pair
    comes from the same run. NaN (a figure a run could not measure) is left out."""

    def median(key: str) -> float:
        values = [r[key] for r in runs if r[key] == r[key]]
        if not values:
            return float("nan")
        return (statistics.median_high if key.endswith("_per_s") else statistics.median_low)(values)

    return {key: median(key) for key in runs[0]}


def _add_structured(result: dict, runs: list[dict], key: str, higher_is_better: bool) -> None:
    """Add the structured runs' median and its speed relative to the unconstrained median."""
    runs.sort(key=lambda r: r[key])
    result["qwick_structured"] = runs[len(runs) // 2]
    result["qwick_structured_runs"] = runs
    plain, constrained = result["qwick"][key], result["qwick_structured"][key]
    result["structured_relative_speed"] = constrained / plain if higher_is_better else plain / constrained
    result["structured_speed_key"] = key


def cmd_latency(args: argparse.Namespace) -> dict:
    from qwick.bench import engine_bench, hf_reference
    from qwick.bench.workloads import fixed_requests

    llm = _build_llm(args)
    vocab = llm.llm_engine.vocab_size
    structured = _structured(args)
    engine_bench.step_timings(llm, fixed_requests(args.batch_size, 16, 4, vocab, seed=-1))  # warm-up
    if structured is not None:  # compiles the grammar before anything is timed
        engine_bench.step_timings(
            llm, fixed_requests(args.batch_size, 16, 4, vocab, seed=-1), structured=structured
        )

    # Fresh prompts for every run, so no run is served from the prefix cache of an earlier one; the
    # structured runs get the same prompts as the unconstrained ones (with the cache emptied first).
    def one(i: int, constraint) -> dict:
        _forget_prefixes(llm, structured)
        reqs = fixed_requests(
            args.batch_size, args.input_len, args.output_len, vocab, seed=args.bench_seed + i
        )
        return engine_bench.step_timings(llm, reqs, structured=constraint)

    def timed(constraint):
        return [one(i, constraint) for i in range(args.num_iters)]

    runs = timed(None)
    reqs = fixed_requests(args.batch_size, args.input_len, args.output_len, vocab, seed=args.bench_seed)
    result = {"qwick": _medians(runs), "qwick_runs": runs}
    if structured is not None:
        _add_structured(result, timed(structured), "decode_step_ms_median", higher_is_better=False)
    ref = _reference(llm, args)
    if ref is not None:
        if args.batch_size == 1:
            result["transformers"] = hf_reference.latency(ref, reqs[0])
        else:
            result["transformers"] = hf_reference.batched_throughput(ref, reqs)
    return result


def cmd_throughput(args: argparse.Namespace) -> dict:
    from qwick.bench import engine_bench, hf_reference
    from qwick.bench.workloads import fixed_requests, ranged_requests

    llm = _build_llm(args)
    vocab = llm.llm_engine.vocab_size

    def workload(seed: int):
        if args.input_len_range:
            return ranged_requests(
                args.num_prompts, tuple(args.input_len_range), tuple(args.output_len_range), vocab, seed=seed
            )
        return fixed_requests(args.num_prompts, args.input_len, args.output_len, vocab, seed=seed)

    # Fresh prompts for every run, so no run is served from the prefix cache of an earlier one; the
    # structured runs get the same prompts as the unconstrained ones (with the cache emptied first).
    def one(i: int, constraint) -> dict:
        _forget_prefixes(llm, structured)
        return engine_bench.throughput(
            llm, workload(args.bench_seed + i), temperature=args.temperature, structured=constraint
        )

    def timed(constraint):
        return [one(i, constraint) for i in range(args.num_iters)]

    structured = _structured(args)
    runs = timed(None)
    reqs = workload(args.bench_seed)
    runs.sort(key=lambda r: r["output_tokens_per_s"])
    result = {"qwick": runs[len(runs) // 2], "qwick_runs": runs}
    if structured is not None:
        _add_structured(result, timed(structured), "output_tokens_per_s", higher_is_better=True)
    ref = _reference(llm, args)
    if ref is not None:
        result["transformers"] = hf_reference.batched_throughput(ref, reqs)
    return result


def cmd_load(args: argparse.Namespace) -> dict:
    from qwick.bench.load_time import measure

    gguf = None
    if args.compare_transformers:
        if args.model is None:
            from qwick.loader.demo import demo_gguf_path

            gguf = demo_gguf_path()
        elif args.model.endswith(".gguf"):
            gguf = args.model
    return measure(args.model, args.dtype, gguf)


def cmd_serve(args: argparse.Namespace) -> dict:
    import asyncio

    from qwick.bench import serve_bench
    from qwick.bench.workloads import fixed_requests

    reqs = fixed_requests(
        args.num_prompts, args.input_len, args.output_len, args.vocab_size, seed=args.bench_seed
    )
    import httpx

    try:
        return {"server": asyncio.run(serve_bench.run(args.url, reqs, args.concurrency, args.api_key))}
    except httpx.HTTPError as exc:
        raise OSError(f"could not benchmark the server at {args.url}: {type(exc).__name__}: {exc}") from exc


def cmd_quality(args: argparse.Namespace) -> dict:
    from qwick.bench.quality import run, table

    names = args.modes or (["none", args.quantization] if args.quantization else ["none", "fp8", "int8"])
    modes = [None if m == "none" else m for m in names]
    if modes[0] is not None:
        raise ValueError("--modes must start with 'none': the unquantized model is the reference")

    lm_head = args.quantize_lm_head  # applies to the quantized modes, not to the reference

    def make_llm(mode):
        args.quantization = mode
        args.quantize_lm_head = lm_head if mode is not None else None
        return _build_llm(args)

    report = run(make_llm, modes, args.window, args.prompt_len, args.max_tokens, args.num_prompts)
    print(table(report))
    return report


def add_bench_parser(sub, add_engine_args) -> None:
    bench = sub.add_parser("bench", help="measure speed (see BENCHMARKS.md for the method)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    def common(p):
        add_engine_args(p)
        p.add_argument(
            "--shape",
            default=None,
            choices=sorted(SHAPES),
            help="a real model's shapes with random weights (implies --load-format dummy)",
        )
        p.add_argument(
            "--compare-transformers",
            action="store_true",
            help="also run transformers on the same weights and inputs",
        )
        p.add_argument(
            "--reference-dtype",
            default="same",
            choices=["same", "float32", "bfloat16", "float16"],
            help="dtype of the transformers reference (same: qwick's)",
        )
        p.add_argument("--output-json", default=None, help="write the results here")
        p.add_argument("--num-iters", type=int, default=3, help="repeats; the median is reported")
        p.add_argument(
            "--bench-seed", dest="bench_seed", type=int, default=0, help="seed of the random prompts"
        )

    def structured_arg(p):
        p.add_argument(
            "--structured",
            nargs="?",
            const="builtin",
            default=None,
            metavar="SCHEMA_JSON",
            help="also run the same prompts under a JSON Schema (a built-in one, or this file's) and report "
            "the constrained speed beside the unconstrained one",
        )

    lat = kinds.add_parser("latency", help="decode speed and time to first token at a fixed batch size")
    common(lat)
    structured_arg(lat)
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=256)
    lat.set_defaults(func=lambda a: _run(a, cmd_latency))

    thr = kinds.add_parser("throughput", help="one generate over many requests")
    common(thr)
    structured_arg(thr)
    thr.add_argument("--num-prompts", type=int, default=256)
    thr.add_argument("--input-len", type=int, default=128)
    thr.add_argument("--output-len", type=int, default=128)
    thr.add_argument("--input-len-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    thr.add_argument("--output-len-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    thr.add_argument("--temperature", type=float, default=0.6)
    thr.set_defaults(func=lambda a: _run(a, cmd_throughput))

    srv = kinds.add_parser(
        "serve", help="a running `qwick serve` over HTTP with streaming, fixed concurrency"
    )
    srv.add_argument("--url", default="http://127.0.0.1:8000")
    srv.add_argument("--api-key", default=None)
    srv.add_argument("--num-prompts", type=int, default=64)
    srv.add_argument("--concurrency", type=int, default=16)
    srv.add_argument("--input-len", type=int, default=128)
    srv.add_argument("--output-len", type=int, default=128)
    srv.add_argument("--vocab-size", type=int, default=151936, help="random prompt ids are drawn below this")
    srv.add_argument("--bench-seed", dest="bench_seed", type=int, default=0)
    srv.add_argument("--output-json", default=None)
    srv.set_defaults(func=lambda a: _run(a, cmd_serve))

    qual = kinds.add_parser(
        "quality",
        help="perplexity on CPython stdlib files and greedy agreement of quantization modes against the "
        "unquantized model, with weight memory",
    )
    add_engine_args(qual)
    qual.add_argument(
        "--modes",
        nargs="+",
        default=None,
        metavar="MODE",
        help="quantization modes, 'none' (the reference) first; default: none and --quantization, or "
        "none fp8 int8",
    )
    qual.add_argument("--window", type=int, default=1024, help="tokens scored per stdlib file")
    qual.add_argument("--prompt-len", type=int, default=128, help="tokens of each greedy prompt")
    qual.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    qual.add_argument("--num-prompts", type=int, default=8, help="greedy prompts (one per file)")
    qual.add_argument("--output-json", default=None, help="write the results here")
    qual.set_defaults(func=lambda a: _run(a, cmd_quality))

    load = kinds.add_parser("load", help="cold and warm start-up time, in fresh processes")
    common(load)
    load.set_defaults(func=lambda a: _run(a, cmd_load))


def _run(args: argparse.Namespace, fn) -> int:
    result = fn(args)
    report = {
        "command": "qwick " + " ".join(args.argv),
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "machine": _machine(),
        "result": result,
    }
    print(json.dumps(report, indent=2))
    ours, ref = result.get("qwick", {}), result.get("transformers", {})
    key = "decode_tokens_per_s" if "decode_tokens_per_s" in ref else "output_tokens_per_s"
    if ours.get(key) and ref.get(key):
        print(f"qwick {ours[key]:.1f} tok/s, transformers {ref[key]:.1f} tok/s: {ours[key] / ref[key]:.2f}x")
    constrained = result.get("qwick_structured", {})
    skey = result.get("structured_speed_key", key)
    if ours.get(skey) and constrained.get(skey):
        print(
            f"{skey}: qwick {ours[skey]:.1f}, with a JSON schema {constrained[skey]:.1f}: "
            f"{result['structured_relative_speed']:.2f}x"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
