"""A decode step of every assembled family, captured once in a CUDA graph and replayed at new positions.

This is the claim behind the ops' style (no host syncs in forward, no branching on values, a static
cache written at a positions tensor): the same graph, replayed with new token ids and positions copied
into its input buffers, reproduces the eager full-sequence logits (fp32, 2e-5 relative to the largest
logit). Routed experts are `LoopExperts` (fp32 run), which has no data-dependent shapes; the VANILLA
class is a reference with `nonzero` and is not meant to be captured. Needs a CUDA GPU.
"""
from __future__ import annotations

import pytest
import torch

from tests.runtime.assemble import FAMILIES, assemble

pytestmark = pytest.mark.gpu

B, S, PREFILL = 2, 16, 10


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_a_captured_decode_step_replays_at_new_positions(family):
    ours, _ = assemble(family, dtype=torch.float32, seed=21)
    ours = ours.cuda()
    ids = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(22)).cuda()
    positions = torch.arange(S, device="cuda")
    full = ours(ids, positions)

    caches = ours.new_caches(batch_size=B, max_seq_len=S, dtype=torch.float32, device="cuda")
    ours(ids[:, :PREFILL], positions[:PREFILL], caches)
    step_ids = ids[:, PREFILL : PREFILL + 1].clone()
    step_pos = positions[PREFILL : PREFILL + 1].clone()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph (allocator, lazy init)
        ours(step_ids, step_pos, caches)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = ours(step_ids, step_pos, caches)

    for t in range(PREFILL, S):
        step_ids.copy_(ids[:, t : t + 1])
        step_pos.fill_(t)
        graph.replay()
        ref = full[:, t]
        err = ((logits[:, -1] - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-5, f"position {t}: relative error {err:.2e}"
