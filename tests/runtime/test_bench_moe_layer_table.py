"""bench/moe_layer.py's report table on the CPU: a cell as `run` records it becomes one row with both of ours'
times (the build's router and torch's) and whether the replayed graph gave the eager call's bits, so a GPU run
spends no device time on a table that fails to print."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import moe_layer  # noqa: E402  (bench/moe_layer.py)


def _cell(**over):
    cell = {"shape": "Q", "format": "w4a16_mxfp4", "tokens": 1, "routing": "uniform", "ours_us": 28.6,
            "ours_torch_router_us": 41.6, "replay_matches_eager": True, "path": "pairs", "tile": (1, 1),
            "active_experts": 8, "weight_bytes": 2.0e7, "flops": 7.5e7, "t_lb_us": 4.7, "r_roof": 0.164,
            "best_peer": "torch_pipeline", "best_peer_us": 122.5, "r_peer": 4.28, "impl": "cupy.mma.grouped_gemm.w4a16_mxfp4",
            "vllm_us": None, "r_peer_vllm": None, "tflops": 2.6, "tb_per_s": 0.7}
    cell.update(over)
    return cell


def test_the_table_gives_each_cell_its_row_with_both_routers_and_the_replay_check():
    result = {"gpu": "NVIDIA H200", "sms": 132, "torch": "2.11.0", "commit": "abc1234", "date": "2026-12-02",
              "ceilings": {"copy_bytes_per_s": 4.25e12, "bf16_flops": 7.7e14, "fp8_flops": 1.46e15},
              "cells": [_cell(), _cell(format="bf16", ours_us=37.1, ours_torch_router_us=51.5, replay_matches_eager=False,
                                       vllm_us=57.0, r_peer_vllm=57.0 / 37.1)],
              "missing": [], "errors": []}
    lines = moe_layer.markdown(result).splitlines()
    header, rule, first, second = lines[2:6]
    assert header.split(" | ")[4:7] == ["ours µs", "replay = eager", "ours with torch's router µs"]
    assert header.count("|") == rule.count("|") == first.count("|") == second.count("|")
    assert first.startswith("| Q | w4a16_mxfp4 | uniform | 1 | 28.6 | yes | 41.6 | - | - | 122.5 (torch_pipeline) |")
    assert second.startswith("| Q | bf16 | uniform | 1 | 37.1 | NO | 51.5 | 57 | 1.54 |")


def test_a_cell_names_the_gemm_kernels_it_launched_split_factor_included():
    result = {"gpu": "NVIDIA H200", "sms": 132, "torch": "2.11.0", "commit": "abc1234", "date": "2026-12-03",
              "ceilings": {"copy_bytes_per_s": 4.25e12, "bf16_flops": 7.7e14, "fp8_flops": 1.46e15},
              "cells": [_cell(gemm_kernels={"gemm1": "moe_gemm_2_0_0_1_1_2_pairs", "gemm2": "moe_gemm_2_0_2_1_1_1_pairs"}),
                        _cell(path="grouped_mm", gemm_kernels={})],
              "missing": [], "errors": []}
    with_kernels, without = moe_layer.markdown(result).splitlines()[4:6]
    assert with_kernels.endswith(" pairs (1, 1) [moe_gemm_2_0_0_1_1_2_pairs, moe_gemm_2_0_2_1_1_1_pairs] |")
    assert without.endswith(" grouped_mm (1, 1) |")


def test_vllm_times_count_only_on_the_gpu_type_they_were_measured_on():
    assert moe_layer.vllm_us("Q", "bf16", 1, "uniform", "NVIDIA H200") == 57.0
    assert moe_layer.vllm_us("Q", "bf16", 1, "uniform", "NVIDIA H100 80GB HBM3") is None
    assert moe_layer.vllm_us("Q", "bf16", 1, "skewed", "NVIDIA H200") is None
    result = {"gpu": "NVIDIA H100 80GB HBM3", "sms": 132, "torch": "2.11.0", "commit": "abc1234", "date": "2026-12-07",
              "ceilings": {"copy_bytes_per_s": 3.0e12, "bf16_flops": 6.8e14, "fp8_flops": 1.45e15},
              "cells": [_cell()], "missing": [], "errors": []}
    assert moe_layer.markdown(result).splitlines()[-1] == (
        "No vLLM time or R_peer vs vLLM: the research note's times are an H200's.")
    result["gpu"] = "NVIDIA H200"
    assert "R_peer vs vLLM:" not in moe_layer.markdown(result)


def test_tile_fill_counts_each_experts_last_tile_as_padded():
    gen = torch.Generator().manual_seed(7)
    ids = torch.rand(300, 16, generator=gen).topk(4, dim=1).indices
    rows = [int((ids == e).sum()) for e in range(16)]
    tiled = sum(-(-n // 32) * 32 for n in rows)   # whole tiles of 32 rows an expert, counted here
    assert moe_layer.tile_fill(ids, 16, 32) == 1200 / tiled
    assert moe_layer.tile_fill(torch.tensor([[0, 1], [0, 2], [0, 1]]), 4, 2) == 6 / 8


def test_a_grouped_gemm_cell_shows_its_tile_fill():
    result = {"gpu": "NVIDIA H200", "sms": 132, "torch": "2.11.0", "commit": "abc1234", "date": "2026-12-07",
              "ceilings": {"copy_bytes_per_s": 4.25e12, "bf16_flops": 7.7e14, "fp8_flops": 1.46e15},
              "cells": [_cell(path="triton", tile=((128, 128, 64, 8, 3, 8), (128, 256, 64, 8, 3, 8)), tile_fill=0.8076),
                        _cell()],
              "missing": [], "errors": []}
    grouped, pairs = moe_layer.markdown(result).splitlines()[4:6]
    assert grouped.endswith(" triton ((128, 128, 64, 8, 3, 8), (128, 256, 64, 8, 3, 8)) fill 0.81 |")
    assert pairs.endswith(" pairs (1, 1) |")
