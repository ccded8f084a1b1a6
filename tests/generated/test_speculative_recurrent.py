"""Speculative decoding (runtime/speculative.py) of the hybrid tiny builds, whose Gated DeltaNet (tiny_qwen3_next) and
Mamba-2 (tiny_nemotron_h) layers keep recurrent states, on the CPU in fp32: a partially accepted verify returns those
states to the one after the last accepted token (runtime/ops/recurrent.py), so the output is the target's own greedy
output token for token with external drafters that agree (the target's twin), that are another tiny build (the other
hybrid family: its own recurrent states roll back too), and that are wrong on purpose at a given draft step; and
after each round the target's and a recurrent drafter's states equal those of a plain forward over exactly the
accepted tokens.

Oracles: greedy decoding by the build's uncached full-sequence forward (no cache, no decoder), and plain cached
forwards over the accepted sequence. Random weights (init_random); VANILLA experts (fp32 GEMMs, as
test_speculative.py explains: SD1 is exact only where the arithmetic is).
"""
from __future__ import annotations

import math

import pytest
import torch

from runtime import speculative
from runtime.ops.recurrent import RecurrentCache, leaves
from runtime.speculative import ExternalDrafter, Speculation, SpeculativeDecoder
from tests.generated import builds
from tests.generated.test_speculative import WrongAt

NEW = 34
HYBRID = ("tiny_qwen3_next", "tiny_nemotron_h")


@pytest.fixture(autouse=True, scope="module")
def _vanilla_experts():
    with builds.vanilla_experts([builds.load("generated" + builds.bf16_target(model)["module"]) for model in HYBRID]):
        yield


def _recurrent(caches) -> list[RecurrentCache]:
    return [c for c in leaves(caches) if isinstance(c, RecurrentCache)]


def test_the_hybrid_builds_have_recurrent_layers():
    kinds = {model: [type(c).__name__ for c in _recurrent(builds.random_build(model, 0).new_caches(1, 8))] for model in HYBRID}
    assert kinds == {"tiny_qwen3_next": ["RecurrentState"], "tiny_nemotron_h": ["MambaState", "MambaState"]}


@pytest.mark.parametrize("model", HYBRID)
@pytest.mark.parametrize("k", [1, 3])
def test_a_drafter_with_the_target_weights_is_accepted_k_plus_1_per_step(model, k):
    target, twin = builds.random_build(model, seed=3), builds.random_build(model, seed=3)
    spec = Speculation(k, ExternalDrafter(twin, target))
    prompt, out = builds.tie_free_run(target, lambda p: target.generate(p, NEW, speculative=spec), batch=2, length=5)
    assert torch.equal(out.tokens, builds.greedy_reference(target, prompt, NEW))
    assert out.rounds == math.ceil((NEW - 1) / (k + 1))
    assert out.accepted == out.proposed == k * out.rounds


@pytest.mark.parametrize("model", HYBRID)
@pytest.mark.parametrize("k", [1, 3])
def test_a_drafter_of_the_other_hybrid_family_gives_the_target_greedy(model, k):
    other = next(m for m in HYBRID if m != model)
    target, drafter = builds.random_build(model, seed=3), builds.random_build(other, seed=5)
    spec = Speculation(k, ExternalDrafter(drafter, target))
    prompt, out = builds.tie_free_run(target, lambda p: target.generate(p, NEW, speculative=spec), batch=2, length=4)
    assert torch.equal(out.tokens, builds.greedy_reference(target, prompt, NEW))
    assert out.proposed == k * out.rounds and 1 + out.rounds + out.accepted >= NEW
    assert out.accepted < out.proposed   # random weights disagree: rounds were partially accepted


@pytest.mark.parametrize("model", HYBRID)
@pytest.mark.parametrize("k, wrong", [(3, 1), (3, 0), (3, 2), (1, 0)])
def test_a_drafter_wrong_on_purpose_is_rolled_back(model, k, wrong):
    """Wrong at draft step `wrong` of every round in row 0: every round keeps exactly `wrong` proposals, and
    the next round's drafter (the target's twin) agrees again up to its wrong step, which it can only if
    both its states and the target's were returned to the accepted tokens."""
    target, twin = builds.random_build(model, seed=3), builds.random_build(model, seed=3)
    spec = Speculation(k, WrongAt(twin, target, wrong, row=0))
    prompt, out = builds.tie_free_run(target, lambda p: target.generate(p, NEW, speculative=spec), batch=2, length=4)
    assert torch.equal(out.tokens, builds.greedy_reference(target, prompt, NEW))
    assert out.rounds == math.ceil((NEW - 1) / (wrong + 1))
    assert out.accepted == wrong * out.rounds and out.proposed == k * out.rounds


def test_a_prompt_longer_than_a_chunk_prefills_chunked_and_decodes_to_the_target_greedy():
    target, drafter = builds.random_build("tiny_qwen3_next", seed=3), builds.random_build("tiny_qwen3_next", seed=4)
    spec = Speculation(3, ExternalDrafter(drafter, target))   # a prompt > the DeltaNet's chunk, 64
    prompt, out = builds.tie_free_run(target, lambda p: target.generate(p, NEW, speculative=spec), batch=1, length=70)
    assert torch.equal(out.tokens, builds.greedy_reference(target, prompt, NEW))


def _plain_states(model, ids, positions_offset=0):
    caches = model.new_caches(ids.shape[0], ids.shape[1] + 8)
    with torch.no_grad():
        model(ids, torch.arange(ids.shape[1]) + positions_offset, caches)
    return _recurrent(caches)


@pytest.mark.parametrize("target_model, drafter_model", [("tiny_qwen3_next", "tiny_nemotron_h"),
                                                         ("tiny_nemotron_h", "tiny_qwen3_next")])
def test_after_each_round_the_states_are_those_of_a_plain_forward_over_the_accepted_tokens(target_model, drafter_model):
    k = 3
    target, drafter = builds.random_build(target_model, seed=3), builds.random_build(drafter_model, seed=6)
    prompt = builds.token_ids(speculative.vocab_size(target), batch=2, length=5)
    decoder = SpeculativeDecoder(target, ExternalDrafter(drafter, target), k, 2, 64)
    sequence = torch.cat((prompt, decoder.prefill(prompt)[:, None]), dim=1)
    partial = 0
    for _ in range(8):
        start = int(decoder.pos)
        emitted, kept = decoder.round()
        sequence = torch.cat((sequence, emitted), dim=1)
        partial += kept < k
        assert int(decoder.pos) == start + kept + 1 == sequence.shape[1] - 1
        # The target has consumed every token before the one it emitted last.
        for ours, plain in zip(_recurrent(decoder.target_caches), _plain_states(target, sequence[:, :-1])):
            torch.testing.assert_close(ours.memory, plain.memory, atol=1e-5, rtol=0)
            torch.testing.assert_close(ours.conv, plain.conv, atol=1e-6, rtol=0)
        # The drafter (whose position i holds token i) has consumed the tokens up to the round's start
        # position: its next catch-up block starts after it.
        for ours, plain in zip(_recurrent(decoder.draft_caches), _plain_states(drafter, sequence[:, :start + 1])):
            torch.testing.assert_close(ours.memory, plain.memory, atol=1e-5, rtol=0)
            torch.testing.assert_close(ours.conv, plain.conv, atol=1e-6, rtol=0)
    assert partial >= 2   # rounds that rejected proposals, so their rollback was exercised


class TwoCacheDrafter(ExternalDrafter):
    """A drafter whose later draft steps would run through a cache of their own (as chained MTP layers do)."""

    def new_caches(self, batch_size, max_seq_len):
        return super().new_caches(batch_size, max_seq_len) * 2


def test_a_draft_whose_later_steps_keep_recurrent_caches_of_their_own_is_refused():
    target, drafter = builds.random_build("tiny_qwen3_next", seed=3), builds.random_build("tiny_nemotron_h", seed=5)
    with pytest.raises(ValueError) as err:
        SpeculativeDecoder(target, TwoCacheDrafter(drafter, target), 3, 1, 32)
    assert str(err.value) == ("TwoCacheDrafter's caches of draft steps after the first are recurrent: only a draft's "
                              "first cache (its catch-up block's) rolls back; let every draft step share that one")
