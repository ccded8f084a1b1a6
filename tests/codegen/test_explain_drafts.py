"""`explain` names the draft build that serves a speculative selection, per site (RULES TG6), and the build index states each target's draft build."""
from __future__ import annotations

import importlib

from codegen.cli import main


def _explain(capsys, *args) -> list[str]:
    assert main(["explain", *args]) == 0
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("  draft build: ")]


def test_a_target_generated_with_the_mode_names_its_draft_build(capsys):
    assert _explain(capsys, "--model", "deepseek_r1_nvfp4", "--sm", "100", "--parallel", "tp8", "--spec-mode", "mtp") == [
        "  draft build: generated/deepseek_r1_nvfp4/deepseek_r1_nvfp4__sm_100__tp8/draft.py (embedded_mtp deepseek_r1_mtp)"]
    assert _explain(capsys, "--model", "tiny_qwen3_moe", "--sm", "120", "--parallel", "tp1", "--spec-mode", "eagle3") == [
        "  draft build: generated/tiny_qwen3_moe/tiny_qwen3_moe_bf16__sm_120__tp1/draft.py (eagle3 tiny_qwen3_moe_eagle3)"]


def test_a_target_generated_without_the_mode_and_the_generic_build_say_none_serves(capsys):
    assert _explain(capsys, "--model", "kimi_k3", "--sm", "100", "--parallel", "tp16_moetp16ep1", "--spec-mode", "draft_target") == [
        "  draft build: none (target kimi_k3_mxfp4__sm_100__tp16_moetp16ep1 was generated with no draft, not draft_target; "
        "generic builds construct only the embedded or replacement-head MTP drafts of deepseek_v3, glm4_moe, nemotron_h and qwen3_next "
        "and the draft stages of deepseek_v3 and glm4_moe; the external draft kimi_k3_drafter is declared)"]
    assert _explain(capsys, "--model", "kimi_k3", "--sm", "90", "--parallel", "tp16_moetp4ep4", "--spec-mode", "draft_target") == [
        "  draft build: none (generic builds construct only the embedded or replacement-head MTP drafts of deepseek_v3, glm4_moe, "
        "nemotron_h and qwen3_next and the draft stages of deepseek_v3 and glm4_moe; the external draft kimi_k3_drafter is declared)"]


def test_a_family_that_refuses_its_embedded_mtp_says_why_none_serves(capsys):
    # minimax_m2's published checkpoints carry no MTP tensors (families/minimax_m2/spec.py): nothing builds the draft.
    assert _explain(capsys, "--model", "minimax_m3", "--sm", "103", "--parallel", "tp4", "--spec-mode", "mtp") == [
        "  draft build: none (target minimax_m3_nvfp4__sm_103__tp4 was generated with no draft, not mtp; generic builds "
        "construct only the embedded or replacement-head MTP drafts of deepseek_v3, glm4_moe, nemotron_h and qwen3_next "
        "and the draft stages of deepseek_v3 and glm4_moe; the embedded_mtp draft minimax_m3_mtp is declared; MiniMax-M2 "
        "checkpoints as published carry no MTP weights (their config's num_mtp_modules notwithstanding))"]


def test_the_generic_build_names_its_mtp_draft(capsys):
    assert _explain(capsys, "--model", "deepseek_r1_nvfp4", "--sm", "90", "--parallel", "tp8", "--spec-mode", "mtp") == [
        "  draft build: generated/deepseek_r1_nvfp4/generic/draft.py (embedded_mtp deepseek_r1_mtp, resolved at load)"]


def test_the_generic_build_names_its_draft_stages_and_narrates_their_own_format(capsys):
    # RULES TG6, DR7 (scenario deepseek_v4_flash on sm_90: no target, the generic build constructs the stages).
    assert main(["explain", "--model", "deepseek_v4_flash", "--sm", "90", "--parallel", "tp8", "--spec-mode", "dspark"]) == 0
    out = capsys.readouterr().out
    assert ("  draft build: generated/deepseek_v4_flash/generic/draft.py (draft_stages deepseek_v4_flash_stages, resolved at load)\n"
            in out)
    assert ("  draft layers 61-62: checkpoint mxfp4 (per-layer entry 'model.draft_stages.*.mlp.experts.*': W4A16_MXFP4), "
            "runs w4a16_mxfp4 (MXFP4 checkpoint, sm_90 preference)\n") in out
    assert "  routed layers 3-60: checkpoint nvfp4 (per-layer entry 'model.layers.*.mlp.experts.*': NVFP4)" in out
    assert "holds no draft" not in out
    # The same with a target that does not serve: the generic build that loads instead holds the stages.
    lines = _explain(capsys, "--model", "tiny_deepseek_v4_flash", "--sm", "90", "--spec-mode", "dspark", "--backend", "VANILLA")
    assert lines == ["  draft build: target tiny_deepseek_v4_flash_mixed__sm_90__tp1 does not serve (criteria above); "
                     "generated/tiny_deepseek_v4_flash/generic/draft.py (draft_stages tiny_deepseek_v4_flash_stages, resolved at load)"]


def test_a_target_without_the_mode_names_the_generic_draft_that_loads_instead(capsys):
    # The targets bind TORCH; a VANILLA selection loads the generic build, which constructs the MTP draft.
    lines = _explain(capsys, "--model", "tiny_deepseek_v3", "--sm", "90", "--spec-mode", "mtp", "--backend", "VANILLA")
    assert lines == [
        f"  draft build: target tiny_deepseek_v3_{fmt}__sm_90__tp1 does not serve (criteria above); "
        "generated/tiny_deepseek_v3/generic/draft.py (embedded_mtp tiny_deepseek_v3_mtp, resolved at load)"
        for fmt in ("bf16", "fp8")
    ]


def test_the_build_index_states_each_targets_draft_build():
    index = importlib.import_module("generated._build_index").INDEX
    by_name = {t["name"]: t for t in index["targets"]}
    assert by_name["kimi_k3_mxfp4__sm_100__tp16_moetp4ep4"]["draft"] == {
        "module": ".kimi_k3.kimi_k3_mxfp4__sm_100__tp16_moetp4ep4.draft", "name": "kimi_k3_drafter", "kind": "external"}
    assert by_name["kimi_k3_mxfp4__sm_100__tp16_moetp16ep1"]["draft"] is None
    for target in index["targets"]:
        if target["draft"] is not None:
            module = importlib.import_module(target["draft"]["module"], "generated")
            assert module.DRAFT == target["draft"]["name"] and module.MODE == target["spec_mode"]
