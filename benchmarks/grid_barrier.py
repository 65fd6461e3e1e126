"""What a grid-wide barrier costs inside one persistent Triton kernel, beside the launch floor
(`benchmarks/launch_floor.py`): the sum a batch-1 megakernel would pay per dependent operation instead of
a launch.

One launch of `grid` programs (at most two per SM, so all are resident) runs `phases` phases. In each,
every program loads the value its slot held in the previous phase and stores one, then arrives at a
counter (an atomic add, release) and spins until every program has (acquire loads). Timed in a CUDA graph
with the counter zeroed before the launch; us per phase.

    python benchmarks/grid_barrier.py out.json
"""

import json
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from qwick.bench.gpu_timing import graph_us  # noqa: E402


@triton.jit
def _phases(buf_ptr, counter_ptr, phases, GRID: tl.constexpr):
    pid = tl.program_id(0)
    for p in range(phases):
        src = buf_ptr + (p % 2) * GRID
        dst = buf_ptr + ((p + 1) % 2) * GRID
        v = tl.load(src + (pid + 1) % GRID)  # a neighbour's value: the phase depends on the last one
        tl.store(dst + pid, v + 1.0)
        tl.debug_barrier()
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
        target = (p + 1) * GRID
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for grid in (sms, 2 * sms):
        for phases in (1, 252):
            buf = torch.zeros(2 * grid, device="cuda")
            counter = torch.zeros(1, dtype=torch.int32, device="cuda")

            def launch(buf=buf, counter=counter, grid=grid, phases=phases):
                counter.zero_()
                _phases[(grid,)](buf, counter, phases, GRID=grid, num_warps=4)

            us = graph_us(launch, calls=4, replays=10)
            rows.append({"grid": grid, "phases": phases, "us_per_launch": us, "us_per_phase": us / phases})
            print(f"grid {grid:4d}, {phases:3d} phases: {us:8.2f} us a launch, {us / phases:.3f} us a phase")
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
