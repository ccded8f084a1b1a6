"""The generated external drafter (`draft.py` of tiny_kimi_k3's sm_90 target, a Qwen3-MoE drafter) is its own family's build, bound to the draft selection, behind the draft interface; a drafter whose vocabulary differs from the target's is refused when its declaration loads.

`python -m generated.run --spec-mode draft_target --draft-checkpoint DIR` decodes with the drafter's folder, and
refuses a folder it cannot use (or a missing one the draft needs) before any rank starts.

Oracle: transformers' Qwen3-MoE model of the drafter's config, saved by transformers with random weights and
run in float64. The draft runs in fp32 with its bound TORCH experts, which round their GEMM inputs to bf16:
relative L2 error of the logits <= 1e-2 (two layers deep; observed ~2e-3).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from registry.declarations import load_declaration
from registry.errors import DeclarationError
from tests.generated import builds, helpers_drafts

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
    # Per position against transformers in float64: about 1e-3 (the experts take bf16 inputs). Now and then a router
    # near-tie flips one position's experts (2 of 60 fresh draws measured: that position 0.12-0.17, its followers up to
    # 1e-2 through attention), so one position may stand out; a wrong draft is off at every position.
    versus_hf = builds.per_position_err(logits, expected)
    assert versus_hf.median() <= 5e-3 and (versus_hf > 1e-2).sum() <= 1, versus_hf
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


def test_load_model_refuses_a_drafter_folder_missing_a_tensor_before_the_target_loads(tmp_path, monkeypatch):
    # The draft's folder is checked from its headers first: a real target's load takes minutes, and the draft's own
    # load would find the missing tensor only after it. The spy records every build's load, the drafter's included
    # (a causal LM build too): nothing loads before the refusal.
    from generated import load_model, run
    from runtime.causal_lm import CausalLMBuild
    from runtime.checkpoint import CheckpointError

    target = run.write_tiny("tiny_kimi_k3", 90, "tiny_kimi_k3_mxfp4", tmp_path / "target", seed=0)
    tensors = helpers_drafts.drafter_tensors()
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    drafter = helpers_drafts.drafter_folder(tmp_path / "drafter", tensors)
    loads = []
    monkeypatch.setattr(CausalLMBuild, "load_checkpoint", lambda self, path, progress=None: loads.append(path))
    with pytest.raises(CheckpointError) as caught:
        load_model("tiny_kimi_k3", 90, checkpoint=str(target), speculative_config={"mode": "draft_target"},
                   draft_checkpoint=str(drafter))
    assert str(caught.value) == (
        f"{drafter} does not fit the draft tiny_kimi_k3_drafter of tiny_kimi_k3: missing tensor "
        "model.layers.1.self_attn.k_proj.weight: the build expects shape (32, 64) bfloat16; pass a checkpoint of the "
        "declared draft (draft_checkpoint=DIR, --draft-checkpoint DIR)")
    assert loads == []


# -- the launcher: `python -m generated.run --spec-mode draft_target --draft-checkpoint DIR` ---------------------------

DRAFTER = helpers_drafts.EXTERNAL_DRAFTER
LAUNCH = ["--model", "tiny_kimi_k3", "--sm", "90", "--tokens", "5,6,7", "--generate", "8"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the target's tiny checkpoint, the declared drafter's folder)."""
    from generated import run

    root = tmp_path_factory.mktemp("launcher-drafter")
    target = run.write_tiny("tiny_kimi_k3", 90, "tiny_kimi_k3_mxfp4", root / "target", seed=0)
    return Path(target), Path(helpers_drafts.drafter_folder(root / "drafter"))


def test_the_launcher_decodes_with_the_drafter_folder_it_is_given(folders, capsys):
    from generated import run

    target, drafter = folders
    assert run.main([*LAUNCH, "--checkpoint", str(target)]) == 0
    plain = capsys.readouterr().out.strip().splitlines()
    code = run.main([*LAUNCH, "--checkpoint", str(target), "--spec-mode", "draft_target", "--draft-tokens", "3",
                     "--draft-checkpoint", str(drafter)])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.strip().splitlines()
    assert lines[0] == f"{TARGET}: generated.tiny_kimi_k3.{TARGET}.modeling on 1 rank (gloo, cpu)"
    assert re.fullmatch(r"row 0 \(3 tokens\) generated: " + ", ".join([r"\d+"] * 8), lines[1]), out
    stats = re.fullmatch(r"speculative: (\d+) target steps, (\d+) proposed, (\d+) accepted \([\d.]+%\), "
                         r"acceptance length [\d.]+, \d+ near-tie tokens", lines[3])
    assert stats, out
    rounds, proposed, accepted = int(stats[1]), int(stats[2]), int(stats[3])
    assert proposed == 3 * rounds and 1 + rounds + accepted >= 8
    # Greedy speculative decoding keeps the target's own greedy tokens (RULES SD1).
    assert lines[1] == plain[1]


def test_the_launcher_refuses_a_drafter_folder_of_another_model_before_any_rank_starts(folders, tmp_path, capsys, no_ranks):
    from generated import run

    target, _ = folders
    drafter = helpers_drafts.drafter_folder(tmp_path / "drafter", rope_theta=500000.0)
    code = run.main([*LAUNCH, "--checkpoint", str(target), "--spec-mode", "draft_target", "--draft-checkpoint", str(drafter)])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"python -m generated.run: error: {drafter}/config.json describes another model than the draft {DRAFTER} of "
        "tiny_kimi_k3: config.rope_theta is 500000.0 in the checkpoint, 1000000.0 in the build. Loaded, it would compute "
        "another model's logits: pass a checkpoint of the declared drafter (draft_checkpoint=DIR, --draft-checkpoint DIR), "
        "or declare this folder's "
        f"config as the config of tiny_kimi_k3's [[drafts]] entry {DRAFTER} and generate its builds")


@pytest.mark.parametrize("case", ["no spec mode", "no folder", "a file", "no draft: ngram", "no draft: generic build",
                                  "external, none given", "eagle3, none given"])
def test_the_launcher_refuses_a_draft_folder_it_cannot_use_before_any_rank_starts(folders, tmp_path, capsys, no_ranks, case):
    from generated import run

    target, drafter = folders
    run_target = [*LAUNCH, "--checkpoint", str(target)]
    spec = ["--spec-mode", "draft_target"]
    own = "keeps its weights in a folder of its own: pass draft_checkpoint=DIR to load_model (--draft-checkpoint DIR to python -m generated.run)"
    args, message = {
        "no spec mode": ([*run_target, "--draft-checkpoint", str(drafter)],
                         "--draft-checkpoint gives the folder of the draft a speculative mode loads: give --spec-mode too"),
        "no folder": ([*run_target, *spec, "--draft-checkpoint", str(tmp_path / "missing")],
                      f"--draft-checkpoint takes the draft's checkpoint folder; {tmp_path / 'missing'} is not a folder"),
        "a file": ([*run_target, *spec, "--draft-checkpoint", str(drafter / "config.json")],
                   f"--draft-checkpoint takes the draft's checkpoint folder; {drafter / 'config.json'} is not a folder"),
        "no draft: ngram": ([*run_target, "--spec-mode", "ngram", "--draft-checkpoint", str(drafter)],
                            "--draft-checkpoint gives a draft's folder, but this run loads no draft: "
                            "speculative_config.mode 'ngram' has no neural draft: decoded with the target alone"),
        # sm_100 has no target with the drafter: the generic build serves, and it constructs no external drafter.
        "no draft: generic build": ([*run_target, "--sm", "100", *spec, "--draft-checkpoint", str(drafter)],
                                    "--draft-checkpoint gives a draft's folder, but this run loads no draft: the generic "
                                    "build of tiny_kimi_k3 constructs no draft for mode 'draft_target': decoded with the target alone"),
        "external, none given": ([*run_target, *spec], f"the external draft of tiny_kimi_k3 {own}"),
        "eagle3, none given": (["--model", "tiny_qwen3_moe", "--sm", "120", "--tiny", "--generate", "4", "--spec-mode", "eagle3"],
                               f"the eagle3 draft of tiny_qwen3_moe {own}"),
    }[case]
    assert run.main(args) == 2
    assert capsys.readouterr().err.strip() == f"python -m generated.run: error: {message}"
