"""What each kernel adds to a decode step, from a Chrome trace of replayed steps (the profiler's).

Under programmatic dependent launch a kernel starts while the one before it still runs, so its duration
counts the time it spends waiting as well as its work, and the durations of a step add up to more than the
step. What a kernel adds to the step is how much later than the kernel before it it ends: on one stream
they end in launch order, so these increments add up to the span of the kernels, gaps between steps
included (the first kernel of a step carries the host's gap). Also printed: how long before the previous
kernel's end each kernel starts (its overlap).

    python benchmarks/critical_path.py trace.json [STEPS]
"""

from __future__ import annotations

import json
import statistics
import sys


def kernel_increments(trace_path: str) -> list[tuple[str, str, float, float, float]]:
    """(name, grid, duration, added, overlap) in us for each kernel of the trace, in start order."""
    with open(trace_path) as f:
        kernels = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    kernels.sort(key=lambda e: e["ts"])
    rows = []
    prev_end = None
    for e in kernels:
        end = e["ts"] + e["dur"]
        added = end - prev_end if prev_end is not None else e["dur"]
        overlap = prev_end - e["ts"] if prev_end is not None else 0.0
        rows.append((e["name"][:60], str(e.get("args", {}).get("grid")), e["dur"], added, overlap))
        prev_end = end if prev_end is None else max(prev_end, end)
    return rows


def report(trace_path: str, steps: int) -> str:
    """A table per launch shape (kernel name and grid): count, mean duration, mean added, mean overlap,
    added per step, sorted by what it adds."""
    groups: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for name, grid, dur, added, overlap in kernel_increments(trace_path):
        groups.setdefault((name, grid), []).append((dur, added, overlap))
    total = sum(a for v in groups.values() for _, a, _ in v)
    lines = [
        f"what each launch adds to the step, {steps} steps ({total / steps:.1f} us a step):",
        f" {'kernel':60s} {'grid':16s} {'count':>5s} {'dur':>8s} {'added':>8s} {'overlap':>8s} {'/step':>8s}",
    ]
    for (name, grid), v in sorted(groups.items(), key=lambda kv: -sum(a for _, a, _ in kv[1])):
        dur = statistics.mean(d for d, _, _ in v)
        added = statistics.mean(a for _, a, _ in v)
        overlap = statistics.mean(o for _, _, o in v)
        per_step = sum(a for _, a, _ in v) / steps
        lines.append(
            f" {name:60s} {grid:16s} {len(v):5d} {dur:8.2f} {added:8.2f} {overlap:8.2f} {per_step:8.1f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1))
