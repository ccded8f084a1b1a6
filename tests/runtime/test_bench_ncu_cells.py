"""bench/ncu_cells.py's table on the CPU: each kernel's counters land under their own column, the wgmma pipe's
share given where ncu measured it and '-' where it could not, so a GPU run spends no device time on a table that
fails to print."""
from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import ncu_cells  # noqa: E402  (bench/ncu_cells.py)


def _kernel(rng, **over):
    kern = {name: rng.uniform(1, 99) for name in ncu_cells.METRICS}
    kern.update({"Kernel Name": "gemm1", "gpu__time_duration.sum": rng.uniform(1e5, 1e6),
                 "launch__grid_size": 3840.0, "launch__block_size": 384.0, "launch__registers_per_thread": 168.0,
                 "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": 2.5,
                 "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": 1.5,
                 "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio": 9.0})
    kern.update(over)
    return kern


def test_each_counter_lands_under_its_column():
    rng = random.Random()
    gmma = rng.uniform(1, 99)
    kern = _kernel(rng, **{ncu_cells.GMMA: gmma})
    measured, missing, total = ncu_cells.summary("Q:fp8_block_scales:8192", [kern, _kernel(rng)])
    header = [c.strip() for c in ncu_cells.HEADER[0].strip("|").split("|")]
    for line in (measured, missing, total):
        assert line.count("|") == ncu_cells.HEADER[0].count("|") == ncu_cells.HEADER[1].count("|")
    row = dict(zip(header, (c.strip() for c in measured.strip("|").split("|"))))
    assert row["µs"] == f"{kern['gpu__time_duration.sum'] / 1e3:.1f}"
    assert row["wgmma / L2 %"] == f"{gmma:.0f} / {kern['lts__throughput.avg.pct_of_peak_sustained_elapsed']:.0f}"
    assert row["L2 hit %"] == f"{kern['lts__t_sector_hit_rate.pct']:.0f}"
    assert row["largest stalls"] == "barrier 2.50, long_scoreboard 1.50"   # the issue cycle ('selected') is no wait
    other = dict(zip(header, (c.strip() for c in missing.strip("|").split("|"))))
    assert other["wgmma / L2 %"].startswith("- / ")
    assert total.split("|")[2].strip() == "all 2 kernels"
