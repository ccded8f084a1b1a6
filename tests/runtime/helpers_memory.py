"""The memory scenario of a 4-bit TORCH layer, shared by the CPU test and the GPU test (tests/gpu/).

One moderate layer (32 experts, hidden 1024, intermediate 512, top-4, 16 tokens: a decode batch, where the dequantization workspace, not the activations, sets the peak), its packed
checkpoint tensors made before anything is measured, and the bound both tests assert:
peak <= 1.1 x (packed weight bytes + activations). "Activations" is measured, not modelled: the
extra memory the bf16 TORCH layer's forward needs on the same inputs above its own held weights
(the same permutation, GEMM outputs and combine, with no dequantization at all).
"""
import torch

from runtime.experts.base import DictExpertSource, ExpertParallel, MoeShape, dequantize_canonical, random_source
from runtime.experts.torch_grouped import TorchGroupedMmBf16Experts

SPEC = MoeShape(1024, 512, 32, 4, "silu_glu")
TOKENS = 16
BOUND = 1.1


def packed_source(fmt: str):
    return random_source(SPEC, fmt, range(SPEC.num_experts), torch.Generator().manual_seed(5))


def inputs(device):
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(TOKENS, SPEC.hidden_size, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(SPEC.num_experts, generator=g)[:SPEC.top_k] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, SPEC.top_k, generator=g).softmax(-1)
    return hidden.to(device), ids.to(device), weights.to(device)


def bf16_source(source, fmt: str):
    """The bf16 weights the packed ones hold (what the 4-bit TORCH classes used to keep after load)."""
    out = {}
    for expert in range(SPEC.num_experts):
        for proj in SPEC.projections:
            parts = {kind: t for (e, p, kind), t in source.tensors.items() if e == expert and p == proj}
            out[expert, proj, "weight"] = dequantize_canonical(fmt, parts, torch.bfloat16)
    return DictExpertSource(out)


def bf16_layer(source, device):
    """The bf16 TORCH layer on `bf16_source(...)`: the reference for results and for activations."""
    return TorchGroupedMmBf16Experts.from_checkpoint(SPEC, ExpertParallel(), source, device)
