"""Speculative decoding on the GPU (runtime/speculative.py): the draft and verify phases replayed as CUDA graphs equal the
same phases run eagerly and run without a host sync; a drafter with the target's weights is accepted k per round
(bf16: every disagreement explained by a near-tie of the target's two top logits) and its tokens/s is printed next
to plain decoding (run with -s to note the numbers); the MTP drafts decode through load_model with graphs and give
the target's greedy output in fp32.

Builds: tiny specialized builds (TORCH experts), random weights from their `init_random`.
"""
from __future__ import annotations


import pytest
import torch

from runtime.speculative import ExternalDrafter, Speculation, SpeculativeDecoder, vocab_size
from tests.generated import builds
from tests.gpu.helpers_graphs import sm90_build

pytestmark = pytest.mark.gpu


def _state(decoder):
    return [t.clone() for t in (decoder.tokens, decoder.pos, decoder.emitted, decoder.kept, decoder.draft_tokens,
                                decoder.draft_pos, decoder.draft_sel)]


@pytest.mark.parametrize("model, k", [("tiny_qwen3_moe", 3), ("tiny_deepseek_v3", 2)])
def test_graph_replayed_rounds_equal_eager_rounds_without_host_syncs(model, k):
    target = sm90_build(model, torch.bfloat16)
    drafter = ExternalDrafter(sm90_build("tiny_qwen3_moe", torch.bfloat16, seed=9), target)  # disagrees often
    prompt = builds.token_ids(vocab_size(target), batch=2, length=7).cuda()
    graphed = SpeculativeDecoder(target, drafter, k, 2, 256)
    eager = SpeculativeDecoder(target, ExternalDrafter(drafter.model, target), k, 2, 256)
    for d in (graphed, eager):
        d.prefill(prompt)
    graphed.round()  # captures both phases (warm-up and capture sync: outside the check)
    eager._draft_phase()
    eager._verify_phase()
    assert set(graphed.graphs) == {"draft", "verify"}
    for _ in range(6):
        assert all(torch.equal(a, b) for a, b in zip(_state(graphed), _state(eager)))
        with builds.no_host_sync():
            graphed._run("draft", graphed._draft_phase)
            graphed._run("verify", graphed._verify_phase)
            eager._draft_phase()
            eager._verify_phase()
    assert all(torch.equal(a, b) for a, b in zip(_state(graphed), _state(eager)))


def _explained_by_ties(target, out, reference, prompt_len):
    builds.assert_greedy_equal_up_to_ties(target, out, reference)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_an_always_agreeing_drafter_is_accepted_k_per_round_and_reports_its_rate(k):
    target, twin = sm90_build("tiny_qwen3_moe", torch.bfloat16), sm90_build("tiny_qwen3_moe", torch.bfloat16)
    prompt = builds.token_ids(vocab_size(target), batch=1, length=16).cuda()
    plain = target.generate(prompt, 64)
    plain = target.generate(prompt, 64)  # the second call: graphs captured, the rate is decode's
    spec = Speculation(k, ExternalDrafter(twin, target))
    target.generate(prompt, 64, speculative=spec)
    out = target.generate(prompt, 64, speculative=spec)
    assert out.accepted >= 0.9 * out.proposed, out.report()
    _explained_by_ties(target, out.tokens, plain.tokens, prompt.shape[1])
    print(f"\nk={k}: {out.report()}; {out.tokens_per_s:.1f} tokens/s against {plain.tokens_per_s:.1f} plain "
          f"({out.tokens_per_s / plain.tokens_per_s:.2f}x)")


@pytest.mark.parametrize("model", ["tiny_deepseek_v3", "tiny_glm4_moe"])
def test_mtp_drafts_decode_in_graphs_to_the_target_greedy_in_fp32(model):
    from generated import load_model

    target = load_model(model, 90, checkpoint_name=f"{model}_bf16", speculative_config={"mode": "mtp"},
                        device="cuda", dtype=torch.float32).eval()
    prompt = builds.token_ids(vocab_size(target), batch=2, length=6).cuda()
    reference = prompt
    with torch.no_grad():
        for _ in range(32):
            reference = torch.cat((reference, target(reference)[:, -1].argmax(-1, keepdim=True)), dim=1)
    for k in (1, 3):
        out = target.generate(prompt, 32, speculative=k)
        assert out.note is None and out.proposed == k * out.rounds
        _explained_by_ties(target, out.tokens, reference.cpu(), prompt.shape[1])


def test_sampled_rounds_replay_in_graphs_seeded_and_accept_an_agreeing_drafter():
    target, twin = sm90_build("tiny_qwen3_moe", torch.float32), sm90_build("tiny_qwen3_moe", torch.float32)
    prompt = builds.token_ids(vocab_size(target), batch=2, length=8).cuda()
    spec = Speculation(3, ExternalDrafter(twin, target))
    out = target.generate(prompt, 48, temperature=0.8, top_p=0.9, seed=3, speculative=spec)
    again = target.generate(prompt, 48, temperature=0.8, top_p=0.9, seed=3, speculative=spec)
    decoder = next(iter(target.__dict__["_speculative_decoders"].values()))
    assert set(decoder.graphs) == {"draft", "verify"}
    assert torch.equal(out.tokens, again.tokens)  # the graphs draw from the reseeded generator
    assert out.accepted >= 0.9 * out.proposed, out.report()
