"""Every draft kind's step runs on the GPU without a host sync and replays as a CUDA graph (what the speculative loop captures): the replayed step equals the same step run eagerly, and the cached steps give the uncached full forward's logits (bf16).

Drafts: the embedded MTP draft of tiny_deepseek_v3 (MLA), the MTP predictors of tiny_qwen3_next and tiny_nemotron_h,
tiny_deepseek_v4_flash's MXFP4 draft stages (DR7), tiny_kimi_k3's external Qwen3-MoE drafter, and tiny_qwen3_moe's Eagle3 head (declared for sm_120: its SM is set to this GPU's, as it binds no kernel).
Random weights from each draft's own `init_random`; random target states where the draft reads them.
"""
from __future__ import annotations


import pytest
import torch

from tests.generated import builds

pytestmark = pytest.mark.gpu

DRAFTS = {
    "mtp": "generated.tiny_deepseek_v3.tiny_deepseek_v3_bf16__sm_90__tp1.draft",
    "mtp_qwen3_next": "generated.tiny_qwen3_next.tiny_qwen3_next_bf16__sm_90__tp1.draft",
    "mtp_nemotron_h": "generated.tiny_nemotron_h.tiny_nemotron_h_bf16__sm_90__tp1.draft",
    "draft_stages": "generated.tiny_deepseek_v4_flash.tiny_deepseek_v4_flash_mixed__sm_90__tp1.draft",
    "external": "generated.tiny_kimi_k3.tiny_kimi_k3_mxfp4__sm_90__tp1.draft",
    "eagle3": "generated.tiny_qwen3_moe.tiny_qwen3_moe_bf16__sm_120__tp1.draft",
}


def _draft(kind, monkeypatch):
    module = builds.load(DRAFTS[kind])
    if kind == "eagle3":
        monkeypatch.setattr(module, "SM", 90)
    draft = module.DRAFT_CLASS(device="cuda", dtype=torch.bfloat16)
    draft.init_random(seed=6)
    return draft.eval()


def _target_states(draft, batch, length):
    if draft.INPUT == "tokens":
        return None
    if draft.INPUT == "aux_hidden":
        width = draft.head.fc.weight.shape[1]
    elif hasattr(draft, "lm_head"):  # an MTP predictor kept as its own tree (qwen3_next, nemotron_h) has its own head
        width = draft.lm_head.weight.shape[1]
    else:
        width = draft.blocks[0].eh_proj.weight.shape[0]
    return torch.randn(batch, length, width, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("kind", sorted(DRAFTS))
def test_a_draft_step_replays_as_a_cuda_graph(kind, monkeypatch):
    built = _draft(kind, monkeypatch)
    if built.INPUT == "tokens":
        # An external drafter's build is a causal LM of its own: its step is its forward over its caches.
        def draft(ids, states, positions, cache=None):
            return built(ids, positions, cache), None

        new_cache = built.new_caches
    else:
        draft = built

        def new_cache(batch, length):
            return built.new_caches(batch, length)[0]   # the loop passes step 0 its entry of new_caches()
    vocab = 512
    ids = builds.token_ids(vocab, 2, 8).cuda()
    states = _target_states(built, 2, 8)
    positions = torch.arange(8, device="cuda")
    with torch.no_grad():
        full, _ = draft(ids, states, positions)
        caches, eager_caches = new_cache(2, 16), new_cache(2, 16)
        for cache in (caches, eager_caches):
            draft(ids[:, :7], None if states is None else states[:, :7], positions[:7], cache)
        step_ids, step_pos = ids[:, 7:].clone(), positions[7:].clone()
        step_states = None if states is None else states[:, 7:].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture; rewrites the slot the replay writes
            draft(step_ids, step_states, step_pos, caches)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed, _ = draft(step_ids, step_states, step_pos, caches)
        with builds.no_host_sync():
            graph.replay()
            eager, _ = draft(step_ids, step_states, step_pos, eager_caches)
        torch.cuda.synchronize()
    assert torch.equal(graphed, eager)
    assert builds.rel_err(graphed[:, 0], full[:, 7]) <= 2e-2
