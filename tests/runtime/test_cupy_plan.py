"""The CUPY classes' host-side choices on a machine without a GPU: which path and tile a call plans, and
that every kernel a plan names is one the source instantiates (a name the module lacks fails only on
the GPU, at the first call)."""
import re

import pytest

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
