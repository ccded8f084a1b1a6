"""The recurrent mixers on the GPU: speculative decoding of the hybrid tiny builds (Gated DeltaNet, Mamba-2) with a
recurrent external drafter replays its draft and verify phases as CUDA graphs equal to the same phases run eagerly
(the rollback of both recurrent states included) and without a host sync, and gives the target's greedy output in
fp32 (up to near-ties of the bf16 TORCH experts); the chunked prefill scans run without a host sync and a CUDA
graph of a chunked forward replays to its eager outputs and states.

Builds: tiny specialized builds (TORCH experts), random weights from their `init_random`.
"""
from __future__ import annotations

import pytest
import torch

from runtime.graphs import advanced_in_place, capture
from runtime.ops import GatedDeltaNet, Mamba2Mixer
from runtime.ops.recurrent import RecurrentCache, leaves
from runtime.speculative import ExternalDrafter, Speculation, SpeculativeDecoder, vocab_size
from tests.generated import builds
from tests.gpu.helpers_graphs import sm90_build

pytestmark = pytest.mark.gpu

HYBRID = ("tiny_qwen3_next", "tiny_nemotron_h")


def _state(decoder):
    buffers = [decoder.tokens, decoder.pos, decoder.emitted, decoder.kept, decoder.draft_tokens, decoder.draft_pos,
               decoder.draft_sel]
    recurrent = [t for c in leaves([decoder.target_caches, decoder.draft_caches]) if isinstance(c, RecurrentCache)
                 for t in (c.conv, c.memory)]
    return [t.clone() for t in buffers + recurrent]


@pytest.mark.parametrize("model", HYBRID)
@pytest.mark.parametrize("k", [1, 3])
def test_graph_replayed_rounds_equal_eager_rounds_without_host_syncs(model, k):
    other = next(m for m in HYBRID if m != model)
    target = sm90_build(model, torch.float32)
    drafter = sm90_build(other, torch.float32, seed=9)   # recurrent too, and disagrees often
    prompt = builds.token_ids(vocab_size(target), batch=2, length=7).cuda()
    graphed = SpeculativeDecoder(target, ExternalDrafter(drafter, target), k, 2, 256)
    eager = SpeculativeDecoder(target, ExternalDrafter(drafter, target), k, 2, 256)
    for d in (graphed, eager):
        d.prefill(prompt)
    graphed.round()  # captures both phases (warm-up and capture sync: outside the check)
    eager._draft_phase()
    eager._verify_phase()
    assert set(graphed.graphs) == {"draft", "verify"}
    kept = []
    for _ in range(8):
        for a, b in zip(_state(graphed), _state(eager)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        with builds.no_host_sync():
            graphed._run("draft", graphed._draft_phase)
            graphed._run("verify", graphed._verify_phase)
            eager._draft_phase()
            eager._verify_phase()
        kept.append(int(eager.kept))
    for a, b in zip(_state(graphed), _state(eager)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    if k > 1:
        assert min(kept) < k, kept   # some rounds rolled back


@pytest.mark.parametrize("model", HYBRID)
def test_speculative_greedy_in_graphs_is_the_target_greedy_in_fp32(model):
    other = next(m for m in HYBRID if m != model)
    target, twin, drafter = sm90_build(model, torch.float32), sm90_build(model, torch.float32), sm90_build(other, torch.float32, 9)
    prompt = builds.token_ids(vocab_size(target), batch=2, length=6).cuda()
    reference = builds.greedy_reference(target, prompt, 40).cpu()
    for draft in (ExternalDrafter(twin, target), ExternalDrafter(drafter, target)):
        for k in (1, 3):
            out = target.generate(prompt, 40, speculative=Speculation(k, draft))
            assert out.proposed == k * out.rounds
            builds.assert_greedy_equal_up_to_ties(target, out.tokens, reference)
    decoders = target.__dict__["_speculative_decoders"].values()
    assert all(set(d.graphs) == {"draft", "verify"} for d in decoders)


def _mixers():
    torch.manual_seed(0)
    deltanet = GatedDeltaNet(hidden_size=64, num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=8, conv_kernel=4,
                             rms_norm_eps=1e-6, dtype=torch.float32).cuda()
    mamba = Mamba2Mixer(hidden_size=48, num_heads=8, head_dim=6, state_size=12, n_groups=2, conv_kernel=4,
                        norm_eps=1e-5, dtype=torch.float32).cuda()
    for mixer in (deltanet, mamba):
        with torch.no_grad():
            for p in mixer.parameters():
                p.copy_(torch.randn_like(p) * 0.2)
            mixer.A_log.copy_(torch.rand_like(mixer.A_log).log())
    return (deltanet, 64), (mamba, 48)


@pytest.mark.parametrize("which", [0, 1])
@torch.no_grad()
def test_a_chunked_forward_runs_without_host_syncs_and_replays_in_a_cuda_graph(which):
    mixer, hidden = _mixers()[which]
    seq = 300                                            # > both chunks (64, 128), not a multiple
    x = torch.randn(2, seq, hidden, device="cuda")
    positions = torch.arange(seq, device="cuda") + 5     # continues from a state
    start = mixer.new_cache(batch_size=2, max_seq_len=512, dtype=torch.float32, device="cuda")
    start.conv.normal_()
    start.memory.normal_()
    eager = mixer.new_cache(batch_size=2, max_seq_len=512, dtype=torch.float32, device="cuda")
    graphed = mixer.new_cache(batch_size=2, max_seq_len=512, dtype=torch.float32, device="cuda")
    for cache in (eager, graphed):
        cache.conv.copy_(start.conv)
        cache.memory.copy_(start.memory)
    with builds.no_host_sync():
        expected = mixer(x, positions, cache=eager) if which == 0 else mixer(x, positions, eager)
    torch.cuda.synchronize()
    step = (lambda: mixer(x, positions, cache=graphed)) if which == 0 else (lambda: mixer(x, positions, graphed))
    graph, out = capture(step, advanced_in_place([graphed]))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(graphed.memory, eager.memory, atol=1e-5, rtol=0)
    torch.testing.assert_close(graphed.conv, eager.conv, atol=0, rtol=0)
