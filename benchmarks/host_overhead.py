"""Host (Python/CPU) time of one engine step at a large decode batch, and where it goes.

Adds `--batch` requests (random prompt ids, `--prompt-len` lo..hi tokens, `--max-tokens` outputs,
temperature 0.6, ignore_eos), steps until all of them decode, then times `--steps` pure-decode steps of
`llm_engine.step()` (synchronous scheduling). The model's forward (or graph replay), logits and sampler are
timed on their own ("kernels"; on CUDA each is bracketed by synchronizes, so it is their device time) and
subtracted from the step's wall time: what remains is the host's per-step work (scheduler, KV blocks, input
preparation, output processing and detokenization). A cProfile of `--profile-steps` further steps then lists
the top functions by self and cumulative time.

    python benchmarks/host_overhead.py                      # CPU: a tiny random qwen2 model, fp32
    python benchmarks/host_overhead.py --shape qwen2.5-7b   # a real shape with dummy weights (GPU)

By default the model is a tiny one (the forward costs little, even on the CPU); the host work it measures
is the same as a large model's except for the sampler, whose cost grows with the vocabulary.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qwick import LLM, SamplingParams  # noqa: E402
from qwick.sampling_params import RequestOutputKind  # noqa: E402


def make_llm(args: argparse.Namespace) -> LLM:
    common = dict(max_num_seqs=args.batch, max_model_len=args.max_model_len, async_scheduling=False)
    if args.shape:
        from qwick.bench.shapes import model_dir_for_shape

        return LLM(model_dir_for_shape(args.shape), load_format="dummy", **common)
    from tests.utils import make_tiny_model

    path = os.path.join(tempfile.mkdtemp(prefix="qwick-host-"), "tiny")
    make_tiny_model("qwen2", path, max_position_embeddings=args.max_model_len)
    return LLM(path, dtype="float32", device=args.device, **common)


class KernelTimer:
    """Wraps the runner's device work (forward or graph replay, logits, sampler) to time it apart."""

    def __init__(self, runner) -> None:
        self.cuda = runner.device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        model = runner.model
        model.forward = self._wrap("forward", model.forward)
        model.compute_logits = self._wrap("logits", model.compute_logits)
        sampler = runner.sampler
        runner.sampler = self._wrap("sampler", sampler)
        graphs = runner.graph_runner
        if graphs is not None:  # the replay's input fill is host work: time it apart, then subtract it
            graphs.replay = self._wrap("graph_replay", graphs.replay)
            graphs._fill_host = self._wrap("graph_fill_host", graphs._fill_host, sync=False)

    def wrap_host(self, core, output_processor) -> None:
        """Also time the main host parts (they stay in the host total: names start with "host:")."""
        from qwick.runner.sampler import SamplingMetadata

        def patch(obj, attr: str, name: str) -> None:
            setattr(obj, attr, self._wrap("host: " + name, getattr(obj, attr), sync=False))

        patch(core.scheduler, "schedule", "schedule")
        patch(core.scheduler, "update_from_output", "update_from_output")
        patch(core.runner.backend, "build_metadata", "attn metadata")
        build = self._wrap("host: sampling metadata", SamplingMetadata.build, sync=False)
        SamplingMetadata.build = staticmethod(build)
        patch(output_processor, "process", "output processor")

    def _wrap(self, name: str, fn: Callable, sync: bool = True) -> Callable:
        def timed(*args, **kwargs):
            if sync and self.cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if sync and self.cuda:
                    torch.cuda.synchronize()
                self.totals[name] += time.perf_counter() - t

        return timed

    def take(self) -> dict[str, float]:
        out, self.totals = dict(self.totals), defaultdict(float)
        if "graph_replay" in out:
            out["graph_replay"] -= out.get("graph_fill_host", 0.0)
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, help="a qwick.bench.shapes name (dummy weights); default: tiny")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(100, 500))
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20, help="timed decode steps (no profiler)")
    p.add_argument("--profile-steps", type=int, default=10, help="decode steps under cProfile")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cumulative",
        action="store_true",
        help="per-step cumulative outputs (as a stream reads them); default: final only, as `generate` asks",
    )
    args = p.parse_args()

    llm = make_llm(args)
    eng = llm.llm_engine
    core = eng.core
    rng = random.Random(args.seed)
    vocab = core.runner.vocab_size
    for _ in range(args.batch):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(*args.prompt_len))]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.6, ignore_eos=True)
        if not args.cumulative:
            params.output_kind = RequestOutputKind.FINAL_ONLY
        eng.add_request(prompt, params)

    # Prefill until every request decodes (one new token per row).
    sched = core.scheduler
    while sched.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        eng.step()
    assert sched.num_running == args.batch, f"only {sched.num_running} running: raise the KV cache size"
    needed = 3 + args.steps + args.profile_steps
    if args.max_tokens < needed + 10:
        sys.exit(f"--max-tokens must be at least {needed + 10} so every timed step decodes the full batch")
    for _ in range(3):
        eng.step()

    timer = KernelTimer(core.runner)
    timer.wrap_host(core, eng.output_processor)
    walls, kernels, parts = [], [], defaultdict(list)
    for _ in range(args.steps):
        t = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t)
        k = timer.take()
        kernels.append(sum(v for name, v in k.items() if name != "graph_fill_host" and ":" not in name))
        for name, v in k.items():
            parts[name].append(v)
    host = [w - k for w, k in zip(walls, kernels)]

    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:8.3f}"

    print(f"\n{core.runner.device}, batch {args.batch}, {args.steps} decode steps (median ms per step)")
    print(f"  {'step wall':<28}{ms(walls)}")
    for name in sorted(parts):
        print(f"  {'  ' + name:<28}{ms(parts[name])}")
    print(f"  {'host (wall - kernels)':<28}{ms(host)}")

    if args.profile_steps:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.profile_steps):
            eng.step()
        prof.disable()
        for sort in ("tottime", "cumulative"):
            s = io.StringIO()
            stats = pstats.Stats(prof, stream=s).strip_dirs().sort_stats(sort)
            stats.print_stats(args.top)
            print(f"\n---- cProfile over {args.profile_steps} steps, by {sort} ----")
            print(s.getvalue().split("\n", 4)[-1].rstrip())


if __name__ == "__main__":
    main()
