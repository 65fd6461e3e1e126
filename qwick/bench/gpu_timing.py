"""GPU time of a call, as a decode step sees it: captured in a CUDA graph and replayed, so the host's
time to issue the call (tens of microseconds for a Triton launch, more than many decode kernels take)
is not what gets measured."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_us(fn: Callable[[], object], calls: int = 20, replays: int = 3) -> float:
    """Microseconds per call of `fn`: `calls` calls captured in one CUDA graph, the graph replayed
    `replays` times between CUDA events. `fn` runs eagerly first (compiles, and raises for a launch the GPU
    or a workspace cannot take, before any capture), then once on a side stream, as capture requires."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (replays * calls)
