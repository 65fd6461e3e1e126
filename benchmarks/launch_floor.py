"""The floor under a batch-1 decode step's kernel chain: us per launch of kernels that do (almost) nothing,
captured back to back in one CUDA graph, as the step's ~250 launches are (28 layers of ~9 kernels).

Each launch reads one value its predecessor wrote and writes one, so the chain is serial in data as
well as in stream order. Grids of 1 program, one per SM (132 on the H200) and four per SM; 4 warps
each. What the step's kernels take beyond this floor is their own ramp, work and drain.

    python benchmarks/launch_floor.py out.json
"""

import json
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from qwick.bench.gpu_timing import graph_us  # noqa: E402


@triton.jit
def _hop(src_ptr, dst_ptr):
    pid = tl.program_id(0)
    v = tl.load(src_ptr + pid)
    tl.store(dst_ptr + pid, v + 1.0)


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for grid in (1, sms, 4 * sms):
        bufs = [torch.zeros(grid, device="cuda") for _ in range(2)]
        state = {"i": 0}

        def hop(bufs=bufs, grid=grid, state=state):
            i = state["i"]
            state["i"] = i + 1
            _hop[(grid,)](bufs[i % 2], bufs[(i + 1) % 2], num_warps=4)

        us = graph_us(hop, calls=252, replays=20)
        rows.append({"grid": grid, "us_per_launch": us})
        print(f"grid {grid:4d}: {us:.3f} us per launch, {252 * us / 1000:.3f} ms per 252", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
