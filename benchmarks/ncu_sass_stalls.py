"""Where one kernel's warps stall, per SASS instruction, from Nsight Compute's source page.

On the GPU machine (the 49th session's run of the f16x2 int4 gate/up GEMV; `gpu_session.sh half2sass`):

    ncu --clock-control none --profile-from-start off --set full --import-source yes \
        -k regex:_w4_half2_kernel --launch-count 1 -o /tmp/h2 python benchmarks/gemv_ncu.py /tmp/k
    ncu -i /tmp/h2.ncu-rep --page source --print-source sass --csv > h2_sass.csv
    python benchmarks/ncu_sass_stalls.py h2_sass.csv [TOP]

prints the stall reasons summed over the kernel, then the TOP (default 20) instructions by warp-stall
samples with their three largest reasons, then the loop body's instructions (those executed most often)
in address order, so that a stall can be read against the loads and barriers before it.
"""

import csv
import sys


def main() -> None:
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    with open(path) as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header, data = rows[start], [r for r in rows[start + 1 :] if len(r) == len(rows[start])]
    col = {h: i for i, h in enumerate(header)}

    def value(r: list[str], key: str) -> float:
        try:
            return float(r[col[key]].replace(",", ""))
        except (KeyError, ValueError):
            return 0.0

    samples = "Warp Stall Sampling (All Samples)"
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(value(r, samples) for r in data)
    print(f"{len(data)} instructions, {total:.0f} warp-stall samples")
    sums = sorted(((sum(value(r, k) for r in data), k) for k in reasons), reverse=True)
    print("by reason: " + ", ".join(f"{k[6:]} {v / total:.1%}" for v, k in sums[:8] if v))
    print(f"\nthe {top} instructions with the most samples:")
    for r in sorted(data, key=lambda r: -value(r, samples))[:top]:
        why = sorted(((value(r, k), k) for k in reasons), reverse=True)[:3]
        why_text = ", ".join(f"{k[6:]} {v:.0f}" for v, k in why if v)
        print(f"  {r[col['Address']][-5:]} {r[col['Source']][:64]:64s} {value(r, samples):6.0f}  {why_text}")
    executed = "Instructions Executed"
    most = max(value(r, executed) for r in data)
    print(f"\nthe loop body (executed {most:.0f} times):")
    for r in data:
        if value(r, executed) == most:
            print(f"  {r[col['Address']][-5:]} {r[col['Source']][:64]:64s} {value(r, samples):6.0f}")


if __name__ == "__main__":
    main()
