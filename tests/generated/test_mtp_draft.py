"""The generated MTP draft (`draft.py` of the DeepSeek-V3 and GLM-4 MoE targets) computes the reference MTP step from the checkpoint's own MTP tensors, and shares a checkpoint folder with its target without either reading the other's tensors (research formats_configs §4; RULES DR2).

Two oracles: the formula `x = eh_proj(cat([enorm(embed(tok[t+1])), hnorm(h[t])]))`, decoder layer,
`shared_head.head(shared_head.norm(.))`, written here in float64 over the raw checkpoint tensors (the
decoder layer is transformers' own, in float64); and transformers' `MtpLayer` (transformers 5.24 has a
generic one in `modeling_layers`, which `MtpModel` builds for DeepSeek-V3 and GLM-4 MoE), loaded from the
same folder by `MtpModel.from_pretrained`. The draft runs in fp32 with TORCH experts (its bound class,
or the TORCH class of its format when it binds a GPU kernel), which round their GEMM inputs to bf16:
relative L2 error of the logits <= 1e-2 (observed 0.7e-3..2e-3; one layer deep, the fp32 router sees
the same input on both sides, so no routing flips).
"""
from __future__ import annotations

import pytest
import torch

from tests.generated import builds
from tests.generated import helpers_drafts as drafts

MODELS = ("tiny_deepseek_v3", "tiny_glm4_moe")


def _target(model: str) -> dict:
    return next(t for t in builds.specialized(model)
                if builds.single_rank(t) and t["checkpoint"].endswith("_bf16") and t["spec_mode"] == "mtp")


@pytest.fixture(scope="module", params=MODELS)
def case(request):
    """The checkpoint (with MTP tensors), its tensors, the target and draft builds (fp32, loaded).

    These tests are about the draft's generated code (which tensors it reads, the MTP formula), not its
    kernel: a draft bound to a GPU-only implementation runs here with the TORCH class of the same format.
    """
    model = request.param
    folder = builds.mtp_checkpoint(model)
    module = "generated" + _target(model)["module"]
    target = builds.load(module).MODEL_CLASS(dtype=torch.float32)
    draft_module = builds.load(module.replace(".modeling", ".draft"))
    with pytest.MonkeyPatch.context() as patch:
        if not set(draft_module.IMPLEMENTATIONS) <= set(draft_module.CPU_IMPLS):
            patch.setattr(draft_module, "IMPLEMENTATIONS", {i: builds.cpu_twin(i) for i in draft_module.IMPLEMENTATIONS})
            patch.setattr(draft_module, "CPU_IMPLS", tuple(draft_module.IMPLEMENTATIONS))
        draft = draft_module.DRAFT_CLASS(dtype=torch.float32)
    reports = target.load_checkpoint(folder), draft.load_checkpoint(folder)
    return model, folder, builds.read_tensors(folder), target, draft, reports


@pytest.fixture(scope="module")
def transformers_mtp(case):
    """transformers' main model and MtpModel of the checkpoint, in float64."""
    from transformers.modeling_layers import MtpModel

    model, folder, tensors, *_ = case
    main = builds.transformers_model(folder, torch.float64)
    # MtpModel finds the MTP tensors through the main model's ignore patterns, which name the full-size
    # models' MTP layer (61 for DeepSeek-V3, 92 for GLM-4.5); this model's is right after its last layer.
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{main.config.num_hidden_layers}\..*"]
    return main, MtpModel.from_pretrained(main).eval()


def _mtp_prefix(draft) -> str:
    (index, _), = builds.load(type(draft).__module__).DRAFT_LAYERS
    return f"model.layers.{index}."


def test_the_target_ignores_the_mtp_tensors_and_the_draft_reads_only_them(case):
    _, _, tensors, target, draft, (target_report, draft_report) = case
    prefix = _mtp_prefix(draft)
    mtp = {name for name in tensors if name.startswith(prefix)}
    assert mtp and set(target_report.ignored) == mtp
    assert set(draft_report.ignored) == set(tensors) - mtp
    assert draft_report.tensors == len(mtp)
    # The draft's own embedding and head copies, not the target's (the fixture makes them differ).
    block = draft.model.layers[prefix.split(".")[2]]
    assert torch.equal(block.embed_tokens.weight, tensors[prefix + "embed_tokens.weight"].float())
    assert torch.equal(block.shared_head.head.weight, tensors[prefix + "shared_head.head.weight"].float())


def test_the_draft_computes_the_mtp_formula_in_float64_from_the_checkpoint(case, transformers_mtp):
    model, _, tensors, target, draft, _ = case
    main, mtp = transformers_mtp
    prefix, eps = _mtp_prefix(draft), main.config.rms_norm_eps
    vocab = main.config.vocab_size
    ids, next_ids = builds.token_ids(vocab, 2, 10), builds.token_ids(vocab, 2, 10)
    t = {name[len(prefix):]: v.double() for name, v in tensors.items() if name.startswith(prefix)}
    with torch.no_grad():
        hidden = target.hidden_states(ids)  # the final-norm hidden states a draft reads
        logits, _ = draft(next_ids, hidden)
        h = hidden.double()
        x = torch.cat([drafts.rms_norm(t["embed_tokens.weight"][next_ids], t["enorm.weight"], eps),
                       drafts.rms_norm(h, t["hnorm.weight"], eps)], -1)
        x = x @ t["eh_proj.weight"].T
        positions = torch.arange(ids.shape[1])[None]
        causal = torch.full((ids.shape[1], ids.shape[1]), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        layer_out = mtp.layers[0].mtp_block(
            x, attention_mask=causal, position_ids=positions, position_embeddings=main.model.rotary_emb(x, positions))
        expected = drafts.rms_norm(layer_out, t["shared_head.norm.weight"], eps) @ t["shared_head.head.weight"].T
    assert builds.rel_err(logits, expected) <= 1e-2


def test_the_draft_matches_transformers_mtp_layer(case, transformers_mtp):
    model, _, tensors, target, draft, _ = case
    main, mtp = transformers_mtp
    prefix = _mtp_prefix(draft)
    vocab = main.config.vocab_size
    ids, next_ids = builds.token_ids(vocab, 2, 10), builds.token_ids(vocab, 2, 10)
    with torch.no_grad():
        hidden = target.hidden_states(ids)
        logits, _ = draft(next_ids, hidden)
        # MtpModel ties its embedding and head to the main model's; the checkpoint's MTP copies are
        # passed in explicitly (inputs_embeds) and applied after its layer.
        embeds = tensors[prefix + "embed_tokens.weight"].double()[next_ids]
        normed = mtp.forward_layer(0, hidden.double(), torch.arange(ids.shape[1])[None], None, inputs_embeds=embeds)
        expected = normed @ tensors[prefix + "shared_head.head.weight"].double().T
        # The draft reads what the target's forward feeds its head, which is transformers' last hidden state
        # (compared per position: three layers deep, a routing flip may move a few positions).
        assert torch.equal(target.lm_head(hidden), target(ids))
        theirs = main.model(ids).last_hidden_state
        per_position = ((hidden.double() - theirs).norm(dim=-1) / theirs.norm(dim=-1)).flatten()
        assert per_position.median() <= 8e-3
    assert builds.rel_err(logits, expected) <= 1e-2


def test_the_draft_presents_the_draft_interface_and_its_cache_reproduces_the_full_forward(case):
    """The speculative loop's contract (INPUT, to_target_ids, new_caches): one position at a time through
    the draft's own cache gives the full-sequence forward's logits."""
    _, _, _, target, draft, _ = case
    assert type(draft).INPUT == "hidden"
    vocab = draft.blocks[0].embed_tokens.weight.shape[0]
    ids, next_ids = builds.token_ids(vocab, 2, 8), builds.token_ids(vocab, 2, 8)
    assert torch.equal(draft.to_target_ids(next_ids), next_ids)
    with torch.no_grad():
        hidden = target.hidden_states(ids)
        full, full_hidden = draft(next_ids, hidden)
        caches = draft.new_caches(2, 16)
        steps = [draft(next_ids[:, t:t + 1], hidden[:, t:t + 1], torch.tensor([t]), caches[0])[0] for t in range(8)]
    assert full_hidden.shape == hidden.shape
    # Not bit-equal: fp32 attention sums in another order per step and the experts round their inputs to
    # bf16 (observed <= 4e-4 per position; a rare router flip moves one position): a draft that ignored its
    # cache is off by 0.5-1 at the later positions (measured).
    errors = builds.per_position_err(torch.cat(steps, 1), full)
    assert errors.median() <= 1e-3, errors


def test_the_generic_build_constructs_the_mtp_draft_resolved_at_load(case, transformers_mtp):
    """Generic builds construct the draft the selection's mode needs (issue 13): `generic/draft.py` resolves
    its MTP layers when it loads, under the draft's own selection, and computes transformers' MTP layer."""
    from registry.selection import Selection

    model, folder, tensors, target, draft, _ = case
    main, mtp = transformers_mtp
    module = builds.load(f"generated.{model}.generic.draft")
    selection = Selection(spec_mode="mtp", draft_backend="TORCH")
    generic = module.DRAFT_CLASS(checkpoint=f"{model}_bf16", sm=90, selection=selection, dtype=torch.float32)
    report = generic.load_checkpoint(folder)
    assert [i for i, _ in generic.draft_layer_ids()] == [i for i, _ in builds.load(type(draft).__module__).DRAFT_LAYERS]
    assert {impl for _, impl in generic.draft_layer_ids()} == {"torch.grouped_mm.grouped_gemm.bf16"}
    assert report.tensors == draft.load_checkpoint(folder).tensors
    prefix = _mtp_prefix(draft)
    ids, next_ids = builds.token_ids(main.config.vocab_size, 2, 10), builds.token_ids(main.config.vocab_size, 2, 10)
    with torch.no_grad():
        hidden = target.hidden_states(ids)
        logits, _ = generic(next_ids, hidden)
        embeds = tensors[prefix + "embed_tokens.weight"].double()[next_ids]
        normed = mtp.forward_layer(0, hidden.double(), torch.arange(ids.shape[1])[None], None, inputs_embeds=embeds)
        expected = normed @ tensors[prefix + "shared_head.head.weight"].double().T
    assert builds.rel_err(logits, expected) <= 1e-2
    with pytest.raises(ValueError) as info:
        module.DRAFT_CLASS(checkpoint=f"{model}_bf16", sm=90, selection=Selection(), dtype=torch.float32)
    assert str(info.value) == f"{model}/generic draft serves speculative_config.mode 'mtp'; pass a selection with that mode"


def test_the_draft_on_the_vanilla_experts_in_fp32_is_transformers_mtp_layer_to_fp32_precision(case, transformers_mtp):
    """The generic draft bound to the VANILLA reference experts (fp32 GEMMs): nothing rounds to bf16, so the
    MTP layer's logits equal transformers' float64 `MtpLayer` to fp32 precision (observed <= 5e-7; any
    misplaced tensor or step of the formula is off by the logits' own size)."""
    from registry.selection import Selection

    model, folder, tensors, target, draft, _ = case
    main, mtp = transformers_mtp
    module = builds.load(f"generated.{model}.generic.draft")
    selection = Selection(spec_mode="mtp", draft_backend="VANILLA")
    vanilla = module.DRAFT_CLASS(checkpoint=f"{model}_bf16", sm=90, selection=selection, dtype=torch.float32)
    vanilla.load_checkpoint(folder)
    assert {impl for _, impl in vanilla.draft_layer_ids()} == {"torch.eager.loop.bf16"}
    prefix = _mtp_prefix(draft)
    vocab = main.config.vocab_size
    ids, next_ids = builds.token_ids(vocab, 2, 10), builds.token_ids(vocab, 2, 10)
    with torch.no_grad():
        hidden = 3 * torch.randn(2, 10, main.config.hidden_size)  # any hidden state: the layer's input
        logits, _ = vanilla(next_ids, hidden)
        embeds = tensors[prefix + "embed_tokens.weight"].double()[next_ids]
        normed = mtp.forward_layer(0, hidden.double(), torch.arange(ids.shape[1])[None], None, inputs_embeds=embeds)
        expected = normed @ tensors[prefix + "shared_head.head.weight"].double().T
    assert float((logits.double() - expected).abs().max() / expected.abs().max()) < 2e-5
