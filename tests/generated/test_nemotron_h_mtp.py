"""The generated MTP draft of tiny_nemotron_h (`draft.py`, runtime.draft_build.PredictorMTPDraft) computes Nemotron-H's MTP step from the checkpoint's own `mtp.*` tensors and decodes speculatively to the target's greedy tokens; and the Nemotron router's e_score_correction_bias, nonzero and large enough to change routing, is applied as transformers' nemotron_h applies it.

Module layout (vLLM's nemotron_h_mtp.py, NemotronHMultiTokenPredictor, the only public implementation:
transformers 5.24's NemotronHForCausalLM ignores `mtp.*` when it loads): one `mtp.layers.<i>` per letter of
mtp_hybrid_override_pattern (`*E`), each the family's `norm` + `mixer` residual layer; layer 0 also holds
`enorm`, `hnorm`, `eh_proj [H, 2H]` (`x = eh_proj(cat([enorm(embed(t+1)), hnorm(h_t)]))`), the last layer
`final_layernorm`; the embedding and head are the target's `backbone.embeddings` and `lm_head`.

Oracle: that formula in float64 over the raw checkpoint tensors, its layers transformers' own `NemotronHBlock`s
(float64), loaded from a copy of the checkpoint whose attention layer 2 and MoE layer 1 hold the MTP layers'
tensors. The draft runs in fp32 with its bound TORCH experts (bf16 GEMM inputs): relative L2 error of the
logits <= 1e-2, as test_mtp_draft's.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.generated import builds
from tests.generated import helpers_drafts as drafts

MODEL = "tiny_nemotron_h"
# tiny_nemotron_h's pattern is "ME*EM-": layer 2 is attention, layer 1 MoE, the shapes of the MTP's `*E`.
AS_LAYERS = {"mtp.layers.0.": "backbone.layers.2.", "mtp.layers.1.": "backbone.layers.1."}
NEW = 32


def mtp_checkpoint(seed: int = 0):
    source = builds.transformers_checkpoint(MODEL, seed)
    h = builds.facts(MODEL).CONFIG["hidden_size"]
    extra = {"mtp.layers.0.enorm.weight": (h,), "mtp.layers.0.hnorm.weight": (h,), "mtp.layers.0.eh_proj.weight": (h, 2 * h),
             "mtp.layers.1.final_layernorm.weight": (h,)}
    # Only each layer's norm and mixer come from the target's layer (the rest are the MTP's own, in `extra`).
    copies = {mtp + part: layer + part for mtp, layer in AS_LAYERS.items() for part in ("norm.", "mixer.")}
    return builds.with_mtp_tree(source, builds.tmp_folder(f"{MODEL}-mtp-{seed}"), copies, extra,
                                {"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}, seed)


@pytest.fixture(scope="module")
def case():
    folder = mtp_checkpoint()
    return (folder, builds.read_tensors(folder), *drafts.target_and_draft(MODEL, folder))


@pytest.fixture(scope="module")
def mtp_blocks(case):
    """transformers' NemotronHBlocks (float64) holding mtp.layers.0 (attention) and mtp.layers.1 (MoE), and the eps."""
    folder, tensors, *_ = case
    swapped = {name: t for name, t in tensors.items() if not name.startswith("mtp.")}
    for mtp, layer in AS_LAYERS.items():
        swapped |= {layer + name[len(mtp):]: t for name, t in tensors.items()
                    if name.startswith(mtp) and name[len(mtp):].startswith(("norm.", "mixer."))}
    config = json.loads((folder / "config.json").read_text())
    oracle = builds.transformers_model(builds.write_checkpoint(builds.tmp_folder(f"{MODEL}-mtp-as-layers"), swapped, config),
                                       torch.float64)
    return oracle.model.layers[2], oracle.model.layers[1], oracle.config.layer_norm_epsilon


def test_the_target_ignores_the_mtp_tree_and_the_draft_reads_it_with_the_embedding_and_head(case):
    _, tensors, _, draft, (target_report, draft_report) = case
    mtp = {name for name in tensors if name.startswith("mtp.")}
    shared = {"backbone.embeddings.weight", "lm_head.weight"}
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.1.final_layernorm.weight", "mtp.layers.1.mixer.gate.e_score_correction_bias"} <= mtp
    assert set(target_report.ignored) == mtp
    assert set(draft_report.ignored) == set(tensors) - mtp - shared
    assert draft_report.tensors == len(mtp | shared)
    assert torch.equal(draft.backbone.embeddings.weight, tensors["backbone.embeddings.weight"].float())


def test_the_draft_computes_the_nemotron_h_mtp_formula_in_float64(case, mtp_blocks):
    _, tensors, target, draft, _ = case
    attention, moe, eps = mtp_blocks
    t = {name: v.double() for name, v in tensors.items()}
    vocab = t["lm_head.weight"].shape[0]
    ids, next_ids = builds.token_ids(vocab, 2, 10), builds.token_ids(vocab, 2, 10)
    with torch.no_grad():
        hidden = target.hidden_states(ids)   # the final-norm hidden states the draft reads
        logits, out = draft(next_ids, hidden)
        x = torch.cat([drafts.rms_norm(t["backbone.embeddings.weight"][next_ids], t["mtp.layers.0.enorm.weight"], eps),
                       drafts.rms_norm(hidden.double(), t["mtp.layers.0.hnorm.weight"], eps)], -1) @ t["mtp.layers.0.eh_proj.weight"].T
        causal = torch.full((ids.shape[1], ids.shape[1]), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        x = moe(attention(x, attention_mask=causal, position_ids=torch.arange(ids.shape[1])[None]))
        normed = drafts.rms_norm(x, t["mtp.layers.1.final_layernorm.weight"], eps)
        expected = normed @ t["lm_head.weight"].T
    assert builds.rel_err(logits, expected) <= 1e-2
    assert builds.rel_err(out, normed) <= 1e-2


def test_the_draft_cache_reproduces_its_full_forward(case):
    _, _, target, draft, _ = case
    assert type(draft).INPUT == "hidden" and len(draft.new_caches(2, 16)) == 1
    ids, next_ids = builds.token_ids(512, 2, 8), builds.token_ids(512, 2, 8)
    with torch.no_grad():
        hidden = target.hidden_states(ids)
        full, _ = draft(next_ids, hidden)
        cache = draft.new_caches(2, 16)[0]
        steps = [draft(next_ids[:, t:t + 1], hidden[:, t:t + 1], torch.tensor([t]), cache)[0] for t in range(8)]
    assert builds.per_position_err(torch.cat(steps, 1), full).median() <= 1e-3


def test_a_nemotron_mtp_pattern_beyond_attention_and_moe_is_refused(tmp_path):
    text = (builds.ROOT / "registry" / "models" / "tiny_nemotron_h.toml").read_text(encoding="utf-8")
    (tmp_path / "bad.toml").write_text(text.replace('name = "tiny_nemotron_h"', 'name = "bad_nemotron"').replace(
        'mtp_hybrid_override_pattern = "*E"', 'mtp_hybrid_override_pattern = "M*E"'), encoding="utf-8")
    done = builds.codegen_run("explain", "--models", tmp_path, "--model", "bad_nemotron", "--sm", "90")
    assert done.returncode == 2
    assert ("mtp_hybrid_override_pattern 'M*E' may hold only '*' (attention) and 'E' (MoE) layers, as vLLM's Nemotron-H "
            "MTP builds") in done.stderr


@pytest.fixture(scope="module")
def speculative_target(case):
    with drafts.vanilla_speculative_target(MODEL, case[0], f"{MODEL}_bf16") as target:
        yield target


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_speculative_greedy_is_the_target_greedy(speculative_target, k):
    assert type(speculative_target.draft).__module__ == drafts.build_modules(MODEL)[1].__name__
    drafts.assert_speculative_greedy_is_the_target_greedy(speculative_target, k, NEW)


def test_a_nonzero_correction_bias_changes_routing_and_the_build_still_computes_transformers_logits():
    """The router picks experts by sigmoid score + e_score_correction_bias but weighs them by the score alone: a bias
    of the scores' own spread (std 0.5 here) moves most tokens' top-k, and the build still equals transformers."""
    from transformers import AutoModelForCausalLM

    from registry.selection import Selection

    torch.manual_seed(11)
    source = builds.transformers_checkpoint(MODEL)
    tensors = builds.read_tensors(source)
    gen = torch.Generator().manual_seed(12)
    biases = [name for name in tensors if name.endswith("e_score_correction_bias")]
    assert biases
    for name in biases:
        tensors[name] = (0.5 * torch.randn(tensors[name].shape, generator=gen)).to(tensors[name].dtype)
    config = json.loads((source / "config.json").read_text())
    folder = builds.write_checkpoint(builds.tmp_folder(f"{MODEL}-biased"), tensors, config)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    module = builds.load(f"generated.{MODEL}.generic.modeling")
    ours = module.MODEL_CLASS(checkpoint=f"{MODEL}_bf16", sm=90, selection=Selection(backend="VANILLA"), dtype=torch.float32)
    ours.load_checkpoint(folder)
    ids = builds.token_ids(512, batch=2, length=16)
    routed = {}

    def record(name):
        def hook(module, args, output):
            routed[name] = output[2]   # (router logits, top-k weights, top-k expert ids)
        return hook

    gate = reference.model.layers[1].mixer.gate
    handle = gate.register_forward_hook(record("biased"))
    with torch.no_grad():
        out, expected = ours.eval()(ids), reference(ids).logits
        handle.remove()
        saved = gate.e_score_correction_bias.clone()
        gate.e_score_correction_bias.zero_()
        handle = gate.register_forward_hook(record("unbiased"))
        reference(ids)
        handle.remove()
        gate.e_score_correction_bias.copy_(saved)
    picked = [routed[k].sort(-1).values for k in ("biased", "unbiased")]
    assert (picked[0] != picked[1]).any(-1).float().mean() >= 0.5   # the bias moves most tokens' choice
    assert builds.rel_err(out, expected) <= 1e-5
    assert ((out - expected).abs().amax(-1) / expected.abs().max()).max() < 2e-5


def test_load_model_gives_the_mtp_draft_the_target_embedding_and_head(case):
    drafts.assert_the_mtp_draft_shares_the_target_embedding_and_head(MODEL, case[0], f"{MODEL}_bf16", "backbone.embeddings.weight")


def test_a_draft_the_target_tensors_cannot_serve_keeps_its_copies_and_says_why(case, caplog):
    drafts.assert_a_draft_of_another_dtype_keeps_its_copies(MODEL, case[0], caplog, "backbone.embeddings.weight")
