"""Hardware counters of the MoE layer's cells (PERFORMANCE.md §1) under Nsight Compute: what limits each kernel.

Run on the GPU machine from the repo root: `python3 bench/ncu_cells.py --cells Q:bf16:64,D:fp8_block_scales:1
--out DIR`. Each cell (SHAPE:FORMAT:TOKENS, shapes and classes of bench/moe_layer.py; `--impl triton` for the
TRITON classes) runs in a process of its own under `ncu --profile-from-start off`: two warm-up calls, then one
call of the op as moe_layer times it (the router a build runs, then the experts, uniform routing), so the report
holds exactly that call's kernels. `DIR/ncu_cells.md` gets one row per kernel: time, DRAM bytes and bandwidth, SM
and memory throughput, the wgmma pipe's and L2's (% of peak), achieved occupancy, registers and the two largest
stall reasons (cycles a warp waits per issued instruction); `DIR/<cell>.ncu-rep` keeps each report for `ncu -i`.
"""
from __future__ import annotations

import argparse
import csv
import io
import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")
METRICS = ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed",
           "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
           "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
           "launch__grid_size", "launch__block_size", "lts__t_sector_hit_rate.pct",
           "lts__throughput.avg.pct_of_peak_sustained_elapsed"]
# whether a GEMM keeps its tensor pipe (wgmma) busy: a Hopper metric, so a report without it still gets its row
GMMA = "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
HEADER = ["| cell | kernel | launch | µs | DRAM | SM / memory % | wgmma / L2 % | occupancy % | L2 hit % | largest stalls |",
          "|---|---|---|---:|---|---|---|---:|---:|---|"]


def one_call(cell: str, impl: str) -> None:
    """The target process: one call of the cell's op between cudaProfilerStart and Stop."""
    sys.path.insert(0, str(BENCH))
    import torch
    import moe_layer as B
    from runtime.experts.base import MoeShape

    shape, fmt, tokens = cell.split(":")
    h, i, e, k = B.SHAPES[shape]
    classes = {**B.CUPY_CLASSES, **(B.TRITON_CLASSES if impl == "triton" else {})}
    module = B.build(fmt, MoeShape(h, i, e, k, "silu_glu"), copies=1, classes=classes)[0]
    router = B.Router(h, e, k, None)
    x = torch.randn(int(tokens), h, device="cuda").bfloat16()
    with torch.no_grad():
        for _ in range(2):
            module(x, *router.fused(x))
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        module(x, *router.fused(x))
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def profile(cell: str, impl: str, out: Path) -> Path:
    report = out / cell.replace(":", "_")
    stalls = "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio"
    for metrics in (METRICS + [GMMA, stalls], METRICS + [stalls]):   # without GMMA where this ncu lacks it
        run = subprocess.run(["ncu", "--clock-control", "none", "--profile-from-start", "off", "-f", "-o", str(report),
                              "--metrics", ",".join(metrics), sys.executable, __file__, "--one", cell, "--impl", impl])
        if run.returncode == 0:
            return report.with_suffix(".ncu-rep")
    raise subprocess.CalledProcessError(run.returncode, "ncu")


def kernels(report: Path) -> list[dict]:
    """The report's kernels in launch order: name and metric values (numbers where they parse)."""
    text = subprocess.run(["ncu", "-i", str(report), "--csv", "--page", "raw", "--print-units", "base"],
                          check=True, capture_output=True, text=True).stdout
    rows = list(csv.DictReader(io.StringIO(text)))
    if rows and "Kernel Name" not in rows[0]:
        raise KeyError(f"no 'Kernel Name' column in ncu's raw page; columns: {list(rows[0])[:12]}")
    out = []
    for row in rows:
        if not row.get("ID", "").strip().isdigit():   # the units row
            continue
        values = {}
        for name, value in row.items():
            try:
                values[name] = float(value.replace(",", ""))
            except (AttributeError, ValueError):
                values[name] = value
        out.append(values)
    return out


def _pct(value) -> str:
    return f"{value:.0f}" if isinstance(value, float) else "-"


def summary(cell: str, found: list[dict]) -> list[str]:
    lines = []
    for kern in found:
        us = kern["gpu__time_duration.sum"] / 1e3
        dram = kern["dram__bytes_read.sum"] + kern["dram__bytes_write.sum"]
        # "selected" is the cycle a warp issues in, not a wait
        stalls = sorted(((v, STALL.match(n).group(1)) for n, v in kern.items()
                         if STALL.match(n) and isinstance(v, float) and STALL.match(n).group(1) != "selected"),
                        reverse=True)[:2]
        lines.append(f"| {cell} | {str(kern['Kernel Name'])[:48]} | {int(kern['launch__grid_size'])} x "
                     f"{int(kern['launch__block_size'])}, {int(kern['launch__registers_per_thread'])} regs | {us:.1f} | "
                     f"{dram / 1e6:.1f} MB, {dram / us / 1e6:.2f} TB/s | "
                     f"{kern['sm__throughput.avg.pct_of_peak_sustained_elapsed']:.0f} / "
                     f"{kern['gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed']:.0f} | "
                     f"{_pct(kern.get(GMMA))} / "
                     f"{kern['lts__throughput.avg.pct_of_peak_sustained_elapsed']:.0f} | "
                     f"{kern['sm__warps_active.avg.pct_of_peak_sustained_active']:.0f} | "
                     f"{kern['lts__t_sector_hit_rate.pct']:.0f} | "
                     + ", ".join(f"{name} {v:.2f}" for v, name in stalls) + " |")
    total = sum(k["gpu__time_duration.sum"] for k in found) / 1e3
    lines.append(f"| {cell} | all {len(found)} kernels | | {total:.1f} | | | | | | |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--cells", default="", help="SHAPE:FORMAT:TOKENS, comma-separated")
    p.add_argument("--impl", choices=("cupy", "triton"), default="triton")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--one", help=argparse.SUPPRESS)   # the process ncu profiles
    args = p.parse_args()
    if args.one:
        one_call(args.one, args.impl)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = list(HEADER)
    for cell in filter(None, args.cells.split(",")):
        try:
            table += summary(cell, kernels(profile(cell, args.impl, out)))
        except (subprocess.CalledProcessError, KeyError) as exc:
            table.append(f"| {cell} | failed: {exc!r}"[:300] + " |")
        print("\n".join(table[-1:]), flush=True)
    (out / "ncu_cells.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
