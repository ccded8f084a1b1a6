"""`python -m codegen explain` as a new user meets it (issue 2 "Done when"; RULES TG5, TG6, LR5)."""

from __future__ import annotations

import itertools
import json
import re
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


KIMI_SM100 = """\
kimi_k3 (family deepseek_v3) on sm_100
selection: moe_config.backend 'AUTO'

target kimi_k3_mxfp4__sm_100__tp16_moetp4ep4 (honors 1 target id, any draft id): serves this selection (RULES TG6)
  claims: yes: claims this selection (RULES TG3, TG4)
  bound: yes: built with what this selection resolves to: torch.grouped_mm.grouped_gemm.w4a16_mxfp4 for layers 1-92
  draft: yes: needs no draft: no speculative_config.mode
  -> load_model loads kimi_k3_mxfp4__sm_100__tp16_moetp4ep4
  routed layers 1-92: checkpoint mxfp4 (model default routed format MXFP4), runs w4a16_mxfp4 (MXFP4 checkpoint, sm_100 preference: \
w4a8_mxfp4_mxfp8, w4a8_mxfp4_fp8 come first, but on sm_100 only VANILLA runs them, and a reference counts only alone (RULES FN2))
    request AUTO (moe_config.backend)
    -> torch.grouped_mm.grouped_gemm.w4a16_mxfp4  TORCH, preferred
       weights: kept packed, dequantized per expert group in the forward
       runs on sm_100: unverified (never run on that SM)
       also eligible: none
       turned down:   triton.wgmma.grouped_gemm.w4a16_mxfp4: SM_UNSUPPORTED (sm_100 is not among sm_90)
                      cupy.mma.grouped_gemm.w4a16_mxfp4: SM_UNSUPPORTED (sm_100 is not among sm_90)
                      torch.eager.loop.w4a16_mxfp4: NOT_HONORED (the target honors only torch.grouped_mm.grouped_gemm.w4a16_mxfp4)
  dense layers 0: no MoE
  draft layers: not selected (no speculative_config.mode; this model's drafts serve draft_target, dspark)
"""


def test_explain_kimi_k3_on_sm_100_says_what_runs_and_why(capsys):
    # RULES TG6, LR5, FN2: no GPU needed, the SM is an argument. What runs (the TORCH W4A16 layer, its
    # weights packed), why (AUTO's first eligible; W4A8 formats only emulated there), and that it never ran on sm_100.
    code, out, err = explain(capsys, "--model", "kimi_k3", "--sm", "100", "--parallel", "tp16_moetp4ep4")
    assert (code, err) == (0, "")
    assert out == KIMI_SM100


def test_the_readme_shows_what_explain_prints(capsys):
    # README "Reading `explain`" quotes the command above and its output; it must stay what the command prints.
    readme = (ROOT / "README.md").read_text()
    command = "$ python -m codegen explain --model kimi_k3 --sm 100 --parallel tp16_moetp4ep4\n"
    quoted = readme[readme.index(command) + len(command):]
    quoted = quoted[:quoted.index("```")]
    code, out, _ = explain(capsys, "--model", "kimi_k3", "--sm", "100", "--parallel", "tp16_moetp4ep4")
    assert (code, quoted) == (0, out)


def test_explain_json_for_kimi_k3_on_sm_100_carries_the_same_facts(capsys):
    code, out, _ = explain(capsys, "--model", "kimi_k3", "--sm", "100", "--parallel", "tp16_moetp4ep4", "--json")
    assert code == 0
    (site,) = json.loads(out)["sites"]
    (layer,) = site["layers"]
    assert site["loads"] == "kimi_k3_mxfp4__sm_100__tp16_moetp4ep4"
    assert (layer["winner"], layer["backend"], layer["selected_by"], layer["run_format"]) == (
        "torch.grouped_mm.grouped_gemm.w4a16_mxfp4", "TORCH", "preferred", "w4a16_mxfp4")
    assert layer["weights"] == "kept packed, dequantized per expert group in the forward"
    assert layer["verification"] == "runs on sm_100: unverified (never run on that SM)"
    assert layer["run_format_source"] == (
        "MXFP4 checkpoint, sm_100 preference: w4a8_mxfp4_mxfp8, w4a8_mxfp4_fp8 come first, but on sm_100 only "
        "VANILLA runs them, and a reference counts only alone (RULES FN2)")


def test_explain_says_an_implementation_ran_on_the_sm_where_its_tests_passed(capsys):
    code, out, _ = explain(capsys, "--model", "gpt_oss_120b", "--sm", "90")
    assert code == 0
    assert ("    -> triton.wgmma.grouped_gemm.w4a16_mxfp4  TRITON, preferred\n"
            "       weights: kept quantized, decoded in registers by the GEMM kernel\n"
            "       runs on sm_90: verified (tests passed there)\n") in out


def test_explain_shows_the_draft_layers_when_a_speculative_mode_is_set(capsys):
    # RULES DR1, LR5: both targets' builds hold their MTP draft
    code, out, _ = explain(capsys, "--model", "tiny_deepseek_v3", "--sm", "90", "--spec-mode", "mtp")
    assert code == 0
    assert out.count("  draft layers 3: checkpoint ") == 2
    assert out.count("  draft: yes: holds the draft this selection needs: its draft for speculative_config.mode 'mtp'") == 2


def test_a_target_whose_build_has_no_draft_does_not_serve_a_speculative_selection(capsys):
    # RULES TG6, SD3: kimi_k3's tp16_moetp16ep1 target honors any draft id, so it claims the selection,
    # but was built without a draft (its tp16_moetp4ep4 target holds the external drafter and serves).
    args = ("--model", "kimi_k3", "--sm", "100", "--parallel", "tp16_moetp16ep1", "--spec-mode", "draft_target")
    code, out, _ = explain(capsys, *args)
    assert code == 0
    assert out.count("  claims: yes: claims this selection (RULES TG3, TG4)\n") == 1
    assert out.count("  draft: no: built with no draft; this selection needs a draft for mode 'draft_target'\n") == 1
    assert out.count("  -> the generic build generated/kimi_k3/generic serves instead (RULES TG5); it binds:\n") == 1
    assert out.count("  note: the generic build holds no draft: it decodes without one (RULES SD3)\n") == 1
    assert "  draft layers 1:" not in out   # the generic build does not build them
    code, out, err = explain(capsys, *args, "--mode", "require")
    assert code == 2
    assert out.count("  draft layers 1: checkpoint bf16 (unquantized checkpoint), runs bf16 (checkpoint format)") == 1  # the claims narrated
    assert err == (
        "error: --mode require: no target serves this selection: "
        "kimi_k3_mxfp4__sm_100__tp16_moetp16ep1: built with no draft; this selection needs a draft for mode 'draft_target' (RULES TG5, TG6)\n"
    )
    code, out, _ = explain(capsys, "--model", "kimi_k3", "--sm", "100", "--spec-mode", "draft_target", "--mode", "require")
    assert code == 0 and "  -> load_model loads kimi_k3_mxfp4__sm_100__tp16_moetp4ep4\n" in out


def test_explain_shows_excluded_and_draft_layers_with_their_notes(capsys):
    # RULES FN5, DR1 (scenario qwen3_next: its target holds no draft, so the generic build serves mtp)
    code, out, _ = explain(capsys, "--model", "qwen3_next", "--sm", "100", "--tactic", "nvfp4", "--spec-mode", "mtp")
    assert code == 0
    assert "  draft: no: built with no draft; this selection needs a draft for mode 'mtp'" in out
    assert "  -> the generic build generated/qwen3_next/generic serves instead (RULES TG5); it binds:" in out
    assert "  routed layers 1-46: checkpoint nvfp4" in out
    assert "  excluded layers 0, 47: checkpoint bf16" in out
    # The generic build constructs Qwen3-Next's MTP draft (resolved at load): its draft layer resolves bf16, excluded
    # by 'mtp*', under the draft's own request.
    assert "  draft layers 48: checkpoint bf16 (excluded from quantization by 'mtp*'), runs bf16 (checkpoint format)" in out
    assert ("  draft build: target qwen3_next_nvfp4__sm_100__tp1 was generated with no draft, not mtp; "
            "generated/qwen3_next/generic/draft.py (embedded_mtp qwen3_next_mtp, resolved at load)") in out
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
    assert "does not serve this selection (RULES TG6)" in out and "-> fails (mode require) (RULES TG5)" in out
    assert err == (
        "error: --mode require: no target serves this selection: kimi_k3_mxfp4__sm_100__tp16_moetp4ep4: moe_config.tactic 'eager' resolves to "
        "torch.eager.loop.w4a8_mxfp4_mxfp8 for the routed layers 1-92 (format w4a8_mxfp4_mxfp8 on sm_100); this target "
        "honors only torch.grouped_mm.grouped_gemm.w4a16_mxfp4 (RULES TG3) (RULES TG5, TG6)\n"
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


def test_a_glm_draft_tactic_is_refused_under_require_and_a_draft_backend_is_served_only_by_the_draft_it_binds(capsys):
    # RULES TG4, TG5 (scenario glm_5_2); TG6: a target serves the draft backend only when its draft binds what it resolves to
    code, _, err = explain(capsys, "--model", "glm_5_2", "--sm", "107", "--spec-mode", "mtp", "--draft-tactic", "eager", "--mode", "require")
    assert code == 2 and "this target declares no draft_moe_impls_honored, so it honors no tactic" in err
    code, out, err = explain(capsys, "--model", "glm_5_2", "--sm", "107", "--spec-mode", "mtp", "--draft-backend", "VANILLA", "--mode", "require")
    # The NVFP4 target's build holds its MTP draft bound to VANILLA's nvfp4 loop: it serves.
    assert (code, err) == (0, "")
    assert out.count("  claims: yes: claims this selection (RULES TG3, TG4)\n") == 2
    assert ("  draft: yes: holds the draft this selection needs: its draft for speculative_config.mode 'mtp' "
            "(torch.eager.loop.nvfp4 for layers 92)\n") in out
    assert "  -> load_model loads glm_5_2_nvfp4__sm_107__low_latency\n" in out
    # The FP8-block-MTP target claims the draft backend, but its draft was bound to TORCH's fp8 GEMM.
    assert ("  draft: no: built with its draft for speculative_config.mode 'mtp' (torch.grouped_mm.grouped_gemm.fp8_block_scales "
            "for layers 92); this selection needs mode 'mtp' (torch.eager.loop.fp8_block_scales for layers 92)\n") in out


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
        "triton.wgmma.grouped_gemm.w4a16_mxfp4: SM_UNSUPPORTED (sm_100 is not among sm_90); "
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


# --- FN4: the widened tactic a message suggests is itself accepted; SM per candidate (issue 10 §3) ---

SUGGESTED = re.compile(r"; '([^']+)' covers [a-z0-9_, ]+ within [A-Z]+ \(RULES FN4\)\n$")


def _tactics() -> list[str]:
    """Every tactic spelled from the segments of the registered ids (in segment order)."""
    from registry.impls import load_registry

    out = set()
    for impl in load_registry().impls:
        segments = str(impl.id).split(".")
        for n in range(1, len(segments) + 1):
            out |= {".".join(c) for c in itertools.combinations(segments, n)}
    return sorted(out)


@pytest.mark.parametrize("model, checkpoint", [("deepseek_v3", "deepseek_v3_fp8"), ("tiny_gpt_oss", "tiny_gpt_oss_bf16"),
                                               ("tiny_glm4_moe", "tiny_glm4_moe_bf16")])
def test_every_widened_tactic_a_message_suggests_is_accepted_when_fed_back(capsys, model, checkpoint):
    # RULES FN4: one backend per format, and it resolves (every eligibility gate) for each layer kind of
    # the checkpoint the refusal is about (a model's checkpoints may need different backends: no TRITON
    # tactic serves tiny_gpt_oss's MXFP4 checkpoint, 'triton' is the right advice for its bf16 one)
    where = ("--model", model, "--checkpoint", checkpoint, "--sm", "90")
    suggested = 0
    for tactic in _tactics():
        code, _, err = explain(capsys, *where, "--tactic", tactic)
        found = SUGGESTED.search(err)
        if code == 2 and found:
            suggested += 1
            again, _, err2 = explain(capsys, *where, "--tactic", found.group(1))
            assert (again, err2) == (0, ""), f"{tactic!r} suggested {found.group(1)!r}, refused: {err2}"
    assert suggested > 0


def test_a_widened_tactic_fn3_would_refuse_is_not_suggested(capsys):
    # RULES FN4: dropping 'bf16' leaves 'grouped_gemm', which names CUPY and TORCH for fp8_block_scales (FN3)
    code, out, err = explain(capsys, "--model", "deepseek_v3", "--sm", "90", "--tactic", "grouped_gemm.bf16")
    assert (code, out) == (2, "")
    assert err == (
        "error: moe_config.tactic 'grouped_gemm.bf16' names no implementation of fp8_block_scales on sm_90, the format of "
        "routed layers 3-60 (checkpoint quant_algo FP8_BLOCK_SCALES); fp8_block_scales is served by "
        "triton.wgmma.grouped_gemm.fp8_block_scales ('triton.fp8_block_scales'), cupy.mma.grouped_gemm.fp8_block_scales "
        "('cupy.fp8_block_scales'), torch.grouped_mm.grouped_gemm.fp8_block_scales "
        "('grouped_mm.fp8_block_scales'), torch.eager.loop.fp8_block_scales ('eager.fp8_block_scales'); no tactic of one "
        "backend covers fp8_block_scales: select by backend (moe_config.backend) instead (RULES FN4)\n"
    )


def test_a_widened_tactic_no_implementation_of_passes_the_shape_gate_is_not_suggested(capsys):
    # RULES FN4: 'cupy' names cupy.mma.grouped_gemm.bf16, which the tiny intermediate size (32) turns down
    code, _, err = explain(capsys, "--model", "tiny_glm4_moe", "--sm", "90", "--tactic", "cupy.fp8_block_scales")
    assert code == 2
    assert err.endswith("; no tactic of one backend covers bf16: select by backend (moe_config.backend) instead (RULES FN4)\n")


def test_an_implementation_that_does_not_run_on_the_sm_is_reported_per_candidate(capsys):
    # RULES LR2, LR3: the tactic names a bf16 implementation; it is turned down SM_UNSUPPORTED, not "names none"
    code, out, err = explain(capsys, "--model", "tiny_qwen3_moe", "--sm", "100", "--tactic", "cupy.mma")
    assert (code, out) == (2, "")
    assert err == (
        "error: moe_config.tactic 'cupy.mma' pins routed layers 0-1 (format bf16 on sm_100), but no implementation it "
        "names can serve it: cupy.mma.grouped_gemm.bf16: SM_UNSUPPORTED (sm_100 is not among sm_90) (RULES LR3)\n"
    )


def test_the_generic_build_shows_no_refusal_for_a_target_nobody_declared(capsys):
    # issue 10 §3: no target on sm_103 for deepseek_r1_nvfp4, so nothing can refuse the tactic
    code, out, err = explain(capsys, "--model", "deepseek_r1_nvfp4", "--sm", "103", "--tactic", "torch", "--json")
    assert (code, err) == (0, "")
    (site,) = json.loads(out)["sites"]
    assert (site["name"], site["target"], site["claimed"], site["refusals"], site["criteria"]) == (
        "deepseek_r1_nvfp4/generic", False, True, [], []
    )
    code, out, _ = explain(capsys, "--model", "deepseek_r1_nvfp4", "--sm", "103", "--tactic", "torch")
    assert code == 0 and "refus" not in out and "honor" not in out
