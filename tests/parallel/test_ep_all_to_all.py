"""Expert parallel under attention data parallel (dep<N>) dispatches each (token, expert) pair to the rank
that owns the expert and combines it back (all-to-all), so replicas may hold different token counts."""
from __future__ import annotations

import pytest
import torch

from runtime.experts.base import DictExpertSource, ExpertParallel, MoeShape, random_source
from runtime.experts.vanilla import TorchEagerBf16Experts
from runtime.launch import launch
from runtime.ops import MoEBlock
from runtime.parallel import Layout
from runtime.routing import SoftmaxTopKRouter

H, E, K = 32, 8, 2
SPEC = MoeShape(hidden_size=H, intermediate_size=16, num_experts=E, top_k=K, activation="silu_glu")
COUNTS = (3, 5)  # tokens on rank 0 and rank 1: unequal on purpose


def _block(layout: Layout, rank: int) -> MoEBlock:
    gen = torch.Generator().manual_seed(11)
    router = SoftmaxTopKRouter(hidden_size=H, num_experts=E, top_k=K, norm_topk_prob=True, dtype=torch.float32)
    router.weight.data.copy_(torch.randn(E, H, generator=gen))
    source: DictExpertSource = random_source(SPEC, "bf16", range(E), gen, std=0.2)
    experts = TorchEagerBf16Experts(SPEC, ExpertParallel(ep_size=layout.ep, ep_rank=layout.ep_rank(rank)))
    experts.load_weights(source)
    return MoEBlock(gate=router, experts=experts, layout=layout)


def _tokens() -> torch.Tensor:
    return torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(3))


def _rank(rank: int, world: int, device: str) -> torch.Tensor:
    layout = Layout(tp=1, moe_tp=1, ep=world, dp=world)
    start = sum(COUNTS[:rank])
    with torch.no_grad():
        return _block(layout, rank)(_tokens()[start:start + COUNTS[rank]])


@pytest.mark.slow
def test_replicas_with_different_token_counts_reproduce_the_single_process_layer():
    with torch.no_grad():
        whole = _block(Layout(), 0)(_tokens())
    parts = launch(_rank, 2, device="cpu", timeout_s=60)
    got = torch.cat(parts)
    # fp32 hidden states on the VANILLA experts: only the summation order differs.
    assert got.shape == whole.shape
    assert torch.allclose(got, whole, rtol=1e-5, atol=1e-6)
