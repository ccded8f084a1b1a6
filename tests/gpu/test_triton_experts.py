"""TRITON experts on an sm_90 GPU against the VANILLA class of the same format (fp32 GEMMs, on the CPU).

Every case draws fresh random weights, hidden states and routing and poisons the workspaces and
the output with NaN first (`debug_poison`). The Triton path is forced (`path="triton"`) with each
tile configuration the class can pick and a small one that leaves partial tiles everywhere; cases
cover odd sizes (hidden and intermediate sizes that are not multiples of the output blocks), experts
with no tokens, every token on the same experts (hot experts), dropped slots, an EP slice and MoE-TP
shards that sum to the whole layer, CUDA-graph replay, and the plan's switch to the CUPY path for
small calls.

Tolerances (relative, helpers_experts.assert_rel_close), those of the CUPY tests' grouped_mm path
and FP8 formats: bf16 RMS 1e-2, max 2^-5 (the down GEMM's rows are rounded to bf16 before the
combine); FP8 activations RMS 3e-2, max 8e-2 (an intermediate that rounds the other way in bf16 can
cross an FP8 rounding boundary). Graph replays: 1e-6; EP and TP splits: 4e-3 / 8e-2.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch

from runtime import kernels as K
from runtime.experts.base import DictExpertSource, ExpertParallel, MoeShape
from runtime.experts.triton_grouped import TritonWgmmaFp8BlockScalesExperts
from tests.gpu.helpers_graphs import allocated_during, assert_graph_replay_matches_eager, experts_workspace_bytes
from tests.runtime.helpers_experts import assert_rel_close, registry_classes, make_expert_tensors, random_hidden, random_routing

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy")
pytest.importorskip("triton")

TRITON_EXPERTS = registry_classes("TRITON")
VANILLA = {cls.FORMAT: cls for cls in registry_classes("VANILLA")}
# (hidden, intermediate): multiples of the K-blocks, not of the 128-wide output blocks (bf16)
SHAPES = {"bf16": (320, 192), "fp8_block_scales": (384, 256), "w4a16_mxfp4": (320, 192), "w4a16_nvfp4": (320, 192),
          "w4a8_mxfp4_fp8": (320, 192)}
FP8_ACTIVATIONS = tuple(fmt for fmt, aq in K.AQ.items() if aq)   # formats whose activations are E4M3 codes


def _tolerance(fmt):
    return (3e-2, 8e-2) if fmt in FP8_ACTIVATIONS else (1e-2, 2.0 ** -5)


def _configs(cls):
    """Every configuration the class plans with, and a 16-row tile with the smallest output block."""
    small_n = 128 if cls.FORMAT == "fp8_block_scales" else 64
    bk = 128 if cls.FORMAT == "fp8_block_scales" else 64
    small = ((16, small_n, bk, 4, 2), (16, 64, bk, 4, 2))
    configs = [cfg for _, cfg in cls.CONFIGS] + [small]
    if cls.FORMAT in ("w4a16_mxfp4", "w4a16_nvfp4", "w4a8_mxfp4_fp8"):
        # the packed decode (bf16x2 inline PTX, fp4_blocks.fp4_pair_packed) of each: the same bits
        configs = [tuple((*c, 0)[:6] for c in cfg) for cfg in configs]
        configs += [tuple(c + (True,) for c in cfg) for cfg in configs]
    if cls.FORMAT == "w4a16_mxfp4":
        # the overlapped kernel (runtime/kernels/gluon_w4.py) of each packed 8-warp configuration, the same bits,
        # and its 64-row tile with 4 stages (two CTAs an SM)
        configs += [tuple(c + (True,) for c in cfg) for cfg in configs if all(len(c) == 7 and c[3] == 8 for c in cfg)]
        configs += [((64, 64, 64, 8, 4, 8, True, True), (64, 128, 64, 8, 4, 8, True, True))]
    if cls.FORMAT == "fp8_block_scales":
        configs = [FP8_TRITON] + configs + list(FP8_OVERLAP)
    return list(dict.fromkeys(configs))


# the warp-specialized FP8 kernels (runtime/kernels/gluon_fp8.py): 128 token rows (two MMA warpgroups) with w2 blocks
# of 128 and 256 columns, and 64 (one): the same products, promotion and epilogue in the same K order as the Triton
# wgmma tile the plan runs up to 64 rows an expert, so the same bits
FP8_TRITON = ((64, 128, 128, 8, 3, 8), (64, 128, 128, 4, 4, 8))
FP8_OVERLAP = (((128, 128, 128, 8, 4, 8, False, True), (128, 128, 128, 8, 4, 8, False, True)),
               ((128, 128, 128, 8, 3, 8, False, True), (128, 256, 128, 8, 3, 8, False, True)),
               ((64, 128, 128, 4, 4, 8, False, True), (64, 128, 128, 4, 4, 8, False, True)))


def _same_bits_as(cfg, outs):
    """The configuration already run whose output `cfg` must equal bit for bit, or None."""
    if cfg in FP8_OVERLAP:
        return FP8_TRITON
    for cut in (7, 6):
        same = tuple(c[:cut] for c in cfg)
        if same != cfg and same in outs:
            return same
    return None


def _module(cls, spec, tensors, parallel=ExpertParallel()):
    module = cls(spec, parallel, device="meta").to_empty(device="cuda")
    module.load_weights(DictExpertSource({k: v for k, v in tensors.items() if k[0] in module.expert_ids}))
    module.debug_poison = True
    return module


def _reference(fmt, spec, tensors, hidden, ids, weights):
    return VANILLA[fmt].from_checkpoint(spec, ExpertParallel(), DictExpertSource(tensors))(hidden, ids, weights)


@pytest.mark.parametrize("activation", ["silu_glu", "swiglu_oai", "relu2"])
@pytest.mark.parametrize("cls", TRITON_EXPERTS, ids=lambda c: c.FORMAT)
def test_triton_path_matches_vanilla(cls, activation):
    h, i = SHAPES[cls.FORMAT]
    bias = activation == "swiglu_oai"
    spec = MoeShape(h, i, 8, 3, activation, expert_bias=bias)
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=zlib.crc32(f"{cls.FORMAT}{activation}".encode()) % 1000,
                                  weight_std=3.0 if bias else 1.0)
    module = _module(cls, spec, tensors)
    # 1 and 5: one partial tile; 37, 300: several tiles per expert; (40, [1, 4, 6]): every token on
    # the same three experts (hot), five experts with none
    for tokens, experts in [(1, None), (5, None), (37, None), (300, None), (40, [1, 4, 6])]:
        seed = 11 * tokens + len(experts or ())
        ids, weights = random_routing(tokens, spec, seed=seed, experts=experts)
        hidden = random_hidden(tokens, spec, seed=seed + 1)
        expected = _reference(cls.FORMAT, spec, tensors, hidden, ids, weights)
        outs = {}
        for cfg in _configs(cls):
            out = outs[cfg] = module(hidden.cuda(), ids.cuda(), weights.cuda(), path="triton", tile=cfg)
            torch.cuda.synchronize()
            assert out.dtype == torch.bfloat16 and not out.isnan().any(), (tokens, cfg)
            same = _same_bits_as(cfg, outs)
            if same is not None:
                # both MXFP4 decodes are exact, and the overlapped kernels run the same products, promotions and
                # epilogues in the same order as the configuration they extend (FP8: the Triton wgmma tile)
                assert torch.equal(out, outs[same]), (tokens, cfg, same, (out.float() - outs[same].float()).abs().max())
            try:
                assert_rel_close(out.cpu(), expected, *_tolerance(cls.FORMAT))
            except AssertionError as err:
                raise AssertionError(f"{cls.FORMAT} {activation} tokens={tokens} experts={experts} "
                                     f"cfg={cfg}: {err}") from None


REAL_SHAPES = {   # the layers of the SM90 targets, fewer experts
    "bf16": MoeShape(2048, 768, 16, 8, "silu_glu"),
    "fp8_block_scales": MoeShape(7168, 2048, 4, 2, "silu_glu"),
    "w4a16_mxfp4": MoeShape(2880, 2880, 4, 2, "swiglu_oai", expert_bias=True),
    "w4a16_nvfp4": MoeShape(2048, 768, 4, 2, "silu_glu"),
    "w4a8_mxfp4_fp8": MoeShape(2880, 2880, 4, 2, "swiglu_oai", expert_bias=True),
}


@pytest.mark.parametrize("cls", TRITON_EXPERTS, ids=lambda c: c.FORMAT)
def test_real_layer_shapes_run_the_planned_path_and_tile(cls):
    """The plan's thresholds at real layer widths: one token short of `TRITON_MIN_ROWS` rows per expert runs
    the CUPY path, from it each bucket of `CONFIGS` its own tile; every call equals VANILLA."""
    spec = REAL_SHAPES[cls.FORMAT]
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=21)
    module = _module(cls, spec, tensors)
    first = math.ceil(cls.TRITON_MIN_ROWS * spec.num_experts / spec.top_k)
    # 1100 tokens: more than 2048 routing pairs, so the multi-CTA routing sort runs too
    expected_plans = [(first - 1, None), (first, cls.CONFIGS[0][1]), (1100, cls.CONFIGS[-1][1])]
    for tokens, tile in expected_plans:
        path, planned = module.plan(tokens, spec.top_k)
        assert (path == "triton") == (tile is not None) and (tile is None or planned == tile), (tokens, path, planned)
        ids, weights = random_routing(tokens, spec, seed=22 + tokens)
        hidden = random_hidden(tokens, spec, seed=23 + tokens)
        out = module(hidden.cuda(), ids.cuda(), weights.cuda())
        assert_rel_close(out.cpu(), _reference(cls.FORMAT, spec, tensors, hidden, ids, weights),
                         *_tolerance(cls.FORMAT))


@pytest.mark.parametrize("cls", TRITON_EXPERTS, ids=lambda c: c.FORMAT)
def test_small_calls_run_the_cupy_path(cls):
    spec = MoeShape(*SHAPES[cls.FORMAT], 8, 2, "silu_glu")
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=25)
    module = _module(cls, spec, tensors)
    module.PAIRS_MAX_EXTRA_BYTES = 0   # the sorted path (three tokens on these small experts would plan the pairs one)
    # the CUPY plan: W4A16 decode tiles on the staged GEMMs, the others on the register GEMMs
    assert module.plan(3, 2)[0] == ("staged" if cls.FORMAT in K.STAGED else "kernels")
    ids, weights = random_routing(3, spec, seed=26)
    hidden = random_hidden(3, spec, seed=27)
    out = module(hidden.cuda(), ids.cuda(), weights.cuda())
    expected = _reference(cls.FORMAT, spec, tensors, hidden, ids, weights)
    assert_rel_close(out.cpu(), expected, *((3e-2, 8e-2) if cls.FORMAT in FP8_ACTIVATIONS else (4e-3, 2.0 ** -6)))


@pytest.mark.parametrize("cls", TRITON_EXPERTS, ids=lambda c: c.FORMAT)
def test_dropped_slots_contribute_nothing(cls):
    spec = MoeShape(*SHAPES[cls.FORMAT], 6, 1, "silu_glu")
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=31)
    module = _module(cls, spec, tensors)
    tokens = 130
    ids = torch.full((tokens, 1), 4, dtype=torch.long)
    ids[::7] = -1
    weights = torch.rand(tokens, 1, generator=torch.Generator().manual_seed(32))
    hidden = random_hidden(tokens, spec, seed=33)
    expected = _reference(cls.FORMAT, spec, tensors, hidden, ids.clamp(min=0), weights * (ids >= 0))
    out = module(hidden.cuda(), ids.cuda(), weights.cuda(), path="triton")
    assert_rel_close(out.cpu(), expected, *_tolerance(cls.FORMAT))
    assert torch.count_nonzero(out[::7].float()).item() == 0


@pytest.mark.parametrize("cls", TRITON_EXPERTS, ids=lambda c: c.FORMAT)
def test_ep_ranks_and_tp_shards_sum_to_the_whole(cls):
    h, i = (256, 256) if cls.FORMAT == "fp8_block_scales" else (192, 128)
    spec = MoeShape(h, i, 6, 2, "swiglu_oai", expert_bias=True)
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=51, weight_std=3.0)
    ids, weights = random_routing(90, spec, seed=52)
    hidden = random_hidden(90, spec, seed=53).cuda()
    ids, weights = ids.cuda(), weights.cuda()
    # every tile the plan can pick, the Gluon kernels among them (FP8: the TP shards' intermediate of 128 channels is
    # one K step, an odd count)
    for tile in dict.fromkeys(cfg for _, cfg in cls.CONFIGS):
        whole = _module(cls, spec, tensors)(hidden, ids, weights, path="triton", tile=tile).float()
        for parallels in ([ExpertParallel(ep_size=2, ep_rank=r) for r in range(2)],
                          [ExpertParallel(moe_tp_size=2, moe_tp_rank=r) for r in range(2)]):
            total = sum(_module(cls, spec, tensors, p)(hidden, ids, weights, path="triton", tile=tile).float()
                        for p in parallels)
            # a MoE-TP shard quantizes its half of the intermediate with its own scales
            fp8_tp = cls.FORMAT in FP8_ACTIVATIONS and parallels[0].moe_tp_size > 1
            assert_rel_close(total.cpu(), whole.cpu(), 4e-2 if fp8_tp else 1e-2, 8e-2)


@pytest.mark.parametrize("tile", [None, FP8_OVERLAP[0]], ids=["planned", "warp-specialized"])
@pytest.mark.parametrize("tokens", [64, 300, 1100])   # 1100 x top-2: the multi-CTA routing sort
def test_cuda_graph_capture_and_replay(tokens, tile):
    cls = TritonWgmmaFp8BlockScalesExperts
    spec = MoeShape(384, 256, 8, 2, "swiglu_oai", expert_bias=True)
    module = _module(cls, spec, make_expert_tensors(spec, cls.FORMAT, seed=41, weight_std=3.0))
    assert_graph_replay_matches_eager(module, spec, tokens, path="triton", tile=tile)


@pytest.mark.parametrize("cls", [c for c in TRITON_EXPERTS if c.FORMAT != "fp8_block_scales"], ids=lambda c: c.FORMAT)
def test_every_prefill_tile_replays_in_a_cuda_graph(cls):
    """bf16 and the FP4 formats (FP8: the test above): each tile of `CONFIGS`, the overlapped Gluon MXFP4 kernel among them,
    captured once and replayed on fresh inputs gives its eager call's output."""
    spec = MoeShape(*SHAPES[cls.FORMAT], 8, 2, "swiglu_oai", expert_bias=True)
    module = _module(cls, spec, make_expert_tensors(spec, cls.FORMAT, seed=45, weight_std=3.0))
    for _, cfg in cls.CONFIGS:
        assert_graph_replay_matches_eager(module, spec, 300, path="triton", tile=cfg)


@pytest.mark.parametrize("cls", [c for c in TRITON_EXPERTS if "fp4" in c.FORMAT], ids=lambda c: c.FORMAT)
def test_the_fp4_prefill_gemms_keep_the_weights_packed(cls):
    """The Triton and Gluon FP4 GEMMs decode the packed words in their registers: a prefill call of each tile of
    `CONFIGS` allocates no more than its workspaces. A bf16 copy of the layer's weights (3.6-3.8x its packed bytes)
    would not fit the bound."""
    spec = MoeShape(2048, 768, 16, 8, "silu_glu")
    module = cls(spec, device="cuda")
    module.init_random(torch.Generator().manual_seed(64))
    packed = sum(b.numel() * b.element_size() for b in module.buffers())
    tokens = 512   # 256 rows an expert: the Triton path
    ids, weights = random_routing(tokens, spec, seed=65)
    hidden = random_hidden(tokens, spec, seed=66).cuda()
    ids, weights = ids.cuda(), weights.cuda()
    activations = experts_workspace_bytes(tokens, spec)
    assert 3 * packed > 0.1 * packed + 1.1 * activations   # the bound can tell a dequantized copy
    for _, cfg in cls.CONFIGS:
        module(hidden, ids, weights, path="triton", tile=cfg)   # compile, caches
        _, extra, _ = allocated_during(lambda: module(hidden, ids, weights, path="triton", tile=cfg))
        assert extra <= 0.1 * packed + 1.1 * activations, (cfg, extra, packed, activations)


def test_gluon_fp8_gemm1_refuses_token_rows_past_32_bit_offsets():
    """gemm1 gathers token rows at 32-bit offsets: an x of 2^31 codes or more is refused before any launch (an
    expanded view: no memory behind it)."""
    from runtime.kernels import gluon_fp8

    x = torch.empty(1, 7168, dtype=torch.float8_e4m3fn, device="cuda").expand(2**31 // 7168 + 1, 7168)
    with pytest.raises(ValueError) as err:
        gluon_fp8.launch_gemm1(x, *[None] * 11, hidden=7168, inter=2048, top_k=8, max_tiles=1, alpha=1.0, limit=0.0,
                               gated=True, act=0, cfg=(128, 4, 8))
    assert str(err.value) == ("gluon FP8 gemm1 gathers token rows at 32-bit offsets: 299594 tokens of 7168 codes are "
                              "2^31 bytes or more; call it on fewer tokens at a time")
