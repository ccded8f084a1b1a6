"""Speculative decoding (runtime/speculative.py, RULES SD1-SD3) on the CPU with the generated tiny builds in fp32: the
output is the target's own greedy output token for token, with the MTP drafts of DeepSeek-V3 and GLM-4 MoE (loaded by
`load_model` from a checkpoint that carries the MTP layer) and with external drafters; acceptance counts are exact
where the draft's behaviour is known (a drafter with the target's weights always agrees; one wrong on purpose at a
given step agrees exactly before it); the MTP draft in the loop reads exactly the accepted tokens and target hidden
states (its logits equal its uncached forward over the final sequence); a drafter of another vocabulary is refused.

Oracles: greedy decoding by the build's uncached full-sequence forward (no cache, no decoder: another code path
over the same weights), and the draft's own uncached forward. Random weights (init_random, or transformers'
checkpoint with a random MTP layer).
"""
from __future__ import annotations

import math
import re
import weakref

import pytest
import torch

from runtime import speculative
from runtime.ops import LMHead, VocabEmbedding
from runtime.speculative import ExternalDrafter, Speculation
from runtime.graphs import collector_paused
from tests.generated import builds

NEW = 32
MTP_MODELS = ("tiny_deepseek_v3", "tiny_glm4_moe")
EXTERNAL_TARGETS = ("tiny_qwen3_moe", "tiny_deepseek_v3")


@pytest.fixture(autouse=True, scope="module")
def _vanilla_experts():
    """The builds run with the VANILLA experts of their format (fp32 GEMMs; the experts contract makes them
    interchangeable with the bound TORCH class, whose bf16 GEMMs round differently for 1 and k+1 tokens
    (~1e-4 relative), enough to flip a near-tie of two logits between a cached verify and the uncached
    oracle now and then: SD1 is exact only where the arithmetic is)."""
    models = {*MTP_MODELS, *EXTERNAL_TARGETS, "tiny_mixtral"}
    modules = [builds.load("generated" + builds.bf16_target(m)["module"]) for m in models]
    modules += [builds.load("generated" + builds.bf16_target(m)["module"].replace(".modeling", ".draft")) for m in MTP_MODELS]
    with builds.vanilla_experts(modules):
        yield


class Recording:
    """A draft that passes every call through and keeps (positions, ids, logits, step) of each."""

    def __init__(self, draft):
        self.draft, self.INPUT, self.calls = draft, draft.INPUT, []

    def new_caches(self, batch_size, max_seq_len):
        return self.draft.new_caches(batch_size, max_seq_len)

    def to_target_ids(self, ids):
        return self.draft.to_target_ids(ids)

    def forward(self, ids, hidden, positions, cache, step=0):
        logits, out = self.draft.forward(ids, hidden, positions, cache, step)
        self.calls.append((positions.clone(), ids.clone(), logits.clone(), step))
        return logits, out


class WrongAt(ExternalDrafter):
    """An external drafter whose proposal at draft step `step` of every round is off by one id in row `row`."""

    def __init__(self, model, target, step, row):
        super().__init__(model, target)
        self.wrong_step, self.row = step, row

    def forward(self, ids, hidden, positions, cache, step=0):
        logits, out = super().forward(ids, hidden, positions, cache, step)
        if step == self.wrong_step:
            logits = logits.clone()
            logits[self.row] = logits[self.row].roll(1, dims=-1)  # its argmax moves to the next id
        return logits, out


@pytest.fixture(scope="module", params=MTP_MODELS)
def mtp_case(request):
    """load_model under speculative_config mode mtp, from a checkpoint holding the MTP layer (fp32)."""
    from generated import load_model

    model = request.param
    folder = builds.mtp_checkpoint(model)
    target = load_model(model, 90, checkpoint=str(folder), checkpoint_name=f"{model}_bf16",
                        speculative_config={"mode": "mtp"}, dtype=torch.float32, mode="require").eval()
    return model, target


def test_load_model_attaches_the_mtp_draft_build_with_its_own_tensors(mtp_case):
    model, target = mtp_case
    draft = target.draft
    assert type(draft).__module__ == "generated" + builds.bf16_target(model)["module"].replace(".modeling", ".draft")
    assert draft.INPUT == "hidden"
    # Outside the target's module tree: the target's parameters are its own.
    assert not any(name.startswith("draft") for name, _ in target.named_parameters())
    tensors = builds.read_tensors(builds.mtp_checkpoint(model))
    (index, _), = builds.load(type(draft).__module__).DRAFT_LAYERS
    block = draft.model.layers[str(index)]
    assert torch.equal(block.eh_proj.weight, tensors[f"model.layers.{index}.eh_proj.weight"].float())


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_speculative_greedy_is_the_target_greedy(mtp_case, k):
    _, target = mtp_case
    prompt, out = builds.tie_free_run(target, lambda p: target.generate(p, NEW, speculative=k), batch=2, length=5)
    assert torch.equal(out.tokens, builds.greedy_reference(target, prompt, NEW))
    assert out.note is None and out.proposed == k * out.rounds
    # Every round yields a + 1 tokens: the first token (prefill) plus the rounds' reach the 32, the round
    # before the last did not.
    assert 1 + out.rounds + out.accepted >= NEW > out.rounds + out.accepted - k
    assert out.acceptance_length == pytest.approx((out.accepted + out.rounds) / out.rounds)
    # The same decoder (caches, buffers) serves the next call from position 0.
    again, out = builds.tie_free_run(target, lambda p: target.generate(p, 12, speculative=k), batch=1, length=7)
    assert torch.equal(out.tokens, builds.greedy_reference(target, again, 12))


def test_the_mtp_draft_reads_the_accepted_tokens_and_target_hidden_states(mtp_case):
    """Each catch-up block's entries up to the accepted index equal the draft's uncached forward over the
    final sequence (tokens shifted by one, the target's uncached final-norm hidden states): the draft's
    cache was rolled back and rewritten with exactly what the target accepted."""
    _, target = mtp_case
    k = 3
    recording = Recording(target.draft)
    prompt = builds.token_ids(speculative.vocab_size(target), batch=2, length=6)
    out = target.generate(prompt, NEW, speculative=Speculation(k, recording))
    seq = out.tokens
    with torch.no_grad():
        hidden = target.hidden_states(seq)
        reference, _ = target.draft(seq[:, 1:], hidden[:, :-1])  # entry i predicts the token at i + 2
    blocks = [(int(p[0]), ids, logits) for p, ids, logits, step in recording.calls if step == 0]
    prefill, blocks = blocks[0], blocks[1:]
    assert prefill[0] == 0 and prefill[1].shape[1] == prompt.shape[1] - 1
    assert builds.rel_err(prefill[2], reference[:, :prompt.shape[1] - 1]) < 1e-3
    checked = 0
    for (start, ids, logits), (following, _, _) in zip(blocks, blocks[1:]):
        valid = following - start  # entries start .. following-1 hold accepted tokens
        assert 1 <= valid <= k + 1
        assert torch.equal(ids[:, :valid], seq[:, start + 1:following + 1])
        assert builds.rel_err(logits[:, :valid], reference[:, start:following]) < 1e-3
        checked += valid
    assert checked >= NEW - k - 2



@pytest.mark.parametrize("model", EXTERNAL_TARGETS)
@pytest.mark.parametrize("k", [1, 3])
def test_a_drafter_with_the_target_weights_is_accepted_k_plus_1_per_step(model, k):
    target, twin = builds.random_build(model, seed=3), builds.random_build(model, seed=3)
    spec = Speculation(k, ExternalDrafter(twin, target))  # 3 rows: a bucket of 4
    prompt, out = builds.tie_free_run(target, lambda p: target.generate(p, NEW, speculative=spec), batch=3, length=4)
    assert torch.equal(out.tokens, builds.greedy_reference(target, prompt, NEW))
    assert out.rounds == math.ceil((NEW - 1) / (k + 1))
    assert out.accepted == out.proposed == k * out.rounds
    assert out.acceptance_length == k + 1


@pytest.mark.parametrize("k", [1, 3])
def test_a_drafter_of_another_family_gives_the_target_greedy(k):
    target, drafter = builds.random_build("tiny_deepseek_v3", seed=3), builds.random_build("tiny_qwen3_moe", seed=5)
    spec = Speculation(k, ExternalDrafter(drafter, target))
    prompt, out = builds.tie_free_run(target, lambda p: target.generate(p, NEW, speculative=spec), batch=2, length=4)
    assert torch.equal(out.tokens, builds.greedy_reference(target, prompt, NEW))
    assert out.proposed == k * out.rounds and 1 + out.rounds + out.accepted >= NEW


@pytest.mark.parametrize("k, wrong, per_round", [(3, 1, 1), (3, 0, 0), (3, 2, 2), (1, 0, 0)])
def test_a_drafter_wrong_on_purpose_is_rolled_back(k, wrong, per_round):
    """Wrong at draft step `wrong` of every round in row 0 only: every round keeps exactly `wrong` proposals
    (the rows share positions, so row 1's longer agreement waits), and the next round's drafter agrees
    again: both caches were rolled back past the rejected tokens."""
    target, twin = builds.random_build("tiny_qwen3_moe", seed=3), builds.random_build("tiny_qwen3_moe", seed=3)
    spec = Speculation(k, WrongAt(twin, target, wrong, row=0))
    prompt, out = builds.tie_free_run(target, lambda p: target.generate(p, NEW, speculative=spec), batch=2, length=4)
    assert torch.equal(out.tokens, builds.greedy_reference(target, prompt, NEW))
    assert out.rounds == math.ceil((NEW - 1) / (per_round + 1))
    assert out.accepted == per_round * out.rounds and out.proposed == k * out.rounds


class PermutedAux(ExternalDrafter):
    """The target's twin presented as an Eagle3-like draft: it declares `aux_hidden` (and records the target
    states it is handed) and scores its own vocabulary, a permutation of the target's (`to_target_ids`)."""

    INPUT = "aux_hidden"
    AUX_LAYERS = (0, 1)

    def __init__(self, model, target, perm):
        super().__init__(model, target)
        self.perm, self.seen = perm, []

    def to_target_ids(self, ids):
        return self.perm[ids]

    def forward(self, ids, hidden, positions, cache, step=0):
        if step == 0:
            self.seen.append((int(positions[0]), hidden.clone()))
        logits, out = super().forward(ids, None, positions, cache, step)
        return logits[..., self.perm], out  # draft id i is target id perm[i]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_an_aux_hidden_draft_reads_the_listed_layers_and_maps_its_vocabulary(temperature):
    target, twin = builds.random_build("tiny_qwen3_moe", seed=3), builds.random_build("tiny_qwen3_moe", seed=3)
    perm = torch.randperm(512, generator=torch.Generator().manual_seed(1))
    draft = PermutedAux(twin, target, perm)
    k = 3

    def run(prompt):
        draft.seen.clear()   # a tie-free draw's states only
        return target.generate(prompt, NEW, temperature=temperature, seed=2, speculative=Speculation(k, draft))

    prompt, out = builds.tie_free_run(target, run, batch=2, length=5)
    if temperature == 0.0:
        assert torch.equal(out.tokens, builds.greedy_reference(target, prompt, NEW))
        assert out.accepted == out.proposed
    else:  # the draft's probabilities reach the target vocabulary through the map: p == q, all accepted
        assert out.accepted >= 0.95 * out.proposed
    with torch.no_grad():
        _, aux = target.hidden_states(out.tokens, aux_layers=PermutedAux.AUX_LAYERS)
    starts = [start for start, _ in draft.seen]
    for (start, hidden), following in zip(draft.seen, starts[1:]):
        valid = following - start
        assert builds.rel_err(hidden[:, :valid], aux[:, start:following]) < 1e-4


def test_a_drafter_of_another_vocabulary_is_refused():
    target, drafter = builds.random_build("tiny_qwen3_moe", seed=3), builds.random_build("tiny_mixtral", seed=3)
    hidden = drafter.model.embed_tokens.weight.shape[1]
    drafter.model.embed_tokens = VocabEmbedding(vocab_size=256, hidden_size=hidden, dtype=torch.float32)
    drafter.lm_head = LMHead(hidden_size=hidden, vocab_size=256, dtype=torch.float32)
    with pytest.raises(ValueError) as e:
        ExternalDrafter(drafter, target)
    assert str(e.value) == (
        f"the external drafter {type(drafter).__name__} has a vocabulary of 256 ids and the target "
        f"{type(target).__name__} of 512: a drafter must share the target's tokenizer (RULES SD2)")


def test_a_draft_that_names_no_input_kind_is_refused():
    target, twin = builds.random_build("tiny_qwen3_moe", seed=3), builds.random_build("tiny_qwen3_moe", seed=3)
    drafter = ExternalDrafter(twin, target)
    drafter.INPUT = "logits"
    with pytest.raises(ValueError) as e:
        target.generate(torch.zeros(1, 3, dtype=torch.int64), 4, speculative=Speculation(2, drafter))
    assert str(e.value) == "ExternalDrafter.INPUT is 'logits'; a draft declares one of hidden, aux_hidden, tokens"


def test_without_a_draft_it_decodes_with_the_target_and_says_so():
    from generated import load_model

    target = load_model("tiny_qwen3_moe", 90, speculative_config={"mode": "ngram"}, dtype=torch.float32).eval()
    assert target.draft is None
    prompt = builds.token_ids(512, batch=1, length=4)
    out = target.generate(prompt, 6, speculative=2)
    assert out.note == "speculative_config.mode 'ngram' has no neural draft: decoded with the target alone"
    assert out.report() == out.note and out.rounds == 0
    assert torch.equal(out.tokens, builds.greedy_reference(target, prompt, 6))
    plain = builds.random_build("tiny_qwen3_moe", seed=3)
    assert plain.generate(prompt, 3, speculative=2).note == (
        f"{type(plain).__name__} was loaded without a draft (no speculative_config.mode): decoded with the target alone")
    generic = load_model("tiny_deepseek_v3", 90, checkpoint_name="tiny_deepseek_v3_bf16", mode="off",
                         moe_config={"backend": "TORCH"}, speculative_config={"mode": "mtp"}, dtype=torch.float32).eval()
    # The generic build of a DeepSeek-V3 model constructs its MTP draft (resolved at load) and decodes with it.
    assert generic.draft is not None and type(generic.draft).__module__ == "generated.tiny_deepseek_v3.generic.draft"
    out = generic.generate(prompt, 8, speculative=2)
    assert out.note is None and out.proposed == 2 * out.rounds
    builds.assert_greedy_equal_up_to_ties(generic, out.tokens, builds.greedy_reference(generic, prompt, 8))
    # A generic build without a draft for the mode decodes with the target alone and says so.
    eagle = load_model("tiny_qwen3_moe", 90, mode="off", speculative_config={"mode": "eagle3"}, dtype=torch.float32).eval()
    assert eagle.draft is None
    assert eagle.generate(prompt, 3, speculative=2).note == (
        "the generic build of tiny_qwen3_moe constructs no draft for mode 'eagle3': decoded with the target alone")


def test_rows_that_reach_eos_continue_with_it_and_decoding_stops_early():
    target, twin = builds.random_build("tiny_qwen3_moe", seed=3), builds.random_build("tiny_qwen3_moe", seed=3)
    prompt = builds.token_ids(speculative.vocab_size(target), batch=1, length=4)
    spec = Speculation(3, ExternalDrafter(twin, target))
    greedy = builds.greedy_reference(target, prompt, NEW)[0, 4:]
    eos = int(greedy[5])
    first = int((greedy == eos).nonzero()[0])
    out = target.generate(prompt, NEW, eos_token_id=eos, speculative=spec)
    new = out.new_tokens[0]
    assert torch.equal(new[:first + 1], greedy[:first + 1]) and (new[first:] == eos).all()
    # Checked before each round: it stopped after the round that emitted the EOS (4 tokens a round).
    assert new.shape[0] == 1 + 4 * math.ceil(first / 4) and out.rounds == math.ceil(first / 4)


def test_near_ties_are_top_two_logits_within_the_dtype_eps():
    logits = torch.tensor([[3.0, 3.0 - 3e-8, 1.0], [3.0, 2.0, 1.0], [0.5, 0.5 - 1e-3, 0.0]])
    assert speculative.near_ties(logits, torch.finfo(torch.bfloat16).eps).tolist() == [True, False, True]
    assert speculative.near_ties(logits, torch.finfo(torch.float32).eps).tolist() == [True, False, False]


def test_ties_are_judged_in_the_coarsest_dtype_the_target_computes_in():
    """fp32 with VANILLA experts (fp32 GEMMs; this module binds them) judges ties within fp32's eps; fp32 with
    the bound TORCH experts (bf16 operands) and a bf16 build within bf16's."""
    fp32, bf16 = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
    assert speculative.tie_eps(builds.random_build("tiny_qwen3_moe", seed=3)) == fp32
    assert speculative.tie_eps(builds.random_build("tiny_qwen3_next", seed=3)) == bf16   # not bound VANILLA here
    module = builds.load("generated" + builds.bf16_target("tiny_qwen3_moe")["module"])
    assert speculative.tie_eps(module.MODEL_CLASS(dtype=torch.bfloat16)) == bf16


def _distributions(gen, rows, v):
    return torch.softmax(torch.randn(rows, v, generator=gen, dtype=torch.float64) * 1.5, -1).float()


def test_speculative_sampling_keeps_draws_of_the_target_distribution():
    """`accept_sampled` on known distributions: the kept token at every index is distributed as the
    target's `p` there (accepted proposal or residual draw), the first proposal is accepted with
    probability sum(min(p, q)); with many rows sharing positions (`a` = their minimum) index 0 still is."""
    gen = torch.Generator().manual_seed(11)
    k, v, trials = 2, 5, 12000
    p, q = _distributions(gen, k + 1, v), _distributions(gen, k, v)
    firsts, seconds, bonus, accepted_first = [], [], [], 0
    for _ in range(trials):
        proposals = torch.stack([torch.multinomial(q[j], 1, generator=gen)[0] for j in range(k)])[None]
        kept_ids, kept = speculative.accept_sampled(p[None], q[None], proposals, gen)
        a = int(kept)
        firsts.append(int(kept_ids[0, 0]))
        accepted_first += a >= 1
        if a >= 1:
            seconds.append(int(kept_ids[0, 1]))
        if a == k:
            bonus.append(int(kept_ids[0, k]))

    def freq(ids):
        return torch.bincount(torch.tensor(ids), minlength=v).double() / len(ids)

    torch.testing.assert_close(freq(firsts), p[0].double(), atol=0.015, rtol=0)
    torch.testing.assert_close(freq(seconds), p[1].double(), atol=0.02, rtol=0)
    torch.testing.assert_close(freq(bonus), p[2].double(), atol=0.03, rtol=0)
    assert accepted_first / trials == pytest.approx(float(torch.minimum(p[0], q[0]).sum()), abs=0.015)
    rows = 40000
    proposals = torch.multinomial(q[0], rows * k, replacement=True, generator=gen).view(rows, k)
    kept_ids, kept = speculative.accept_sampled(p.expand(rows, k + 1, v), q.expand(rows, k, v), proposals, gen)
    assert int(kept) == 0
    torch.testing.assert_close(freq(kept_ids[:, 0].tolist()), p[0].double(), atol=0.01, rtol=0)


def test_sampled_speculative_decoding_accepts_an_always_agreeing_drafter_and_is_seeded():
    target, twin = builds.random_build("tiny_qwen3_moe", seed=3), builds.random_build("tiny_qwen3_moe", seed=3)
    prompt = builds.token_ids(speculative.vocab_size(target), batch=2, length=4)
    spec = Speculation(3, ExternalDrafter(twin, target))
    out = target.generate(prompt, NEW, temperature=0.8, top_p=0.9, seed=5, speculative=spec)
    # p == q up to fp32 rounding of the same computation in other shapes: min(1, p/q) ~ 1.
    assert out.accepted >= 0.95 * out.proposed and out.tokens.shape == (2, 4 + NEW)
    assert torch.equal(target.generate(prompt, NEW, temperature=0.8, top_p=0.9, seed=5, speculative=spec).tokens,
                       out.tokens)
    greedy = target.generate(prompt, NEW, speculative=spec).tokens
    assert not torch.equal(greedy, out.tokens)
    # A drafter of other weights: proposals mostly rejected, every kept token still a target draw.
    other = target.generate(prompt, NEW, temperature=0.8, seed=5,
                            speculative=Speculation(3, ExternalDrafter(builds.random_build("tiny_qwen3_moe", seed=8), target)))
    assert other.accepted < other.proposed and other.tokens.shape == (2, 4 + NEW)


def test_speculative_generate_refuses_bad_arguments():
    target, twin = builds.random_build("tiny_qwen3_moe", seed=3), builds.random_build("tiny_qwen3_moe", seed=3)
    prompt = torch.zeros(1, 3, dtype=torch.int64)
    drafter = ExternalDrafter(twin, target)
    with pytest.raises(ValueError) as e:
        target.generate(prompt, 4, speculative=Speculation(0, drafter))
    assert str(e.value) == "the draft proposes at least 1 token per round (--draft-tokens), got 0"
    with pytest.raises(ValueError) as e:
        target.generate(prompt, 4, temperature=0.7, top_p=1.5, speculative=Speculation(2, drafter))
    assert str(e.value) == "temperature must be >= 0 and top_p in (0, 1], got 0.7 and 1.5"


def test_the_launcher_decodes_with_the_mtp_draft_and_reports_acceptance(capsys):
    from generated import load_model, run

    folder = builds.tmp_folder("spec-cli-tiny")
    code = run.main(["--model", "tiny_deepseek_v3", "--sm", "90", "--tiny", "--tiny-dir", str(folder),
                     "--checkpoint-name", "tiny_deepseek_v3_bf16", "--tokens", "5,6,7", "--generate", "8",
                     "--spec-mode", "mtp", "--draft-tokens", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.strip().splitlines()
    row = re.fullmatch(r"row 0 \(3 tokens\) generated: " + ", ".join([r"(\d+)"] * 8), lines[1])
    assert row, out
    assert re.fullmatch(r"prefill [\d.]+ ms; decode 7 steps of 1 rows in [\d.]+ ms: [\d.]+ tokens/s", lines[2]), out
    stats = re.fullmatch(r"speculative: (\d+) target steps, (\d+) proposed, (\d+) accepted \([\d.]+%\), "
                         r"acceptance length ([\d.]+), \d+ near-tie tokens", lines[3])
    assert stats, out
    rounds, proposed, accepted, length = int(stats[1]), int(stats[2]), int(stats[3]), float(stats[4])
    assert proposed == 3 * rounds and 1 + rounds + accepted >= 8
    assert length == pytest.approx((accepted + rounds) / rounds, abs=0.01)
    # The written checkpoint holds the draft's tensors; its ids are the target's greedy continuation.
    model = load_model("tiny_deepseek_v3", 90, checkpoint=str(folder), checkpoint_name="tiny_deepseek_v3_bf16",
                       speculative_config={"mode": "mtp"}).eval()
    assert model.draft is not None
    expected = builds.greedy_reference(model, torch.tensor([[5, 6, 7]]), 8)[0, 3:].tolist()
    assert [int(x) for x in row.groups()] == expected


@pytest.mark.parametrize("args, message", [
    (["--model", "tiny_qwen3_moe", "--generate", "4", "--spec-mode", "mtp"],
     "tiny_qwen3_moe has no draft for speculative_config.mode 'mtp'; its drafts serve: eagle3"),
    (["--model", "tiny_qwen3_moe", "--generate", "4", "--draft-tokens", "2"],
     "--draft-tokens sets the draft's proposals per round: give --spec-mode too"),
    (["--model", "tiny_deepseek_v3", "--checkpoint-name", "tiny_deepseek_v3_bf16", "--spec-mode", "mtp"],
     "--spec-mode decodes with a draft: give --generate N too"),
    (["--model", "tiny_deepseek_v3", "--checkpoint-name", "tiny_deepseek_v3_bf16", "--generate", "4",
      "--spec-mode", "mtp", "--draft-tokens", "0"],
     "--draft-tokens takes a number of proposals >= 1, got 0"),
    (["--model", "tiny_qwen3_moe", "--parallel", "dep2", "--generate", "4", "--spec-mode", "ngram"],
     "speculative decoding needs every rank to accept the same tokens; dep2 runs 2 data-parallel replicas: "
     "use a layout without attention data parallelism"),
])
def test_the_launcher_refuses_bad_speculative_arguments(capsys, args, message):
    from generated import run

    assert run.main([*args, "--sm", "90", "--tiny"]) == 2
    assert capsys.readouterr().err.strip() == f"python -m generated.run: error: {message}"


def test_hidden_states_gives_the_outputs_of_the_listed_layers_for_eagle3():
    """`aux_layers`: the outputs of those decoder layers (before the final norm), concatenated in order,
    against transformers' hidden states of the same checkpoint (`hidden_states[i + 1]` leaves layer i)."""
    from generated import load_model

    folder = builds.transformers_checkpoint("tiny_qwen3_moe")
    # VANILLA computes in fp32 (TORCH rounds GEMM operands to bf16), so the comparison can be tight.
    target = load_model("tiny_qwen3_moe", 90, checkpoint=str(folder), dtype=torch.float32, moe_config={"backend": "VANILLA"}).eval()
    theirs = builds.transformers_model(folder, torch.float64)
    ids = builds.token_ids(512, batch=2, length=9)
    with torch.no_grad():
        final, aux = target.hidden_states(ids, aux_layers=(0, 1))
        expected = theirs.model(ids, output_hidden_states=True).hidden_states[1]
    width = final.shape[-1]
    assert aux.shape == (2, 9, 2 * width)
    assert torch.equal(final, target.hidden_states(ids))
    assert torch.equal(target.model.norm(aux[..., width:]), final)
    assert builds.rel_err(aux[..., :width], expected) < 1e-5


def test_a_target_its_caller_drops_is_freed_at_once_with_its_drafts_and_speculative_decoders():
    """The target owns its speculative decoders and they hold it weakly: after speculative decoding with its MTP
    draft and with an external drafter, the target and its draft go with the last reference, with the cyclic
    collector off. A speculative decoder kept past its target refuses to run."""
    from generated import load_model

    target = load_model("tiny_deepseek_v3", 90, checkpoint=str(builds.mtp_checkpoint("tiny_deepseek_v3")),
                        checkpoint_name="tiny_deepseek_v3_bf16", speculative_config={"mode": "mtp"},
                        dtype=torch.float32, mode="require").eval()
    drafter = builds.random_build("tiny_qwen3_moe", seed=5)
    prompt = builds.token_ids(speculative.vocab_size(target), batch=1, length=4)
    target.generate(prompt, 4, speculative=2)   # target.draft, the MTP draft build
    external = ExternalDrafter(drafter, target)
    target.generate(prompt, 4, speculative=Speculation(2, external))
    decoder = speculative.speculative_decoder(target, external, 2, 1, 4 + 4)
    alive, draft = weakref.ref(target), weakref.ref(target.draft)
    with collector_paused():
        del target
        assert alive() is None and draft() is None
    message = "^the model of this speculative decoder was freed: keep a reference to the model while you use its decoders$"
    with pytest.raises(RuntimeError, match=message):
        decoder.prefill(prompt)
    with pytest.raises(RuntimeError, match=message):
        decoder.round()
