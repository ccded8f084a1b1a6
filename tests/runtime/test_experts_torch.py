"""TORCH (grouped GEMM) experts: against a float64 model of their documented rounding, against
VANILLA, on awkward routings, and under dynamic EPLB plans.

Tolerances (relative, see helpers_experts.assert_rel_close), bf16 hidden:
- vs the float64 reference with TORCH's rounding points (bf16 weights, operands and GEMM outputs),
  itself rounded to bf16: RMS 1e-3, max 2^-8. Dropping fp8's activation quantization costs 4e-2.
- vs VANILLA (fp32 GEMMs): RMS 1e-2 and max 2e-2; fp8_block_scales RMS 3e-2 and max 5e-2, because a
  bf16-rounded GEMM output moves some intermediates across an fp8 rounding boundary.
- the same computation split over EP ranks or EPLB replicas, fp32 hidden: 1e-6.
"""
import pytest
import torch

from runtime.experts.base import DictExpertSource, ExpertParallel, MoeShape
from runtime.experts.torch_grouped import TorchGroupedMmBf16Experts

from .helpers_experts import (assert_rel_close, make_expert_tensors, random_hidden, random_routing,
                              reference_moe, registry_classes)

VANILLA = {cls.FORMAT: cls for cls in registry_classes("VANILLA")}
TORCH_EXPERTS = registry_classes("TORCH")
SHAPES = {"bf16": (40, 24), "fp8_block_scales": (200, 136), "w4a16_mxfp4": (64, 96), "w4a16_nvfp4": (48, 80)}
ACTS = {"silu_glu": dict(), "swiglu_oai": dict(expert_bias=True), "relu2": dict()}


def _build(cls, spec, tensors, parallel=ExpertParallel()):
    return cls.from_checkpoint(spec, parallel, DictExpertSource(tensors))


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("cls", TORCH_EXPERTS, ids=lambda c: c.FORMAT)
def test_torch_matches_reference_and_vanilla(cls, activation):
    h, i = SHAPES[cls.FORMAT]
    spec = MoeShape(h, i, 5, 3, activation, **ACTS[activation])
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=31, weight_std=3.0 if activation == "swiglu_oai" else 1.0)
    ids, weights = random_routing(33, spec, seed=32)
    hidden = random_hidden(33, spec, seed=33)
    out = _build(cls, spec, tensors)(hidden, ids, weights)
    assert out.dtype == torch.bfloat16 and out.shape == hidden.shape
    expected = reference_moe(hidden, ids, weights, tensors, spec, cls.FORMAT, grouped_bf16=True)
    assert_rel_close(out, expected.bfloat16(), 1e-3, 2.0 ** -8)
    vanilla = _build(VANILLA[cls.FORMAT], spec, tensors)(hidden, ids, weights)
    loose = cls.FORMAT == "fp8_block_scales"
    assert_rel_close(out, vanilla, 3e-2 if loose else 1e-2, 5e-2 if loose else 2e-2)


@pytest.mark.parametrize("cls", TORCH_EXPERTS, ids=lambda c: c.FORMAT)
def test_torch_routing_edge_cases(cls):
    h, i = SHAPES[cls.FORMAT]
    spec = MoeShape(h, i, 6, 2, "silu_glu")
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=41)
    torch_m, vanilla_m = _build(cls, spec, tensors), _build(VANILLA[cls.FORMAT], spec, tensors)
    loose = 3e-2 if cls.FORMAT == "fp8_block_scales" else 1e-2

    # experts 0, 2, 4, 5 get no tokens
    ids, weights = random_routing(17, spec, seed=42, experts=[1, 3])
    hidden = random_hidden(17, spec, seed=43)
    out = torch_m(hidden, ids, weights)
    expected = reference_moe(hidden, ids, weights, tensors, spec, cls.FORMAT, grouped_bf16=True)
    assert_rel_close(out, expected.bfloat16(), 1e-3, 2.0 ** -8)
    assert_rel_close(out, vanilla_m(hidden, ids, weights), loose, 2 * loose)

    # every pair on expert 4, and a single token
    ids = torch.full((9, 2), 4)
    weights = torch.rand(9, 2, generator=torch.Generator().manual_seed(44))
    hidden = random_hidden(9, spec, seed=45)
    assert_rel_close(torch_m(hidden, ids, weights), vanilla_m(hidden, ids, weights), loose, 2 * loose)
    assert_rel_close(torch_m(hidden[:1], ids[:1], weights[:1]), vanilla_m(hidden[:1], ids[:1], weights[:1]),
                     loose, 2 * loose)

    # no tokens at all
    empty = torch_m(hidden[:0], ids[:0], weights[:0])
    assert empty.shape == (0, h) and empty.dtype == torch.bfloat16


def test_torch_ignores_ids_outside_the_layer():
    spec = MoeShape(32, 16, 4, 2, "silu_glu")
    tensors = make_expert_tensors(spec, "bf16", seed=46)
    module = _build(TorchGroupedMmBf16Experts, spec, tensors)
    ids, weights = random_routing(8, spec, seed=47)
    hidden = random_hidden(8, spec, seed=48, dtype=torch.float32)
    padded = torch.where(torch.arange(2) == 1, torch.tensor([-1]), ids)       # second choice: padding id
    kept = module(hidden, ids[:, :1], weights[:, :1])
    assert torch.equal(module(hidden, padded, weights), kept)
    assert torch.equal(module(hidden, torch.where(padded < 0, 4, padded), weights), kept)


def test_torch_rejects_sizes_grouped_mm_cannot_run():
    with pytest.raises(ValueError) as err:
        TorchGroupedMmBf16Experts(MoeShape(36, 20, 4, 2, "silu_glu"), device="meta")
    assert str(err.value) == ("torch.grouped_mm.grouped_gemm.bf16: hidden_size 36 is not a multiple of 8 "
                              "(torch._grouped_mm strides); the per-rank intermediate size 20 is not a "
                              "multiple of 8 (torch._grouped_mm strides) (bf16 scale or kernel layout)")


# --- EPLB ------------------------------------------------------------------------------------------

EPLB_SPEC = MoeShape(32, 24, 6, 2, "swiglu_oai", expert_bias=True)
# 12 physical slots over 2 ep ranks; experts 0, 1, 3 and 5 have replicas on both ranks, expert 3 twice
# on rank 1, expert 4 only on rank 1 and expert 2 only on rank 0.
EPLB_SLOTS = (0, 1, 2, 3, 5, 2, 3, 4, 3, 0, 1, 5)


def _eplb_setup():
    tensors = make_expert_tensors(EPLB_SPEC, "bf16", seed=51)
    ids, weights = random_routing(40, EPLB_SPEC, seed=52)
    hidden = random_hidden(40, EPLB_SPEC, seed=53, dtype=torch.float32)
    return tensors, ids, weights, hidden


def test_eplb_plan_on_one_rank_changes_nothing():
    tensors, ids, weights, hidden = _eplb_setup()
    module = _build(TorchGroupedMmBf16Experts, EPLB_SPEC, tensors)
    before = module(hidden, ids, weights)
    module.set_eplb_plan(EPLB_SLOTS)
    assert torch.equal(module(hidden, ids, weights), before)


def test_eplb_plan_over_ep_ranks_sums_to_the_whole():
    tensors, ids, weights, hidden = _eplb_setup()
    whole = _build(TorchGroupedMmBf16Experts, EPLB_SPEC, tensors)(hidden, ids, weights)
    parts, plain_parts = [], []
    for rank in range(2):
        parallel = ExpertParallel(ep_size=2, ep_rank=rank)
        module = TorchGroupedMmBf16Experts(EPLB_SPEC, parallel)
        module.set_eplb_plan(EPLB_SLOTS)          # before loading: the plan decides what this rank holds
        module.load_weights(DictExpertSource(tensors))
        assert module.expert_ids == ((0, 1, 2, 3, 5), (0, 1, 3, 4, 5))[rank]
        assert module.w13.shape[0] == len(module.expert_ids)
        parts.append(module(hidden, ids, weights))
        plain_parts.append(_build(TorchGroupedMmBf16Experts, EPLB_SPEC, tensors, parallel)(hidden, ids, weights))
    assert_rel_close(parts[0] + parts[1], whole, 1e-6, 1e-6)
    assert_rel_close(plain_parts[0] + plain_parts[1], whole, 1e-6, 1e-6)
    # the plan really moved work: replicated experts' tokens are split between the ranks
    assert not torch.allclose(parts[0], plain_parts[0])
    # experts 0, 1 and 5 have one replica per rank: even tokens run on rank 0, odd ones on rank 1
    for rank in range(2):
        tokens = [t for t in range(40) if t % 2 == rank and set(ids[t].tolist()) <= {0, 1, 5}]
        other = parts[1 - rank][tokens]
        assert tokens and torch.equal(other, torch.zeros_like(other))


def test_eplb_plan_errors():
    tensors, *_ = _eplb_setup()
    module = TorchGroupedMmBf16Experts(EPLB_SPEC, ExpertParallel(ep_size=2, ep_rank=1))
    cases = [
        ((0, 1, 2, 3, 4), "an EPLB plan of 5 slots does not split over 2 ep ranks"),
        ((0, 1, 2, 3, 4, 6), "EPLB plan names expert 6, outside 0..5"),
        ((0, 1, 2, 3, 1, 0), "EPLB plan holds no replica of expert 4"),
    ]
    for slots, message in cases:
        with pytest.raises(ValueError) as err:
            module.set_eplb_plan(slots)
        assert str(err.value) == message
    module.load_weights(DictExpertSource(tensors))          # rank 1 holds experts 3, 4, 5
    with pytest.raises(ValueError) as err:
        module.set_eplb_plan((3, 4, 5, 0, 1, 2))
    assert str(err.value) == ("EPLB plan puts expert 0 on ep rank 1, whose loaded weights do not include it; "
                              "set the plan before load_weights")
    module.set_eplb_plan((0, 1, 2, 0, 1, 2, 3, 4, 5, 4, 4, 5))   # held experts only: accepted
