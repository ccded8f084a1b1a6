"""The generated MTP draft of tiny_qwen3_next (`draft.py`, runtime.draft_build.PredictorMTPDraft) computes Qwen3-Next's MTP step from the checkpoint's own `mtp.*` tensors, and decodes speculatively with its target to the target's own greedy tokens.

Module layout (vLLM's qwen3_next_mtp.py, Qwen3NextMultiTokenPredictor, the only public implementation:
transformers 5.24 has none, its Qwen3NextForCausalLM ignores `^mtp.*` when it loads): `mtp.fc [H, 2H]`,
`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0` (a gated full-attention decoder layer with
the MoE block), `mtp.norm`; the embedding and head are the target's `model.embed_tokens` and `lm_head`.

Oracle: the formula written here in float64 over the raw checkpoint tensors, its decoder layer transformers' own
`Qwen3NextDecoderLayer` (float64), loaded from a copy of the checkpoint whose full-attention layer 1 holds the
MTP layer's tensors. The draft runs in fp32 with its bound TORCH experts, which round their GEMM inputs to bf16:
relative L2 error of the logits <= 1e-2, as test_mtp_draft's (one layer deep, no routing flips).
"""
from __future__ import annotations

import pytest
import torch

from tests.generated import builds
from tests.generated import helpers_drafts as drafts

MODEL = "tiny_qwen3_next"
MTP_LAYER = "model.layers.1."   # tiny_qwen3_next's full-attention layer: the MTP layer's shapes
NEW = 32


def mtp_checkpoint(seed: int = 0):
    source = builds.transformers_checkpoint(MODEL, seed)
    h = builds.facts(MODEL).CONFIG["hidden_size"]
    extra = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
             "mtp.norm.weight": (h,)}
    return builds.with_mtp_tree(source, builds.tmp_folder(f"{MODEL}-mtp-{seed}"), {"mtp.layers.0.": MTP_LAYER}, extra,
                                {"mtp_num_hidden_layers": 1}, seed)


@pytest.fixture(scope="module")
def case():
    folder = mtp_checkpoint()
    return (folder, builds.read_tensors(folder), *drafts.target_and_draft(MODEL, folder))


@pytest.fixture(scope="module")
def mtp_layer(case):
    """transformers' Qwen3NextDecoderLayer (full attention, float64) holding the checkpoint's mtp.layers.0 tensors,
    with its rotary: the checkpoint copied with the MTP layer's tensors in place of layer 1's."""
    folder, tensors, *_ = case
    swapped = {name: t for name, t in tensors.items() if not name.startswith("mtp.")}
    swapped |= {MTP_LAYER + name[len("mtp.layers.0."):]: t for name, t in tensors.items() if name.startswith("mtp.layers.0.")}
    import json

    config = json.loads((folder / "config.json").read_text())
    oracle = builds.transformers_model(builds.write_checkpoint(builds.tmp_folder(f"{MODEL}-mtp-as-layer"), swapped, config),
                                       torch.float64)
    return oracle.model.layers[1], oracle.model.rotary_emb, oracle.config.rms_norm_eps


def test_the_target_ignores_the_mtp_tree_and_the_draft_reads_it_with_the_embedding_and_head(case):
    _, tensors, _, draft, (target_report, draft_report) = case
    mtp = {name for name in tensors if name.startswith("mtp.")}
    shared = {"model.embed_tokens.weight", "lm_head.weight"}
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"} <= mtp
    assert set(target_report.ignored) == mtp
    assert set(draft_report.ignored) == set(tensors) - mtp - shared
    assert draft_report.tensors == len(mtp | shared)
    assert torch.equal(draft.mtp.fc.weight, tensors["mtp.fc.weight"].float())
    assert torch.equal(draft.lm_head.weight, tensors["lm_head.weight"].float())


def test_the_draft_computes_the_qwen3_next_mtp_formula_in_float64(case, mtp_layer):
    _, tensors, target, draft, _ = case
    layer, rotary, eps = mtp_layer
    t = {name: v.double() for name, v in tensors.items()}
    vocab = t["lm_head.weight"].shape[0]
    ids, next_ids = builds.token_ids(vocab, 2, 10), builds.token_ids(vocab, 2, 10)
    with torch.no_grad():
        hidden = target.hidden_states(ids)   # the final-norm hidden states the draft reads
        logits, out = draft(next_ids, hidden)
        # Qwen3-Next's RMSNorm is zero-centred: its scale is 1 + w.
        x = torch.cat([drafts.rms_norm(t["model.embed_tokens.weight"][next_ids], 1.0 + t["mtp.pre_fc_norm_embedding.weight"], eps),
                       drafts.rms_norm(hidden.double(), 1.0 + t["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ t["mtp.fc.weight"].T
        positions = torch.arange(ids.shape[1])[None]
        causal = torch.full((ids.shape[1], ids.shape[1]), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        normed = drafts.rms_norm(layer(x, position_embeddings=rotary(x, positions), attention_mask=causal, position_ids=positions),
                                 1.0 + t["mtp.norm.weight"], eps)
        expected = normed @ t["lm_head.weight"].T
    assert builds.rel_err(logits, expected) <= 1e-2
    # What the next draft step reads: the predictor's output after mtp.norm (as vLLM chains it).
    assert builds.rel_err(out, normed) <= 1e-2


def test_the_draft_cache_reproduces_its_full_forward_and_chains_its_own_hidden(case):
    """One position at a time through the draft's own KV cache gives the full forward; step 1 reads the draft's own
    hidden output (one MTP layer serves every step, `layers[step % 1]`)."""
    _, _, target, draft, _ = case
    assert type(draft).INPUT == "hidden" and len(draft.new_caches(2, 16)) == 1
    ids, next_ids = builds.token_ids(512, 2, 8), builds.token_ids(512, 2, 8)
    with torch.no_grad():
        hidden = target.hidden_states(ids)
        full, full_hidden = draft(next_ids, hidden)
        cache = draft.new_caches(2, 16)[0]
        steps = [draft(next_ids[:, t:t + 1], hidden[:, t:t + 1], torch.tensor([t]), cache)[0] for t in range(8)]
        chained, _ = draft(next_ids, full_hidden, step=1)
        again, _ = draft(next_ids, full_hidden, step=0)
    assert builds.per_position_err(torch.cat(steps, 1), full).median() <= 1e-3
    assert torch.equal(chained, again)
    assert builds.rel_err(chained, full) > 0.05   # its own hidden, not the target's


def test_load_model_attaches_the_mtp_draft_loaded_from_the_target_folder(case):
    """`load_model` under speculative_config mode mtp holds the generated draft, its tensors read from the target's
    folder, outside the target's module tree."""
    from generated import load_model

    folder, tensors, *_ = case
    target = load_model(MODEL, 90, checkpoint=str(folder), checkpoint_name=f"{MODEL}_bf16",
                        speculative_config={"mode": "mtp"}, dtype=torch.float32, mode="require").eval()
    assert type(target.draft).__module__ == "generated" + drafts.draft_target(MODEL)["module"].replace(".modeling", ".draft")
    assert torch.equal(target.draft.mtp.norm.weight, tensors["mtp.norm.weight"].float())
    assert not any(name.startswith("mtp.") for name, _ in target.named_parameters())


@pytest.fixture(scope="module")
def speculative_target(case):
    with drafts.vanilla_speculative_target(MODEL, case[0], f"{MODEL}_bf16") as target:
        yield target


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_speculative_greedy_is_the_target_greedy(speculative_target, k):
    assert type(speculative_target.draft).__module__ == drafts.build_modules(MODEL)[1].__name__
    drafts.assert_speculative_greedy_is_the_target_greedy(speculative_target, k, NEW)


def test_load_model_gives_the_mtp_draft_the_target_embedding_and_head(case):
    drafts.assert_the_mtp_draft_shares_the_target_embedding_and_head(MODEL, case[0], f"{MODEL}_bf16", "model.embed_tokens.weight")


def test_a_draft_the_target_tensors_cannot_serve_keeps_its_copies_and_says_why(case, caplog):
    drafts.assert_a_draft_of_another_dtype_keeps_its_copies(MODEL, case[0], caplog, "model.embed_tokens.weight")
