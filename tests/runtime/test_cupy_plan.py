"""The CUPY classes' host-side choices on a machine without a GPU: which path and tile a call plans, which
split-K factor each GEMM takes, the kernels a call records as launched, and that every kernel a plan names is
one the source instantiates (a name the module lacks fails only on the GPU, at the first call)."""
import re

import numpy as np
import pytest
import torch

from registry.impls import load_registry
from runtime import kernels as K
from runtime.build import load_class
from runtime.experts.base import ExpertParallel, MoeShape

CUPY = [load_class(i.class_path) for i in load_registry().impls if i.backend == "CUPY"]


def _module(cls, experts=128, top_k=8):
    spec = MoeShape(2048, 768, experts, top_k, "silu_glu")
    return cls(spec, ExpertParallel(), device="meta")


@pytest.mark.parametrize("cls", CUPY, ids=lambda c: c.IMPL_ID)
def test_one_token_plans_the_pairs_path_and_more_tokens_the_sorted_one(cls):
    module = _module(cls)
    assert module.plan(1, 8) == ("pairs", K.SPLIT_TILE)
    for tokens in (2, 8, 64):
        assert module.plan(tokens, 8)[0] in ("kernels", "grouped_mm", "triton"), tokens


@pytest.mark.parametrize("fmt", sorted(K.WF))
def test_every_pair_kernel_a_plan_can_name_is_instantiated(fmt):
    epis = (K.EPI_GATED, K.EPI_RELU2, K.EPI_DOWN)
    source = K.source_text(K.gemm_instances(fmt, epis))
    defined = set(re.findall(r"moe_gemm_##WF##_##AQ##_##EPI##_1_1_##SK##_pairs", source))
    assert defined, "the pair-tile entry-point macro is gone from moe_kernels.cu"
    stamped = set(re.findall(r"MOE_GEMM_INSTANCE_PAIRS\((\d+), (\d+), (\d+), (\d+)\)", source))
    names = {f"moe_gemm_{wf}_{aq}_{epi}_1_1_{sk}_pairs" for wf, aq, epi, sk in stamped}
    for epi in epis:
        for sk in (1,) + K.SPLITS:
            assert K.gemm_name(fmt, epi, (*K.SPLIT_TILE, sk), pairs=True) in names, (epi, sk)
        assert K.gemm_name(fmt, epi, K.SPLIT_TILE, pairs=True) in names, epi


TRITON = [load_class(i.class_path) for i in load_registry().impls if i.backend == "TRITON"]


@pytest.mark.parametrize("cls", TRITON, ids=lambda c: c.IMPL_ID)
def test_triton_plans_its_tiles_from_min_rows_and_the_cupy_plan_below(cls):
    """Below TRITON_MIN_ROWS rows per expert the CUPY class's plan; from it the first CONFIGS bucket whose bound
    holds the rows; both GEMMs of a bucket walk the same token tiles and K-blocks that divide the class's unit."""
    module = _module(cls)
    cupy = next(base for base in cls.__mro__ if base.__name__.startswith("CupyMma"))
    first = -(-cls.TRITON_MIN_ROWS * 128 // 8)   # tokens of 128 experts, top-8
    assert module.plan(first - 1, 8) == cupy.plan(module, first - 1, 8)
    bounds = [bound for bound, _ in cls.CONFIGS]
    assert bounds == sorted(bounds) and bounds[-1] >= 1e9
    for tokens in (first, 2048, 8192):
        rows = tokens * 8 / 128
        expected = next(cfg for bound, cfg in cls.CONFIGS if rows <= bound)
        assert module.plan(tokens, 8) == ("triton", expected), tokens
    for cfg1, cfg2 in (cfg for _, cfg in cls.CONFIGS):
        assert cfg1[0] == cfg2[0]
        assert module._unit % cfg1[2] == 0 and module._unit % cfg2[2] == 0, (cfg1, cfg2)


class _Resident:
    """A stand-in for the kernels module: `per_sm` CTAs of every GEMM resident on each of 132 SMs."""

    def __init__(self, per_sm):
        self.per_sm = per_sm

    def persistent_grid(self, name, items):
        return min(items, self.per_sm * 132)


def _layer(cls, hidden, inter, experts, top_k):
    return cls(MoeShape(hidden, inter, experts, top_k, "silu_glu"), ExpertParallel(), device="meta")


def test_the_split_k_rule_picks_the_measured_winners_and_fills_a_second_wave():
    """`_split` against the forced split factors timed on the H200 (BENCHMARKS.md; 3 CTAs an SM): MXFP4
    (eleventh session) one token's G gate/up (720 items: SK = 1 fastest) and down (180: SK = 2), Q gate/up
    (192: SK = 2) and down (256: SK = 1), eight tokens' Q gate/up (SK = 1); FP8 (fourteenth) deepseek_v3's one
    token, gate/up 512 items, 1.29 waves at SK = 1 (SK = 2 fastest), and down 896 items, 2.26 waves (SK = 1)."""
    from runtime.experts.cupy_mma import CupyMmaFp8BlockScalesExperts, CupyMmaW4a16Mxfp4Experts

    kern, tile = _Resident(3), K.SPLIT_TILE
    g = _layer(CupyMmaW4a16Mxfp4Experts, 2880, 2880, 128, 4)
    assert g._split(kern, K.EPI_GATED, tile, 4, 2 * 2880, 2880, True) == (1, 1, 1)
    assert g._split(kern, K.EPI_DOWN, tile, 4, 2880, 2880, True) == (1, 1, 2)
    q = _layer(CupyMmaW4a16Mxfp4Experts, 2048, 768, 128, 8)
    assert q._split(kern, K.EPI_GATED, tile, 8, 2 * 768, 2048, True) == (1, 1, 2)
    assert q._split(kern, K.EPI_DOWN, tile, 8, 2048, 768, True) == (1, 1, 1)
    assert q._split(kern, K.EPI_GATED, tile, 64, 2 * 768, 2048) == (1, 1, 1)
    d = _layer(CupyMmaFp8BlockScalesExperts, 7168, 2048, 256, 8)
    assert d._split(kern, K.EPI_GATED, tile, 8, 2 * 2048, 7168, True) == (1, 1, 2)
    assert d._split(kern, K.EPI_DOWN, tile, 8, 7168, 2048, True) == (1, 1, 1)
    assert d._split(kern, K.EPI_GATED, (1, 1, 4), 8, 2 * 2048, 7168, True) == (1, 1, 4)   # a forced factor stays


def test_a_call_records_the_gemm_kernels_it_launched_with_their_split_factor():
    """`last_gemm_kernels` names what `_gemm` launched (what bench/moe_layer.py reports), the factor `_split` chose
    included; it starts empty at each call."""
    from runtime.experts.cupy_mma import CupyMmaW4a16Mxfp4Experts, _Tiles

    class Recorder(_Resident):
        def __init__(self, per_sm):
            super().__init__(per_sm)
            self.launched = []

        def launch(self, name, grid, block, args, stream):
            self.launched.append(name)

    kern, g = Recorder(3), _layer(CupyMmaW4a16Mxfp4Experts, 2880, 2880, 128, 4)
    assert g.last_gemm_kernels == {}
    tiles = _Tiles(4, (np.uint64(0), np.uint64(0), np.int32(128), np.int32(4)), 4, by_pair=True)
    for epi, n, k in ((K.EPI_GATED, 2 * 2880, 2880), (K.EPI_DOWN, 2880, 2880)):
        g._gemm(kern, 0, epi, K.SPLIT_TILE, tiles, None, None, None, None, None, 1, None, None, n, k, 2880, 4, 0, 1.0, 0.0)
    assert g.last_gemm_kernels == {"gemm1": "moe_gemm_2_0_0_1_1_1_pairs", "gemm2": "moe_gemm_2_0_2_1_1_2_pairs"}
    assert kern.launched == list(g.last_gemm_kernels.values())
    assert g._launch_inputs(torch.zeros(0, 2880), torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, 4)) is None
    assert g.last_gemm_kernels == {}   # a call with nothing to launch leaves no earlier call's names
