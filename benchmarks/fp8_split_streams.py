"""The fp8 down projection at 129-256 rows with K split across CUDA streams, against one `_scaled_mm`.

cuBLAS tiles qwen2.5-7b's down projection (3584 x 18944) 128 x 128 at M = 256: 56 output tiles, one per SM
for 132 SMs, each over the whole K. Two `_scaled_mm` calls over the two halves of K, on two streams, keep
112 SMs busy; their partials are added after. Timed in CUDA graphs over 4 layers' weights (so that the
weights stream from HBM, as in a model), us per layer; the error is against the one-call result.

    python benchmarks/fp8_split_streams.py
"""

import torch

FP8 = torch.float8_e4m3fn
N, K = 3584, 18944
LAYERS = 4


def codes(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, cols, device="cuda")
    scale = x.abs().amax(dim=1, keepdim=True) / 448.0
    return (x / scale).to(FP8), scale


def one_call(x, xs, w, ws, out_dtype=torch.bfloat16):
    return torch._scaled_mm(x, w.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=out_dtype)


def k_slices(t: torch.Tensor, splits: int, copy: bool) -> list[torch.Tensor]:
    """t's columns in `splits` slices (multiples of 128 wide but the last): views, or contiguous copies."""
    step = -(-K // splits // 128) * 128
    views = [t[:, i * step : min((i + 1) * step, K)] for i in range(splits)]
    return [v.contiguous() for v in views] if copy else views


def split_call(xp, xs, wp, ws, streams: list[torch.cuda.Stream] | None, part_dtype):
    """One `_scaled_mm` per K slice (each on its own stream when given), summed."""
    main = torch.cuda.current_stream()
    parts = []
    for i, (x, w) in enumerate(zip(xp, wp)):
        if streams is not None and i > 0:
            s = streams[i - 1]
            s.wait_stream(main)
            with torch.cuda.stream(s):
                parts.append(one_call(x, xs, w, ws, part_dtype))
        else:
            parts.append(one_call(x, xs, w, ws, part_dtype))
    if streams is not None:
        for s in streams[: len(xp) - 1]:
            main.wait_stream(s)
    total = parts[0] if part_dtype == torch.float32 else parts[0].float()
    for p in parts[1:]:
        total = total + p
    return total.to(torch.bfloat16)


def graph_us(fn, layers) -> float:
    for args in layers:
        fn(*args)  # warm up outside capture (cuBLAS workspaces, handles)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for args in layers:
            fn(*args)
    for _ in range(5):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 50
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / len(layers)


def main() -> None:
    weights = [codes(N, K) for _ in range(LAYERS)]
    streams = [torch.cuda.Stream() for _ in range(3)]
    try:
        one_call(*codes(16, K), *weights[0], out_dtype=torch.float32)
        part_dtypes = [torch.float32, torch.bfloat16]
    except Exception as e:  # rowwise scales may allow bf16 output only
        print(f"fp32 output from _scaled_mm: {type(e).__name__}: {str(e)[:120]}")
        part_dtypes = [torch.bfloat16]
    try:
        x16, xs16 = codes(16, K)
        one_call(k_slices(x16, 2, False)[1], xs16, k_slices(weights[0][0], 2, False)[1], weights[0][1])
        copy = False
    except Exception as e:
        print(f"K-slice views in _scaled_mm: {type(e).__name__}: {str(e)[:120]}; contiguous copies instead")
        copy = True
    print(f"{'M':>4} {'one call':>9}  split variants (us per layer, rel err)")
    for m in (136, 160, 192, 224, 256):
        x, xs = codes(m, K)
        layers = [(x, xs, w, ws) for w, ws in weights]
        ref = one_call(*layers[0]).float()
        cells = [f"{m:4d} {graph_us(one_call, layers):9.1f}"]
        for part_dtype in part_dtypes:
            for splits in (2, 3):
                sliced = [
                    (k_slices(x, splits, copy), xs, k_slices(w, splits, copy), ws) for x, xs, w, ws in layers
                ]
                for label, st in (("streams", streams), ("serial", None)):

                    def fn(xp, xs, wp, ws, st=st, part_dtype=part_dtype):
                        return split_call(xp, xs, wp, ws, st, part_dtype)

                    name = f"{splits}x{str(part_dtype)[6:]}/{label}"
                    try:
                        err = ((fn(*sliced[0]).float() - ref).norm() / ref.norm()).item()
                        cells.append(f"{name} {graph_us(fn, sliced):.1f} ({err:.0e})")
                    except Exception as e:
                        cells.append(f"{name} {type(e).__name__}: {str(e)[:80]}")
        print("  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
