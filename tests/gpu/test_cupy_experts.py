"""CUPY experts on an sm_90 GPU against the VANILLA class of the same format (fp32 GEMMs, on the CPU).

Every run draws fresh random weights, hidden states and routing, poisons the workspaces and the
output with NaN first (`debug_poison`: an element the kernels forget to write shows up as NaN), and
covers odd shapes (hidden and intermediate sizes that are not powers of two, edge n-blocks), experts
with no tokens, every token on the same experts, each warp tile and, for bf16, both paths.

Tolerances (relative, helpers_experts.assert_rel_close): formats with bf16 activations RMS 4e-3 and
max 2^-6 (one bf16 rounding of the intermediate and of the output, fp32 accumulation in another
order; the grouped_mm path also rounds GEMM outputs to bf16, as TORCH does); formats with FP8
activations RMS 3e-2 and max 8e-2 (an intermediate that rounds the other way in bf16 can cross an
FP8 rounding boundary), as the TORCH fp8 test. CUDA-graph replays, EP and TP splits: 1e-6 / 1e-2.
"""
from __future__ import annotations

import dataclasses
import importlib
import zlib

import pytest
import torch

from runtime import kernels as K
from runtime.experts.base import DictExpertSource, ExpertParallel, MoeShape
from runtime.experts.cupy_mma import CupyMmaBf16Experts
from runtime.kernels.layouts import w4a8_stored_order
from tests.gpu.helpers_graphs import allocated_during, assert_graph_replay_matches_eager, experts_workspace_bytes
from tests.runtime.helpers_experts import (assert_rel_close, make_expert_tensors, random_hidden, random_routing,
                                          registry_classes)

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

VANILLA = {cls.FORMAT: cls for cls in registry_classes("VANILLA")}
CUPY_EXPERTS = registry_classes("CUPY")
FP8_ACT = {"fp8_block_scales", "w4a8_mxfp4_fp8"}
# (hidden, intermediate): multiples of the kernels' K-chunk, not powers of two
SHAPES = {"fp8_block_scales": (384, 256)}
DEFAULT_SHAPE = (320, 192)


def _tolerance(fmt, path="kernels"):
    if fmt in FP8_ACT:
        return 3e-2, 8e-2
    # grouped_mm rounds both GEMM outputs to bf16 before the bias and the activation (as TORCH does)
    return (1e-2, 2.0 ** -5) if path == "grouped_mm" else (4e-3, 2.0 ** -6)


def _module(cls, spec, tensors, parallel=ExpertParallel()):
    module = cls(spec, parallel, device="meta").to_empty(device="cuda")
    mine = {k: v for k, v in tensors.items() if k[0] in module.expert_ids}
    module.load_weights(DictExpertSource(mine))
    module.debug_poison = True
    return module


def _reference(cls, spec, tensors, hidden, ids, weights):
    vanilla = VANILLA[cls.FORMAT].from_checkpoint(spec, ExpertParallel(), DictExpertSource(tensors))
    return vanilla(hidden, ids, weights)


@pytest.mark.parametrize("activation", ["silu_glu", "swiglu_oai", "relu2"])
@pytest.mark.parametrize("cls", CUPY_EXPERTS, ids=lambda c: c.FORMAT)
def test_cupy_matches_vanilla(cls, activation):
    h, i = SHAPES.get(cls.FORMAT, DEFAULT_SHAPE)
    bias = activation == "swiglu_oai"
    spec = MoeShape(h, i, 8, 3, activation, expert_bias=bias)
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=zlib.crc32(f"{cls.FORMAT}{activation}".encode()) % 1000,
                                  weight_std=3.0 if bias else 1.0)
    module = _module(cls, spec, tensors)
    # 1, 5: one-fragment tiles; 37, 80: 16- and 32-token tiles; 300: the 64-token tile (and bf16's
    # grouped_mm path); (40, [1, 4, 6]): every token on the same three experts, five with none
    cases = [(1, None), (5, None), (37, None), (80, None), (300, None), (40, [1, 4, 6])]
    for tokens, experts in cases:
        seed = 7 * tokens + len(experts or ())
        ids, weights = random_routing(tokens, spec, seed=seed, experts=experts)
        hidden = random_hidden(tokens, spec, seed=seed + 1)
        expected = _reference(cls, spec, tensors, hidden, ids, weights)
        paths = ("kernels", "grouped_mm") if cls.FORMAT == "bf16" else ("kernels",)
        for path in paths:
            out = module(hidden.cuda(), ids.cuda(), weights.cuda(), path=path)
            torch.cuda.synchronize()
            assert out.dtype == torch.bfloat16 and not out.isnan().any(), (tokens, path)
            try:
                assert_rel_close(out.cpu(), expected, *_tolerance(cls.FORMAT, path))
            except AssertionError as err:
                raise AssertionError(f"{cls.FORMAT} {activation} tokens={tokens} experts={experts} "
                                     f"path={path}: {err}") from None


REAL_SHAPES = {   # the layers of the SM90 targets (fewer experts): K = 2880 is an odd number of chunks
    "bf16": MoeShape(2048, 768, 16, 8, "silu_glu"),
    "fp8_block_scales": MoeShape(7168, 2048, 4, 2, "silu_glu"),
    "w4a16_mxfp4": MoeShape(2880, 2880, 8, 4, "swiglu_oai", expert_bias=True),
    "w4a8_mxfp4_fp8": MoeShape(2880, 2880, 8, 4, "swiglu_oai", expert_bias=True),
    "w4a16_nvfp4": MoeShape(2880, 2880, 8, 4, "swiglu_oai", expert_bias=True),
}


def _matches_the_reference(cls, spec, tensors, token_counts, seed):
    """The module of `tensors` on the GPU equals the CPU reference for fresh routing and inputs at each count."""
    module = _module(cls, spec, tensors)
    for tokens in token_counts:
        ids, weights = random_routing(tokens, spec, seed=seed + tokens)
        hidden = random_hidden(tokens, spec, seed=seed + 1 + tokens)
        out = module(hidden.cuda(), ids.cuda(), weights.cuda())
        assert_rel_close(out.cpu(), _reference(cls, spec, tensors, hidden, ids, weights), *_tolerance(cls.FORMAT))


@pytest.mark.parametrize("cls", CUPY_EXPERTS, ids=lambda c: c.FORMAT)
def test_real_layer_shapes(cls):
    spec = REAL_SHAPES[cls.FORMAT]
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=21, weight_std=3.0 if spec.expert_bias else 1.0)
    _matches_the_reference(cls, spec, tensors, (3, 70), seed=22)


@pytest.mark.parametrize("cls", CUPY_EXPERTS, ids=lambda c: c.FORMAT)
def test_split_k_decode_kernels_match_vanilla_and_repeat_exactly(cls):
    """Every split-K factor of the decode tile, forced, on K = 320 and 192 (5 and 3 chunks: with SK = 4
    and 3 chunks one warp of each group has none; FP8: 384 and 256, where warps' shares end inside a
    128-channel scale block), and the factor `_split` picks at T = 1 of the real layer shape: VANILLA's
    result within the usual bounds, and bit-identical on a second call (the partial sums meet in a fixed
    order)."""
    h, i = SHAPES.get(cls.FORMAT, DEFAULT_SHAPE)
    spec = MoeShape(h, i, 8, 3, "swiglu_oai", expert_bias=True)
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=81, weight_std=3.0)
    module = _module(cls, spec, tensors)
    for tokens in (1, 2, 5):
        ids, weights = random_routing(tokens, spec, seed=82 + tokens)
        hidden = random_hidden(tokens, spec, seed=83 + tokens)
        expected = _reference(cls, spec, tensors, hidden, ids, weights)
        for sk in (1,) + K.SPLITS:
            args = (hidden.cuda(), ids.cuda(), weights.cuda())
            first = module(*args, tile=(*K.SPLIT_TILE, sk))
            again = module(*args, tile=(*K.SPLIT_TILE, sk))
            torch.cuda.synchronize()
            assert torch.equal(first, again), (tokens, sk)
            try:
                assert_rel_close(first.cpu(), expected, *_tolerance(cls.FORMAT))
            except AssertionError as err:
                raise AssertionError(f"{cls.FORMAT} tokens={tokens} split={sk}: {err}") from None

    # as many experts as one token routes to: T = 1 uses every one
    real = dataclasses.replace(REAL_SHAPES[cls.FORMAT], num_experts=REAL_SHAPES[cls.FORMAT].top_k)
    tensors = make_expert_tensors(real, cls.FORMAT, seed=84, weight_std=3.0)
    module = _module(cls, real, tensors)
    kern = module._kernels(torch.device("cuda"))
    # one token: the items of one of its GEMMs (experts x N / 64) fill too few SMs, so that GEMM is split
    gemms = ((K.EPI_GATED, 2 * real.intermediate_size, real.hidden_size),
             (K.EPI_DOWN, real.hidden_size, real.intermediate_size))
    assert max(module._split(kern, epi, K.SPLIT_TILE, real.top_k, n, k, True)[2] for epi, n, k in gemms) > 1
    ids, weights = random_routing(1, real, seed=85)
    hidden = random_hidden(1, real, seed=86)
    out = module(hidden.cuda(), ids.cuda(), weights.cuda())
    assert_rel_close(out.cpu(), _reference(cls, real, tensors, hidden, ids, weights), *_tolerance(cls.FORMAT))


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("activation", ["silu_glu", "swiglu_oai", "relu2"])
@pytest.mark.parametrize("cls", CUPY_EXPERTS, ids=lambda c: c.FORMAT)
def test_the_pairs_path_gives_the_sorted_paths_bits(cls, activation, tokens):
    """A one-token call plans the pairs path (no moe_align: each routing pair is a tile), and so does a call of
    three tokens on these small experts (experts shared by its pairs are read again: well under 8 MiB). On fresh
    random inputs it gives the sorted kernels' output bit for bit at every split-K factor of the decode tile:
    on the whole layer, on each expert-parallel and MoE-TP rank (pairs of another rank's experts
    skipped), and with a dropped slot (id -1); and VANILLA's output within the usual bounds."""
    h, i = (384, 256) if cls.FORMAT == "fp8_block_scales" else (320, 128)   # MoE-TP halves: 128 and 64
    bias = activation == "swiglu_oai"
    spec = MoeShape(h, i, 8, 3, activation, expert_bias=bias)
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=zlib.crc32(f"pairs{cls.FORMAT}{activation}".encode()) % 1000,
                                  weight_std=3.0 if bias else 1.0)
    whole = _module(cls, spec, tensors)
    ranks = [_module(cls, spec, tensors, ExpertParallel(ep_size=2, ep_rank=r)) for r in range(2)]
    ranks += [_module(cls, spec, tensors, ExpertParallel(moe_tp_size=2, moe_tp_rank=r)) for r in range(2)]
    assert [m.plan(tokens, spec.top_k) for m in [whole] + ranks] == [("pairs", K.SPLIT_TILE)] * 5
    for seed in (3, 4):
        ids, weights = random_routing(tokens, spec, seed=100 + seed + 10 * tokens)
        if tokens > 1:
            ids[1] = ids[0]     # two tokens on the same experts: their pairs read those experts twice
        if seed == 4:
            ids[0, 1] = -1      # a dropped slot contributes nothing on either path
        hidden = random_hidden(tokens, spec, seed=200 + seed + 10 * tokens)
        args = (hidden.cuda(), ids.cuda(), weights.cuda())
        for module in [whole] + ranks:
            for sk in (1,) + K.SPLITS:
                pairs = module(*args, tile=(*K.SPLIT_TILE, sk))
                sorted_ = module(*args, path="kernels", tile=(*K.SPLIT_TILE, sk))
                torch.cuda.synchronize()
                assert not pairs.isnan().any(), (seed, sk)
                assert torch.equal(pairs.view(torch.int16), sorted_.view(torch.int16)), (seed, sk, module.parallel)
        expected = _reference(cls, spec, tensors, hidden, ids.clamp(min=0), weights * (ids >= 0))
        assert_rel_close(whole(*args).cpu(), expected, *_tolerance(cls.FORMAT))


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_a_top_k_beyond_one_combine_batch_sums_every_pair(tokens, bias):
    """moe_combine and the pair GEMM2's combine_tile take a token's pairs 8 at a time (COMBINE_BATCH): a top-k of
    11 is a full batch and a partial one. With a dropped slot in each batch, on the pairs path (one token: the
    combine in GEMM2) and the sorted path (moe_combine), the whole layer matches VANILLA, and two expert-parallel
    ranks (each skipping the other's pairs) sum to it."""
    spec = MoeShape(320, 128, 16, 11, "swiglu_oai" if bias else "silu_glu", expert_bias=bias)
    tensors = make_expert_tensors(spec, "bf16", seed=71 + bias, weight_std=3.0 if bias else 1.0)
    ids, weights = random_routing(tokens, spec, seed=72 + tokens)
    ids[0, 2] = -1
    ids[-1, 9] = -1
    hidden = random_hidden(tokens, spec, seed=73 + tokens)
    args = (hidden.cuda(), ids.cuda(), weights.cuda())
    whole = _module(CupyMmaBf16Experts, spec, tensors)
    assert whole.plan(tokens, spec.top_k)[0] == ("pairs" if tokens == 1 else "kernels")
    expected = _reference(CupyMmaBf16Experts, spec, tensors, hidden, ids.clamp(min=0), weights * (ids >= 0))
    out = whole(*args)
    assert not out.isnan().any()
    assert_rel_close(out.cpu(), expected, *_tolerance("bf16"))
    ranks = [_module(CupyMmaBf16Experts, spec, tensors, ExpertParallel(ep_size=2, ep_rank=r)) for r in range(2)]
    total = sum(rank(*args).float() for rank in ranks)
    assert_rel_close(total.cpu(), out.float().cpu(), 4e-3, 8e-2)


@pytest.mark.parametrize("tokens", [1, 6])
def test_the_pairs_path_replays_in_a_cuda_graph(tokens):
    spec = MoeShape(320, 192, 8, 2, "swiglu_oai", expert_bias=True)
    module = _module(CupyMmaBf16Experts, spec, make_expert_tensors(spec, "bf16", seed=43, weight_std=3.0))
    assert module.plan(tokens, spec.top_k)[0] == "pairs"
    assert_graph_replay_matches_eager(module, spec, tokens)


@pytest.mark.parametrize("cls", [c for c in CUPY_EXPERTS if "mxfp4" in c.FORMAT], ids=lambda c: c.FORMAT)
def test_mxfp4_scales_above_two_take_the_second_factor(cls):
    """E8M0 bytes above 128 (scales > 2^1, beyond one bf16 multiplier in the w4a16 kernel) on some
    blocks of some rows: the kernel's second factor 2^(e-128) gives VANILLA's result."""
    h, i = DEFAULT_SHAPE
    spec = MoeShape(h, i, 8, 3, "silu_glu")
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=91)
    gen = torch.Generator().manual_seed(92)
    for key in [k for k in tensors if k[2] == "weight_scale"]:
        scale = tensors[key]
        bump = (torch.rand(scale.shape, generator=gen) < 0.3).to(torch.uint8) * torch.randint(
            8, 20, scale.shape, generator=gen, dtype=torch.uint8)
        tensors[key] = (scale.int() + bump.int()).clamp(max=254).to(torch.uint8)
    assert max(int(tensors[k].max()) for k in tensors if k[2] == "weight_scale") > 128
    _matches_the_reference(cls, spec, tensors, (1, 37), seed=93)


@pytest.mark.parametrize("cls", CUPY_EXPERTS, ids=lambda c: c.FORMAT)
def test_all_tokens_on_one_expert_and_ids_outside_the_layer(cls):
    h, i = SHAPES.get(cls.FORMAT, DEFAULT_SHAPE)
    spec = MoeShape(h, i, 6, 1, "silu_glu")
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=31)
    module = _module(cls, spec, tensors)
    tokens = 130
    ids = torch.full((tokens, 1), 4, dtype=torch.long)
    ids[::7] = -1           # dropped slots (ids outside 0..E-1) contribute nothing
    weights = torch.rand(tokens, 1, generator=torch.Generator().manual_seed(32))
    hidden = random_hidden(tokens, spec, seed=33)
    expected = _reference(cls, spec, tensors, hidden, ids.clamp(min=0), weights * (ids >= 0))
    out = module(hidden.cuda(), ids.cuda(), weights.cuda())
    assert_rel_close(out.cpu(), expected, *_tolerance(cls.FORMAT))
    assert torch.count_nonzero(out[::7].float()).item() == 0


@pytest.mark.parametrize("width", [384, 7168, 9216])
def test_fp8_activation_quantization_matches_the_codecs(width):
    """quant_fp8_rows against runtime/formats/fp8.py, bit for bit: a row of under one pass of the CTA, DeepSeek-V3's
    7168 (seven passes, one batch of loads) and 9216 (two batches of QUANT_PASSES)."""
    import numpy as np

    from runtime import kernels as K
    from runtime.formats import fp8

    kern = K.load(K.gemm_instances("fp8_block_scales", (K.EPI_DOWN,)), "cuda")
    x = (torch.randn(9, width, generator=torch.Generator().manual_seed(width)) * 3).bfloat16()
    x[2, :128] = 0          # an all-zero group: amax floored at 1e-4
    x[5, -3] = 40.0         # a row's largest element in its last pass
    xg = x.cuda()
    stream = torch.cuda.current_stream().cuda_stream
    for mode in (1, 2):
        q = torch.empty(9, width, dtype=torch.uint8, device="cuda")
        s = torch.empty((9, width // 128) if mode == 1 else (9,), dtype=torch.float32, device="cuda")
        kern.launch("quant_fp8_rows", (9,), (128,), (np.uint64(xg.data_ptr()), np.uint64(0), np.uint64(q.data_ptr()),
                                                      np.uint64(s.data_ptr()), np.int32(width), np.int32(mode)), stream)
        if mode == 1:
            codes, scales = fp8.quantize_act_groups(x)
        else:
            codes, scales = fp8.quantize_act_per_token(x)
            scales = scales[:, 0]
            # the w4a8 GEMM reads each 64-chunk's words in its stored order
            codes = w4a8_stored_order(codes.view(torch.uint8)).view(torch.float8_e4m3fn)
        assert torch.equal(q.cpu(), codes.view(torch.uint8)), mode
        assert torch.equal(s.cpu(), scales.float()), mode


@pytest.mark.parametrize("tokens", [16, 300])
def test_cuda_graph_capture_and_replay(tokens):
    spec = MoeShape(320, 192, 8, 2, "swiglu_oai", expert_bias=True)
    tensors = make_expert_tensors(spec, "bf16", seed=41, weight_std=3.0)
    module = _module(CupyMmaBf16Experts, spec, tensors)
    assert_graph_replay_matches_eager(module, spec, tokens)


@pytest.mark.parametrize("tokens", [1, 8, 64, 600])
@pytest.mark.parametrize("cls", CUPY_EXPERTS, ids=lambda c: c.FORMAT)
def test_chained_layers_replay_with_overlapped_launches_as_eager(cls, tokens):
    """Two router + experts layers, the second routing the first one's output, captured in one CUDA graph.
    There each of our kernels starts while its predecessor ends (programmatic dependent launch,
    runtime/kernels/driver.py); the host launches eager calls too slowly for that. A kernel reading its
    predecessor's output before its wait, or a GEMM2 whose early reads (tiles, experts, L2 prefetch) were
    not final, gives other bits in the replays. Up to 64 tokens the router is the fused kernel; 600 tokens
    (2400 pairs) take torch's router and the multi-CTA sort."""
    from runtime.graphs import capture
    from runtime.kernels import router as router_kernel

    h, i = SHAPES.get(cls.FORMAT, DEFAULT_SHAPE)
    spec = MoeShape(h, i, 16, 4, "silu_glu")
    module = _module(cls, spec, make_expert_tensors(spec, cls.FORMAT, seed=71))
    module.debug_poison = False
    gate = (torch.randn(spec.num_experts, h, generator=torch.Generator().manual_seed(72)) / h ** 0.5).bfloat16().cuda()
    x = torch.empty(tokens, h, dtype=torch.bfloat16, device="cuda")

    def two_layers():
        y = x
        for _ in range(2):
            if router_kernel.applies(y, gate, spec.top_k):
                ids, weights = router_kernel.route(y, gate, spec.top_k, router_kernel.SOFTMAX, round_logits=True,
                                                   renormalize=True)
            else:
                weights, ids = torch.softmax((y @ gate.t()).float(), dim=-1).topk(spec.top_k, dim=-1)
                weights = weights / weights.sum(dim=-1, keepdim=True)
            y = module(y, ids, weights) * 4.0   # keeps the second layer's input at the first one's scale
        return y

    x.copy_(random_hidden(tokens, spec, seed=73))
    module.prepare("cuda")
    graph, out = capture(two_layers)
    for seed in range(74, 82):
        x.copy_(random_hidden(tokens, spec, seed=seed))
        graph.replay()
        replayed = out.clone()
        eager = two_layers()
        torch.cuda.synchronize()
        assert not eager.isnan().any()
        assert torch.equal(replayed.view(torch.int16), eager.view(torch.int16)), (seed, cls.FORMAT, tokens)


@pytest.mark.parametrize("cls", CUPY_EXPERTS, ids=lambda c: c.FORMAT)
def test_ep_ranks_and_tp_shards_sum_to_the_whole(cls):
    h, i = (256, 256) if cls.FORMAT == "fp8_block_scales" else (192, 128)
    spec = MoeShape(h, i, 6, 2, "swiglu_oai", expert_bias=True)
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=51, weight_std=3.0)
    ids, weights = random_routing(50, spec, seed=52)
    hidden = random_hidden(50, spec, seed=53).cuda()
    ids, weights = ids.cuda(), weights.cuda()
    whole = _module(cls, spec, tensors)(hidden, ids, weights).float()
    for parallels in ([ExpertParallel(ep_size=2, ep_rank=r) for r in range(2)],
                      [ExpertParallel(moe_tp_size=2, moe_tp_rank=r) for r in range(2)]):
        total = sum(_module(cls, spec, tensors, p)(hidden, ids, weights).float() for p in parallels)
        # w4a8 shards scale their own slice of the intermediate per token (docs/runtime.md): close, not equal
        rms = 4e-2 if cls.FORMAT in FP8_ACT and parallels[0].moe_tp_size > 1 else 4e-3
        assert_rel_close(total.cpu(), whole.cpu(), rms, 8e-2)


@pytest.mark.parametrize("cls", [c for c in CUPY_EXPERTS if c.FORMAT.startswith("w4")], ids=lambda c: c.FORMAT)
def test_a_4bit_layer_keeps_its_weights_packed(cls):
    spec = MoeShape(2048, 768, 16, 8, "silu_glu")
    module = cls(spec, device="cuda")
    module.init_random(torch.Generator().manual_seed(61))
    torch.cuda.synchronize()
    packed = sum(b.numel() * b.element_size() for b in module.buffers())
    dense_bf16 = 16 * 3 * 2048 * 768 * 2
    assert packed < 0.3 * dense_bf16
    tokens = 256
    ids, weights = random_routing(tokens, spec, seed=62)
    hidden = random_hidden(tokens, spec, seed=63).cuda()
    ids, weights = ids.cuda(), weights.cuda()
    module(hidden, ids, weights)      # compile, caches
    _, extra, _ = allocated_during(lambda: module(hidden, ids, weights))
    activations = experts_workspace_bytes(tokens, spec)
    assert extra <= 0.1 * packed + 1.1 * activations, (extra, packed, activations)


# --- generated SM90 builds, reduced, against their CPU logits -------------------------------------

BUILDS = [
    ("generated.qwen3_30b_a3b.qwen3_30b_a3b_bf16__sm_90__tp1.modeling", 16),
    ("generated.gpt_oss_120b.gpt_oss_120b_mxfp4__sm_90__tp1.modeling", 8),
]


@pytest.mark.parametrize("path,experts", BUILDS, ids=lambda v: str(v).split(".")[1] if isinstance(v, str) else None)
@torch.no_grad()
def test_a_reduced_generated_build_runs_cupy_and_matches_its_cpu_logits(path, experts, monkeypatch):
    """Two decoder layers, a 512-token vocabulary and `experts` routed experts (the layer shapes
    otherwise the target's): the build binds CUPY on the GPU; the same module with VANILLA bound
    runs on the CPU. fp32 model, whose experts compute in bf16 on the GPU: RMS 3e-2 of the logits;
    8e-2 with FP8 activations (VANILLA quantizes the fp32 hidden states, CUPY their bf16 rounding, so
    some FP8 codes differ and the difference compounds over the layers)."""
    mod = importlib.import_module(path)
    (impl_id, (cls, backend)), = mod.IMPLEMENTATIONS.items()
    # a TRITON class is its format's CUPY class with Triton prefill GEMMs (qwen3's SM90 target binds one)
    assert backend in ("CUPY", "TRITON") and issubclass(cls, CUPY_EXPERTS)
    # The embedding and head are built from ARCHITECTURE (the vocabulary captured when the module loaded).
    monkeypatch.setattr(mod, "ARCHITECTURE", dataclasses.replace(mod.ARCHITECTURE, vocab_size=512))
    monkeypatch.setattr(mod, "NUM_EXPERTS", experts)
    monkeypatch.setattr(mod, "EXPERTS_SPEC", dataclasses.replace(mod.EXPERTS_SPEC, num_experts=experts))
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(71))

    gpu = mod.MODEL_CLASS(device="cuda", dtype=torch.float32, num_layers=2)
    gpu.init_random(seed=72)
    assert all(type(m) is cls for m in gpu.modules() if hasattr(m, "IMPL_ID"))
    logits = gpu(ids.cuda()).float().cpu()

    monkeypatch.setattr(mod, "IMPLEMENTATIONS", {impl_id: (VANILLA[cls.FORMAT], "VANILLA")})
    monkeypatch.setattr(mod, "CPU_IMPLS", (impl_id,))
    cpu = mod.MODEL_CLASS(device="cpu", dtype=torch.float32, num_layers=2)
    cpu.init_random(seed=72)
    expected = cpu(ids).float()
    assert_rel_close(logits, expected, *((8e-2, 2.5e-1) if cls.FORMAT in FP8_ACT else (3e-2, 1e-1)))


def test_nvrtc_compiles_the_kernels_of_one_format():
    """The path users take (no prebuilt cubin): CuPy's NVRTC compiles the source for this GPU."""
    from runtime import kernels as K

    module = cupy.RawModule(code=K.source_text(K.gemm_instances("w4a16_nvfp4", (K.EPI_GATED, K.EPI_DOWN))),
                            options=K.NVRTC_OPTIONS)
    for name in ("moe_align", "moe_combine", K.gemm_name("w4a16_nvfp4", K.EPI_GATED, (1, 1))):
        assert module.get_function(name).num_regs > 0


@pytest.mark.parametrize("tokens, experts, ep_size", [(200, 128, 2), (2600, 128, 2), (2600, 384, 1)])
def test_moe_align_is_a_counting_sort_by_local_expert(tokens, experts, ep_size):
    """The routing sort against one written here, with dropped slots and an EP rank's local map: 1600 pairs sort
    in one CTA (`moe_align`), 20 800 over 11 CTAs of 2048 (`moe_align_count` and `moe_align_scatter`, the last
    CTA ragged); twice in a row, as the multi-CTA sort's ticket must be back at zero after each call."""
    spec = MoeShape(64, 64, experts, 8, "silu_glu")
    module = CupyMmaBf16Experts(spec, ExpertParallel(ep_size=ep_size, ep_rank=ep_size - 1),
                                device="meta").to_empty(device="cuda")
    gen = torch.Generator().manual_seed(tokens + experts)
    n_local = len(module.expert_ids)
    local_of = torch.full((experts,), -1, dtype=torch.long)
    local_of[list(module.expert_ids)] = torch.arange(n_local)
    kern = module._kernels(torch.device("cuda"))
    for _ in range(2):
        ids = torch.randint(0, experts, (tokens, 8), generator=gen)
        ids[torch.rand(ids.shape, generator=gen) < 0.05] = -1
        pairs, bt = ids.numel(), 16
        flat = ids.view(-1)
        local = torch.where(flat >= 0, local_of[flat.clamp(min=0)], -1)
        counts = torch.bincount(local[local >= 0], minlength=n_local)
        routed = module._route(kern, torch.cuda.current_stream().cuda_stream, ids.cuda(), pairs, bt)
        torch.cuda.synchronize()
        _, offs, sorted_pair, sorted_expert, pair_pos, tile_expert, tile_row, num_tiles, _ = (
            t.cpu() if isinstance(t, torch.Tensor) else t for t in routed)
        assert offs.tolist() == [0] + torch.cumsum(counts, 0).tolist()
        total = int(offs[-1])
        for e in range(n_local):
            rows = slice(int(offs[e]), int(offs[e + 1]))
            assert sorted_pair[rows].sort().values.tolist() == torch.nonzero(local == e).view(-1).tolist(), e
            assert (sorted_expert[rows] == e).all()
        mine = local >= 0
        assert (pair_pos[~mine] == -1).all()
        assert torch.equal(sorted_pair[pair_pos[mine].long()], torch.nonzero(mine).view(-1).int())
        assert pair_pos[mine].unique().numel() == total
        tiles = [(e, int(offs[e]) + j * bt) for e in range(n_local) for j in range(-(-int(counts[e]) // bt))]
        assert int(num_tiles[0]) == len(tiles)
        assert list(zip(tile_expert[:len(tiles)].tolist(), tile_row[:len(tiles)].tolist())) == tiles
