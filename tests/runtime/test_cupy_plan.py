"""The CUPY classes' host-side choices on a machine without a GPU: which path and tile a call plans, which
split-K factor each GEMM takes, the kernels a call records as launched, and that every kernel a plan names is
one the source instantiates (a name the module lacks fails only on the GPU, at the first call)."""
import re
import shutil
import subprocess

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


# The most tokens a call of Qwen3-30B-A3B's experts (128, top-8) runs on the pairs path, per format: the pairs beyond
# the expected distinct experts, E (1 - (1 - k/E)^T), re-read at most PAIRS_MAX_EXTRA_BYTES (8 MiB). bf16 experts
# hold 9.4 MB: 2 tokens re-read 0.50 of one (4.7 MB), 3 tokens 1.47 (13.9 MB). FP8 4.7 MB: 3 tokens 6.9 MB, 4 tokens
# 2.88 experts, 13.6 MB. The 4-bit formats 2.4 MB: 4 tokens 6.8 MB, 5 tokens 4.70 experts, 11.1 MB.
FOUR_BIT = ("w4a16_mxfp4", "w4a16_nvfp4", "w4a8_mxfp4_fp8")
LAST_PAIRS_TOKENS = {"bf16": 2, "fp8_block_scales": 3, **{fmt: 4 for fmt in FOUR_BIT}}


@pytest.mark.parametrize("cls", CUPY, ids=lambda c: c.IMPL_ID)
def test_a_few_tokens_plan_the_pairs_path_while_their_shared_experts_are_cheap_to_read_again(cls):
    module = _module(cls)
    last = LAST_PAIRS_TOKENS[cls.FORMAT]
    for tokens in range(1, last + 1):
        assert module.plan(tokens, 8) == ("pairs", K.SPLIT_TILE), tokens
    for tokens in (last + 1, 8, 64):
        assert module.plan(tokens, 8)[0] in ("kernels", "grouped_mm", "triton", "staged"), tokens
    # deepseek_v3's experts (7168 x 2048, 256 of them): two tokens re-read 0.25 of one, 22 MB in bf16, 11 MB in FP8,
    # 5.5 MB in the 4-bit formats
    large = cls(MoeShape(7168, 2048, 256, 8, "silu_glu"), ExpertParallel(), device="meta")
    assert large.plan(1, 8)[0] == "pairs"
    assert (large.plan(2, 8)[0] == "pairs") == (cls.FORMAT in FOUR_BIT)


@pytest.mark.parametrize("cls", CUPY, ids=lambda c: c.IMPL_ID)
def test_w4a16_decode_tiles_plan_the_staged_gemms_and_other_formats_the_register_ones(cls):
    module = _module(cls)
    for tokens in (5, 8, 64, 128):   # Qwen3-30B-A3B's experts: tiles (1, 1) and, at 128 tokens, (1, 2)
        path, tile = module.plan(tokens, 8)
        if cls.FORMAT in ("w4a16_mxfp4", "w4a16_nvfp4"):
            assert (path, module._staging(tile, None)) == ("staged", ((8, 2), (8, 2))), tokens
        else:
            assert path in ("kernels", "grouped_mm", "triton"), tokens
    assert module.plan(2048, 8)[0] != "staged"   # prefill tiles stay on the register (or Triton) GEMM


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

    def persistent_grid(self, name, items, threads=128, shared_mem=0):
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
            self.launched, self.blocks = [], []

        def launch(self, name, grid, block, args, stream, shared_mem=0):
            self.launched.append(name)
            self.blocks.append((block, shared_mem))

    kern, g = Recorder(3), _layer(CupyMmaW4a16Mxfp4Experts, 2880, 2880, 128, 4)
    assert g.last_gemm_kernels == {}
    tiles = _Tiles(4, (np.uint64(0), np.uint64(0), np.int32(128), np.int32(4)), 4, by_pair=True)
    for epi, n, k in ((K.EPI_GATED, 2 * 2880, 2880), (K.EPI_DOWN, 2880, 2880)):
        g._gemm(kern, 0, epi, K.SPLIT_TILE, tiles, None, None, None, None, None, 1, None, None, n, k, 2880, 4, 0, 1.0, 0.0)
    assert g.last_gemm_kernels == {"gemm1": "moe_gemm_2_0_0_1_1_1_pairs", "gemm2": "moe_gemm_2_0_2_1_1_2_pairs"}
    assert kern.launched == list(g.last_gemm_kernels.values())
    assert kern.blocks == [((128,), 0)] * 2
    # the staged GEMMs: their own kernels, 160 threads and the ring of stages as dynamic shared memory
    sorted_tiles = _Tiles(40, (np.uint64(0),) * 5, 32)
    for nt, kc, st in K.STAGED[g.FORMAT]:
        kern.launched, kern.blocks = [], []
        for epi, n, k in ((K.EPI_GATED, 2 * 2880, 2880), (K.EPI_DOWN, 2880, 2880)):
            g._gemm(kern, 0, epi, (1, nt), sorted_tiles, None, None, None, None, None, 1, None, None, n, k, 2880, 4, 0,
                    1.0, 0.0, (kc, st))
        assert g.last_gemm_kernels == {"gemm1": f"moe_gemm_2_0_0_1_{nt}_s{kc}x{st}",
                                       "gemm2": f"moe_gemm_2_0_2_1_{nt}_s{kc}x{st}"}
        assert kern.blocks == [((K.STAGED_THREADS,), K.staged_smem(2, nt, kc, st))] * 2
    assert g._launch_inputs(torch.zeros(0, 2880), torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, 4)) is None
    assert g.last_gemm_kernels == {}   # a call with nothing to launch leaves no earlier call's names


@pytest.mark.parametrize("fmt", sorted(K.STAGED))
def test_every_staged_kernel_a_call_can_name_is_instantiated_and_others_are_refused(fmt):
    source = K.source_text(K.gemm_instances(fmt, (K.EPI_GATED, K.EPI_RELU2, K.EPI_DOWN)))
    assert "moe_gemm_##WF##_0_##EPI##_1_##NT##_s##KC##x##ST(" in source
    stamped = set(re.findall(r"MOE_GEMM_INSTANCE_STAGED\((\d+), (\d+), (\d+), (\d+), (\d+)\)", source))
    names = {f"moe_gemm_{wf}_0_{epi}_1_{nt}_s{kc}x{st}" for wf, epi, nt, kc, st in stamped}
    module = next(cls for cls in CUPY if cls.FORMAT == fmt)(MoeShape(2048, 768, 128, 8, "silu_glu"), device="meta")
    for nt, kc, st in K.STAGED[fmt]:
        assert module._staging((1, nt), (kc, st)) == ((kc, st), (kc, st))
        for epi in (K.EPI_GATED, K.EPI_RELU2, K.EPI_DOWN):
            assert K.gemm_name(fmt, epi, (1, nt), staging=(kc, st)) in names, (epi, nt, kc, st)
    first = next((kc, st) for nt, kc, st in K.STAGED[fmt] if nt == 1)
    module.STAGED_PLAN = {}
    assert module._staging((1, 1), None) == (first, first)
    module.STAGED_PLAN = {(1, 1): (first, None)}   # GEMM2 on the register kernel
    assert module._staging((1, 1), None) == (first, None)
    assert module.plan(64, 8) == ("staged", (1, 1)) and module.plan(1, 8)[0] == "pairs"
    compiled = ", ".join(f"tile (1, {nt}) with {kc} x {st}" for nt, kc, st in K.STAGED[fmt])
    for tile, staging in (((1, 1), (3, 3)), ((2, 4), None)):
        with pytest.raises(ValueError) as err:
            module._staging(tile, staging)
        assert str(err.value) == (f"{module.IMPL_ID}: no staged GEMM for tile {tile} with stages {staging} "
                                  f"(compiled: {compiled})")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH: install the CUDA toolkit")
def test_the_staged_shared_memory_is_what_the_kernel_asks_for(tmp_path):
    """K.staged_smem against moe_kernels.cu's own `Stage` sizes, printed by a host program compiled from the source
    (the kernel traps when launched with less than ST stages and their barriers)."""
    configs = [(K.WF[fmt], nt, kc, st) for fmt, cfgs in K.STAGED.items() for nt, kc, st in cfgs]
    prints = "".join(f'  printf("%d\\n", {st} * Stage<{wf}, {nt}, {kc}>::BYTES + 16 * {st});\n'
                     for wf, nt, kc, st in configs)
    src = tmp_path / "stage.cu"
    src.write_text(f'#include <cstdio>\n#include "{K.SOURCE}"\nint main() {{\n{prints}  return 0;\n}}\n')
    exe = tmp_path / "stage"
    subprocess.run([shutil.which("nvcc"), "-std=c++17", "-arch=sm_90", str(src), "-o", str(exe)], check=True,
                   capture_output=True)
    printed = [int(v) for v in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    assert printed == [K.staged_smem(*cfg) for cfg in configs]
