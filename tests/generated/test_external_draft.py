"""The generated external drafter (`draft.py` of tiny_kimi_k3's sm_90 target, a Qwen3-MoE drafter) is its own family's build, bound to the draft selection, behind the draft interface; a drafter whose vocabulary differs from the target's is refused when its declaration loads.

Oracle: transformers' Qwen3-MoE model of the drafter's config, saved by transformers with random weights and
run in float64. The draft runs in fp32 with its bound TORCH experts, which round their GEMM inputs to bf16:
relative L2 error of the logits <= 1e-2 (two layers deep; observed ~2e-3).
"""
from __future__ import annotations

import pytest
import torch

from registry.declarations import load_declaration
from registry.errors import DeclarationError
from tests.generated import builds

TARGET = "tiny_kimi_k3_mxfp4__sm_90__tp1"
DECLARATION = builds.ROOT / "registry" / "models" / "tiny_kimi_k3.toml"


def _draft_config() -> dict:
    decl = builds.declarations()["tiny_kimi_k3"]
    return dict(next(d for d in decl.drafts if d.kind == "external").config)


@pytest.fixture(scope="module")
def case():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {k: v for k, v in _draft_config().items() if k != "architectures"}
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **config), dtype=torch.bfloat16)
    builds.randomize(hf, 3)
    folder = builds.tmp_folder("tiny_kimi_k3_drafter")
    hf.save_pretrained(folder)
    module = builds.load(f"generated.tiny_kimi_k3.{TARGET}.draft")
    draft = module.DRAFT_CLASS(dtype=torch.float32)
    report = draft.load_checkpoint(folder)
    return module, draft, report, builds.transformers_model(folder, torch.float64)


def test_the_draft_is_the_drafters_own_build_bound_to_the_draft_selection(case):
    module, draft, report, _ = case
    assert module.FAMILY == "qwen3_moe" and module.MODE == "draft_target"
    assert module.DRAFT_LAYERS == ((0, "torch.grouped_mm.grouped_gemm.bf16"), (1, "torch.grouped_mm.grouped_gemm.bf16"))
    assert type(draft).INPUT == "tokens"
    assert list(report.ignored) == [] and report.tensors == len(builds.read_tensors(builds.tmp_folder("tiny_kimi_k3_drafter")))


def test_the_draft_matches_transformers_and_its_cache_reproduces_the_full_forward(case):
    _, draft, _, hf = case
    ids = builds.token_ids(512, 2, 10)
    assert torch.equal(draft.to_target_ids(ids), ids)
    with torch.no_grad():
        logits, hidden = draft(ids, torch.arange(10)), draft.hidden_states(ids, torch.arange(10))
        expected = hf(ids).logits
        caches = draft.new_caches(2, 16)
        steps = [draft(ids[:, t:t + 1], torch.tensor([t]), caches) for t in range(10)]
    assert hidden.shape == (2, 10, 64)
    assert builds.rel_err(logits, expected) <= 1e-2
    # Not bit-equal: fp32 attention sums in another order per step and the experts round their inputs to
    # bf16 (observed <= 4e-4 per position; a rare router flip moves one position): a draft that ignored its
    # cache is off by 0.5-1 at the later positions (measured).
    errors = builds.per_position_err(torch.cat(steps, 1), logits)
    assert errors.median() <= 1e-3, errors


def test_a_drafter_with_another_vocabulary_is_refused_where_it_is_declared(tmp_path):
    text = DECLARATION.read_text(encoding="utf-8")
    drafter = text.index('name = "tiny_kimi_k3_drafter"')
    bad = text[:drafter] + text[drafter:].replace("vocab_size = 512", "vocab_size = 1024", 1)
    path = tmp_path / "tiny_kimi_k3.toml"
    path.write_text(bad, encoding="utf-8")
    with pytest.raises(DeclarationError) as info:
        load_declaration(path)
    line = bad[:bad.index("vocab_size = 1024")].count("\n") + 1
    assert str(info.value) == (
        f"{path}:{line}: drafts[0].config.vocab_size: the external drafter tiny_kimi_k3_drafter has vocab_size 1024 and "
        "the target 512: an external drafter shares the target's vocabulary; declare a drafter with the target's tokenizer"
    )


def test_a_draft_that_keeps_its_own_folder_is_not_read_from_the_targets(tmp_path):
    # The external drafter's tensors are not in the target's checkpoint: load_model asks for their folder.
    import generated
    from generated import run
    from registry.errors import SelectionError

    run.write_tiny("tiny_kimi_k3", 90, "tiny_kimi_k3_mxfp4", tmp_path, seed=0)
    with pytest.raises(SelectionError) as caught:
        generated.load_model("tiny_kimi_k3", 90, checkpoint=str(tmp_path), checkpoint_name="tiny_kimi_k3_mxfp4",
                             speculative_config={"mode": "draft_target"}, dtype=torch.float32)
    assert str(caught.value) == ("the external draft of tiny_kimi_k3 keeps its weights in a folder of its own: "
                                 "pass draft_checkpoint=DIR to load_model (--draft-checkpoint DIR to python -m generated.run)")
