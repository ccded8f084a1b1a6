"""`python -m codegen explain` as a new user meets it (issue 2 "Done when"; RULES TG5, TG6, LR5)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from codegen.cli import main
from tests.registry.helpers import GOOD, write

ROOT = Path(__file__).resolve().parents[2]


def explain(capsys, *args):
    code = main(["explain", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_kimi_k3_on_sm_100_explains_every_layer_kind(capsys):
    # RULES TG6, LR5: no GPU needed, the SM is an argument.
    code, out, err = explain(capsys, "--model", "kimi_k3", "--sm", "100", "--parallel", "tp16_moetp4ep4")
    assert (code, err) == (0, "")
    assert "target kimi_k3_mxfp4__sm_100__tp16_moetp4ep4 " in out and ": claims this selection" in out
    assert "routed layers 1-92: checkpoint mxfp4 (model default routed format MXFP4), runs w4a16_mxfp4 (MXFP4 checkpoint, sm_100 preference)" in out
    assert "-> torch.grouped_mm.grouped_gemm.w4a16_mxfp4  TORCH, preferred" in out
    assert "torch.eager.loop.w4a16_mxfp4: NOT_HONORED (the target honors only torch.grouped_mm.grouped_gemm.w4a16_mxfp4)" in out
    assert "dense layers 0: no MoE" in out
    assert "draft layers: not selected (no speculative_config.mode; this model's drafts serve draft_target, dspark)" in out
    assert "tp16_moetp16ep1" not in out  # --parallel picks one target


def test_explain_shows_the_draft_layers_when_a_speculative_mode_is_set(capsys):
    # RULES DR1, LR5
    code, out, _ = explain(capsys, "--model", "kimi_k3", "--sm", "100", "--spec-mode", "draft_target")
    assert code == 0
    assert out.count("  draft layers 1: checkpoint bf16 (unquantized checkpoint), runs bf16 (checkpoint format)") == 2  # both targets


def test_explain_shows_excluded_and_draft_layers_with_their_notes(capsys):
    # RULES FN5, DR1 (scenario qwen3_next, no declared target: the generic build)
    code, out, _ = explain(capsys, "--model", "qwen3_next", "--sm", "100", "--tactic", "nvfp4", "--spec-mode", "mtp")
    assert code == 0
    assert "qwen3_next/generic: no declared target on sm_100" in out
    assert "  routed layers 1-46: checkpoint nvfp4" in out
    assert "  excluded layers 0, 47: checkpoint bf16" in out
    assert "  draft layers 48: checkpoint bf16 (excluded from quantization by 'mtp*')" in out
    assert "    warning: excluded layers 0, 47 run bf16 (excluded from quantization) and build under moe_config.backend 'AUTO', skipping moe_config.tactic 'nvfp4' (RULES FN5)" in out
    assert "  note: the draft resolves AUTO for its own weights: " in out


def test_a_misspelled_token_exits_2_with_a_suggestion(capsys):
    # RULES TA2
    code, out, err = explain(capsys, "--model", "kimi_k3", "--sm", "100", "--tactic", "grouped_mn")
    assert (code, out) == (2, "")
    assert err == "error: moe_config.tactic 'grouped_mn': unknown segment 'grouped_mn'; did you mean 'grouped_mm' or 'grouped_gemm'? (RULES TA2)\n"


def test_a_tactic_next_to_a_concrete_backend_exits_2_naming_both_fields(capsys):
    # RULES TA4
    code, out, err = explain(capsys, "--model", "kimi_k3", "--sm", "100", "--backend", "TORCH", "--tactic", "grouped_mm")
    assert (code, out) == (2, "")
    assert err == (
        "error: moe_config.tactic 'grouped_mm' is set next to moe_config.backend 'TORCH': a tactic is accepted only "
        "next to backend AUTO; set moe_config.backend to AUTO or drop the tactic (RULES TA4)\n"
    )


def test_a_draft_tactic_next_to_a_concrete_draft_backend_exits_2(capsys):
    # RULES TA4
    code, _, err = explain(capsys, "--model", "glm_5_2", "--sm", "107", "--spec-mode", "mtp", "--draft-backend", "VANILLA", "--draft-tactic", "nvfp4")
    assert code == 2
    assert err.startswith("error: speculative_config.moe_tactic 'nvfp4' is set next to speculative_config.moe_backend 'VANILLA': ")


def test_require_with_an_unhonored_tactic_exits_2_naming_tactic_target_and_ids(capsys):
    # RULES TG5
    code, out, err = explain(capsys, "--model", "kimi_k3", "--sm", "100", "--parallel", "tp16_moetp4ep4", "--tactic", "eager", "--mode", "require")
    assert code == 2
    assert "refuses this selection" in out and "-> fails (mode require) (RULES TG5)" in out
    assert err == (
        "error: --mode require: no target claims this selection: moe_config.tactic 'eager' resolves to "
        "torch.eager.loop.w4a8_mxfp4_mxfp8 for the routed layers 1-92 (format w4a8_mxfp4_mxfp8 on sm_100); this target "
        "honors only torch.grouped_mm.grouped_gemm.w4a16_mxfp4 (RULES TG3) (RULES TG5)\n"
    )


def test_auto_mode_with_an_unhonored_tactic_exits_0_and_names_the_generic_build(capsys):
    # RULES TG5
    code, out, _ = explain(capsys, "--model", "kimi_k3", "--sm", "100", "--parallel", "tp16_moetp4ep4", "--tactic", "eager")
    assert code == 0
    assert "-> the generic build generated/kimi_k3/generic serves instead (RULES TG5)" in out


def test_require_with_an_honored_tactic_exits_0(capsys):
    # RULES TG5
    code, _, err = explain(capsys, "--model", "kimi_k3", "--sm", "100", "--tactic", "grouped_mm", "--mode", "require")
    assert (code, err) == (0, "")


def test_a_glm_draft_tactic_is_refused_under_require_and_a_draft_backend_is_claimed(capsys):
    # RULES TG4, TG5 (scenario glm_5_2)
    code, _, err = explain(capsys, "--model", "glm_5_2", "--sm", "107", "--spec-mode", "mtp", "--draft-tactic", "eager", "--mode", "require")
    assert code == 2 and "this target declares no draft_moe_impls_honored, so it honors no tactic" in err
    code, out, err = explain(capsys, "--model", "glm_5_2", "--sm", "107", "--spec-mode", "mtp", "--draft-backend", "VANILLA", "--mode", "require")
    assert (code, err) == (0, "") and "claims this selection" in out


def test_json_output_parses_and_holds_the_reports(capsys):
    # RULES LR5
    code, out, _ = explain(capsys, "--model", "kimi_k3", "--sm", "100", "--json", "--spec-mode", "dspark", "--draft-tactic", "eager")
    assert code == 0
    payload = json.loads(out)
    assert (payload["model"], payload["sm"]) == ("kimi_k3", 100)
    assert payload["selection"]["draft_tactic"] == "*.eager.*.*"  # canonical
    assert [s["name"] for s in payload["sites"]] == ["kimi_k3_mxfp4__sm_100__tp16_moetp4ep4", "kimi_k3_mxfp4__sm_100__tp16_moetp16ep1"]
    layers = payload["sites"][0]["layers"]
    assert [(l["role"], l["winner"], l["selected_by"]) for l in layers] == [
        ("target", "torch.grouped_mm.grouped_gemm.w4a16_mxfp4", "preferred"),
        ("draft", "torch.eager.loop.bf16", "pinned"),
    ]
    assert all(s["claimed"] for s in payload["sites"])


def test_a_users_models_folder_is_explained(capsys, tmp_path):
    # RULES TG6 (issue 2 item 9: every command takes --models DIR)
    write(tmp_path / "mymodel.toml", GOOD)
    code, out, _ = explain(capsys, "--models", str(tmp_path), "--model", "mymodel", "--sm", "90")
    assert code == 0
    assert "target mymodel_bf16__sm_90__tp1 " in out and "-> torch.grouped_mm.grouped_gemm.bf16  TORCH, preferred" in out


def test_an_invalid_layout_or_an_unknown_model_exits_2(capsys):
    # RULES TG6, LR4
    code, _, err = explain(capsys, "--model", "kimi", "--sm", "100")
    assert code == 2 and err.startswith("error: unknown model 'kimi'; did you mean 'kimi_k3'?")
    code, _, err = explain(capsys, "--model", "kimi_k3", "--sm", "100", "--parallel", "tp3")
    assert code == 2
    assert err == (
        "error: moe_config.backend 'AUTO' found no implementation for routed layers 1-92 (format w4a16_mxfp4 on sm_100): "
        "cupy.mma.grouped_gemm.w4a16_mxfp4: SM_UNSUPPORTED (sm_100 is not among sm_90); "
        "torch.grouped_mm.grouped_gemm.w4a16_mxfp4: TOPOLOGY_UNSUPPORTED (intermediate size 2048 does not split over "
        "moetp3); torch.eager.loop.w4a16_mxfp4: TOPOLOGY_UNSUPPORTED (intermediate size 2048 does not split over "
        "moetp3) (RULES LR4)\n"
    )


@pytest.mark.parametrize("args, code", [(["--tactic", "grouped_mn"], 2), ([], 0)])
def test_python_dash_m_codegen_explain_exits_with_the_same_codes(args, code):
    # RULES TA2, TG6: the entry point a new user types
    run = subprocess.run(
        [sys.executable, "-m", "codegen", "explain", "--model", "kimi_k3", "--sm", "100", "--parallel", "tp16_moetp4ep4", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == code, run.stderr
    assert "Traceback" not in run.stderr
