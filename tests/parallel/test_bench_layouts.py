"""bench/layouts.py (issue 16's parallel-layout benchmark) as a CPU smoke run on two gloo ranks: tiny_qwen3_moe
saved by transformers, the one-process run and tp2, tp2_moetp1ep2 and dep2, each compared to the one-process
logits by the script itself; the data-parallel layout's batches rounded up to its replicas; a layout that fails
is reported in its row.

On the GPU machine the same functions time CUDA-graph steps under NCCL; here the steps run eagerly and the
timings mean nothing, so only the runs, the rows' shapes and the parity the script computes are checked (bf16:
sharded partial sums round differently, tests/parallel/common.py; measured here 4.0e-3 to 5.4e-3).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import build  # noqa: E402  (bench/build.py)
import layouts  # noqa: E402  (bench/layouts.py)

LAYOUTS = ["tp2", "tp2_moetp1ep2", "dep2"]


@pytest.mark.slow
def test_the_layouts_bench_runs_every_two_rank_layout_against_the_one_process_logits(tmp_path):
    build.save_checkpoint("tiny_qwen3_moe", 2, tmp_path, device="cpu")
    rows = layouts.run_layouts("tiny_qwen3_moe", 90, 2, LAYOUTS, tmp_path, "cpu", prefill=24, cached=16,
                               batches=(1, 4), reps=1)
    assert [r["parallel"] for r in rows] == ["tp1", *LAYOUTS]
    assert [r["layout"] for r in rows] == [[1, 1, 1, 1], [2, 2, 1, 1], [2, 1, 2, 1], [1, 1, 2, 2]]
    decoded = [sorted(k for k in r if k.endswith("_parity") and k.startswith("decode")) for r in rows]
    assert decoded == [["decode_b1_parity", "decode_b2_parity", "decode_b4_parity"],
                       ["decode_b1_parity", "decode_b4_parity"], ["decode_b1_parity", "decode_b4_parity"],
                       ["decode_b2_parity", "decode_b4_parity"]]
    assert all(r["build"].endswith(".modeling") for r in rows)
    for r in rows[1:]:
        for key in ("prefill_parity", *(k for k in r if k.startswith("decode") and k.endswith("_parity"))):
            assert r[key]["rel_err"] < 2e-2 and r[key]["top1"] >= 0.75, (r["parallel"], key, r[key])
    table = layouts.markdown(rows).splitlines()
    assert len(table) == 2 + len(rows) and table[2].startswith("| tp1 |") and table[-1].startswith("| dep2 |")
    # A layout the model cannot take (no experts class splits its 32-wide intermediate over 3 ranks) is a row
    # with the ranks' error; the others run.
    failed = layouts.run_layouts("tiny_qwen3_moe", 90, 2, ["tp3", "tp2"], tmp_path, "cpu", prefill=24, cached=16,
                                 batches=(1,), reps=1)
    assert [r["parallel"] for r in failed] == ["tp1", "tp3", "tp2"] and "error" not in failed[2]
    error = failed[1]["error"]
    assert "LaunchError: rank " in error and " of 3 failed" in error and "does not split over moetp3" in error
    assert layouts.markdown(failed).splitlines()[3].startswith("| tp3 | failed: ")
