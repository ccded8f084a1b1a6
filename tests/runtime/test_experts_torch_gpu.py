"""TORCH experts on a CUDA GPU (SM 9.0+): the same checks as on the CPU, with the device's GEMMs.

Tolerances (relative, see helpers_experts.assert_rel_close), bf16 hidden: vs the float64 model of
TORCH's rounding points, rounded to bf16, RMS 2e-3 and max 2^-7 (the GPU accumulates in another
order, so a few more bf16 outputs round the other way). fp8_block_scales: RMS 3e-2, max 6e-2, as
against VANILLA on the CPU: a GEMM output that rounds the other way in bf16 can move an intermediate
across an fp8 rounding boundary (the CPU test, whose reduction order the model matches, is the sharp
one). EPLB and EP splits: 1e-6 in fp32.
"""
import pytest
import torch

from runtime.experts.base import DictExpertSource, ExpertParallel, MoeShape
from runtime.experts.torch_grouped import TorchGroupedMmBf16Experts

from .helpers_experts import (assert_rel_close, make_expert_tensors, random_hidden, random_routing, reference_moe,
                              registry_classes)

TORCH_EXPERTS = registry_classes("TORCH")

pytestmark = pytest.mark.gpu

SHAPES = {"bf16": (40, 24), "fp8_block_scales": (200, 136), "w4a16_mxfp4": (64, 96), "w4a16_nvfp4": (48, 80)}


@pytest.mark.parametrize("activation", ["silu_glu", "swiglu_oai", "relu2"])
@pytest.mark.parametrize("cls", TORCH_EXPERTS, ids=lambda c: c.FORMAT)
def test_torch_on_gpu_matches_reference(cls, activation):
    h, i = SHAPES[cls.FORMAT]
    spec = MoeShape(h, i, 6, 2, activation, expert_bias=activation == "swiglu_oai")
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=101, weight_std=3.0 if activation == "swiglu_oai" else 1.0)
    # materialized from meta straight onto the GPU, as a generated build does
    module = cls(spec, device="meta").to_empty(device="cuda")
    module.load_weights(DictExpertSource(tensors))
    assert all(b.device.type == "cuda" for b in module.buffers())
    for tokens, experts in ((57, None), (13, [2, 5]), (1, None)):      # (13, ...) leaves 4 experts empty
        ids, weights = random_routing(tokens, spec, seed=102 + tokens, experts=experts)
        hidden = random_hidden(tokens, spec, seed=103 + tokens)
        out = module(hidden.cuda(), ids.cuda(), weights.cuda())
        expected = reference_moe(hidden, ids, weights, tensors, spec, cls.FORMAT, grouped_bf16=True)
        if cls.FORMAT == "fp8_block_scales":
            assert_rel_close(out.cpu(), expected.bfloat16(), 3e-2, 6e-2)
        else:
            assert_rel_close(out.cpu(), expected.bfloat16(), 2e-3, 2.0 ** -7)
    empty = module(hidden[:0].cuda(), ids[:0].cuda(), weights[:0].cuda())
    assert empty.shape == (0, h)


def test_torch_on_gpu_eplb_and_ep_sum_to_the_whole():
    spec = MoeShape(32, 24, 6, 2, "swiglu_oai", expert_bias=True)
    tensors = make_expert_tensors(spec, "bf16", seed=111)
    ids, weights = random_routing(40, spec, seed=112)
    hidden = random_hidden(40, spec, seed=113, dtype=torch.float32).cuda()
    ids, weights = ids.cuda(), weights.cuda()
    whole = TorchGroupedMmBf16Experts.from_checkpoint(spec, ExpertParallel(), DictExpertSource(tensors), "cuda")
    expected = whole(hidden, ids, weights)
    whole.set_eplb_plan((0, 1, 2, 3, 4, 5, 1, 1, 3))
    assert torch.equal(whole(hidden, ids, weights), expected)
    parts = []
    for rank in range(2):
        module = TorchGroupedMmBf16Experts(spec, ExpertParallel(ep_size=2, ep_rank=rank), device="cuda")
        module.set_eplb_plan((0, 1, 2, 3, 5, 2, 3, 4, 3, 0, 1, 5))
        module.load_weights(DictExpertSource(tensors))
        parts.append(module(hidden, ids, weights))
    assert_rel_close((parts[0] + parts[1]).cpu(), expected.cpu(), 1e-6, 1e-6)
